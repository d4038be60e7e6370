"""GGUF files (llama.cpp's format) as a model: config, tokenizer and tensors from one file.

The metadata is read by transformers' GGUF support (config, tokenizer, chat template) and the
tensors by the `gguf` package (a memory map; no hand-written parser). Each tensor is
dequantized at load, by `gguf.quants`, into the model dtype, and only after a weight loader has
narrowed it to its rank's rows (and, where the quantization blocks allow, columns), so a rank
reads only its shard. llama.cpp's converter permutes a Llama's q / k rows into its interleaved
rotary order; they are permuted back here, as transformers does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from steadylm import platform
from steadylm.errors import ModelLoadError

logger = logging.getLogger(__name__)
STEADYLM_META = "steadylm_gguf.json"  # what the cache folder holds beside the HF files

# The GGUF architectures (general.architecture) read here. llama.cpp writes Mistral (and every
# Llama-shaped model) as "llama"; transformers tells Mistral apart by general.name.
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# transformers' model_type for a GGUF file -> the architectures entry steadylm registers
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Tensor types dequantized at load (the `gguf` package's numpy dequantizers).
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
# The float dtype a GGUF "checkpoint" is in, for dtype="auto": a quantized file computes in
# bf16 where the device has it (platform.resolve_dtype), as a bf16 checkpoint would.
_FILE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ModelLoadError(
            "reading a .gguf file needs the `gguf` package: pip install gguf"
        ) from None
    return gguf


def find_gguf(path: str) -> str | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a directory that has
    no config.json. None for anything else (a safetensors directory, a config.json)."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(found) > 1:
        raise ModelLoadError(
            f"{path} holds {len(found)} GGUF files ({', '.join(found[:4])}); pass the one to "
            "load as the model path"
        )
    return os.path.join(path, found[0]) if found else None


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime: float) -> Any:
    try:
        return _gguf().GGUFReader(path)
    except (ValueError, OSError) as exc:  # a bad magic, a truncated file
        raise ModelLoadError(f"cannot read {path} as GGUF: {exc}") from exc


def reader(path: str) -> Any:
    """The file's `gguf.GGUFReader` (memory-mapped; one per file and modification time)."""
    return _reader(path, os.path.getmtime(path))


def _field(r: Any, key: str) -> Any:
    f = r.fields.get(key)
    return None if f is None else f.contents()


def check_file(path: str) -> str:
    """Architecture and tensor types of `path` checked before anything is allocated; returns
    the GGUF architecture name."""
    r = reader(path)
    arch = _field(r, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    experts = _field(r, f"{arch}.expert_count")
    if experts:
        raise ModelLoadError(
            f"{path}: a mixture of experts in GGUF ({experts} experts; llama.cpp writes "
            "Mixtral as 'llama') is not supported yet; load its safetensors checkpoint"
        )
    split = _field(r, "split.count")
    if split and split > 1:
        raise ModelLoadError(
            f"{path} is part 1 of a {split}-part split GGUF; merge the parts first "
            "(llama.cpp's `llama-gguf-split --merge`)"
        )
    bad = sorted({t.tensor_type.name for t in r.tensors} - set(SUPPORTED_TYPES))
    if bad:
        names = [t.name for t in r.tensors if t.tensor_type.name in bad]
        raise ModelLoadError(
            f"{path}: tensor type {', '.join(bad)} (in {names[0]}"
            f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}) is not supported; "
            f"supported: {', '.join(SUPPORTED_TYPES)}"
        )
    return arch


def _metadata_cache(path: str) -> str:
    """This file's folder in the cache: keyed by its real path, size and modification time,
    and transformers' version (which converts the tokenizer)."""
    import transformers

    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(platform.cache_dir(), "gguf", digest)


def _write_cache(path: str, config: Any, dtype: str, tokenizer: Any | None) -> None:
    """Save the converted config (and tokenizer) where the next start finds them; written
    to a temporary folder and renamed, so a reader never sees half of it. A cache that
    cannot be written costs only the next start's time."""
    final, tmp = _metadata_cache(path), None
    try:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(final))
        config.to_json_file(os.path.join(tmp, "config.json"))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, STEADYLM_META), "w") as f:
            json.dump({"torch_dtype": dtype, "tokenizer": tokenizer is not None}, f)
        if os.path.isdir(final):  # the other half (tokenizer or config) is already there
            shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tmp = None
    except OSError as exc:  # a read-only home, or another process renamed its copy first
        logger.info("GGUF metadata cache not written (%s): the next start converts again", exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _cached_meta(path: str) -> tuple[str, dict] | None:
    folder = _metadata_cache(path)
    try:
        with open(os.path.join(folder, STEADYLM_META)) as f:
            return folder, json.load(f)
    except (OSError, ValueError):
        return None


def load_hf_config(path: str) -> tuple[Any, str]:
    """(HF config, checkpoint dtype name) of a GGUF file, through transformers (converted
    once per file, then read from the cache)."""
    from transformers import AutoConfig

    cached = _cached_meta(path)
    if cached is not None:
        folder, meta = cached
        return AutoConfig.from_pretrained(folder), meta["torch_dtype"]
    hf, dtype = _convert_config(path)
    _write_cache(path, hf, dtype, None)
    return hf, dtype


def _convert_config(path: str) -> tuple[Any, str]:
    from transformers import AutoConfig

    arch = check_file(path)
    try:
        hf = AutoConfig.from_pretrained(**_hf_args(path))
    except (ValueError, KeyError, OSError, TypeError) as exc:
        raise ModelLoadError(f"cannot read the config in {path}: {exc}") from exc
    name = ARCHITECTURES.get(hf.model_type)
    if name is None or (arch != "llama" and ARCHITECTURES[arch] != name):
        raise ModelLoadError(f"{path}: transformers reads model_type {hf.model_type!r}")
    hf.architectures = [name]
    # Qwen3's head_dim is not hidden / heads (0.6B: 1024 / 16 != 128), and transformers'
    # GGUF config reads it for Llama only; the file's key_length says it for every arch.
    key_length = _field(reader(path), f"{arch}.attention.key_length")
    if key_length:
        hf.head_dim = int(key_length)
    return hf, _checkpoint_dtype(reader(path))


def _hf_args(path: str) -> dict[str, Any]:
    """transformers' arguments for a local GGUF file (never the hub)."""
    path = os.path.abspath(path)
    return {
        "pretrained_model_name_or_path": os.path.dirname(path),
        "gguf_file": os.path.basename(path),
        "local_files_only": True,
    }


def _checkpoint_dtype(r: Any) -> str:
    types = {t.tensor_type.name for t in r.tensors if len(t.shape) > 1}
    if len(types) == 1 and next(iter(types)) in _FILE_DTYPES:
        return _FILE_DTYPES[next(iter(types))]
    return "bfloat16"


def load_tokenizer(path: str) -> Any:
    """The file's tokenizer and chat template, as transformers converts them (once per file,
    then from the cache)."""
    from transformers import AutoTokenizer

    cached = _cached_meta(path)
    if cached is not None and cached[1].get("tokenizer"):
        return AutoTokenizer.from_pretrained(cached[0])
    check_file(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(**_hf_args(path))
    except (ValueError, KeyError, OSError, TypeError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {exc}") from exc
    config, dtype = load_hf_config(path)
    _write_cache(path, config, dtype, tokenizer)
    return tokenizer


class GGUFSlice:
    """One GGUF tensor in the logical (rows, cols) order that a `CheckpointTensor` narrows;
    `[rows, cols]` dequantizes only those rows (and those columns' blocks when they align)."""

    def __init__(self, tensor: Any, permute_heads: int | None = None) -> None:
        self.tensor = tensor
        self.qtype = tensor.tensor_type
        self.shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne0 first
        self.permute_heads = permute_heads  # llama.cpp's q / k row order, per head

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        rows = index[0] if index else slice(None)
        r0, r1, _ = rows.indices(self.shape[0])
        if self.permute_heads:  # whole heads: the permutation moves rows within a head
            per = self.shape[0] // self.permute_heads
            lo, hi = r0 // per * per, -(-r1 // per) * per
            block = _unpermute(self._read(lo, hi, index[1:]), hi - lo, per)
            return block[r0 - lo : r1 - lo]
        return self._read(r0, r1, index[1:])

    def _read(self, r0: int, r1: int, rest: tuple[slice, ...]) -> torch.Tensor:
        gguf = _gguf()
        data = self.tensor.data  # (rows, bytes per row) quantized; (rows, cols) float
        if len(self.shape) == 1:
            return torch.from_numpy(_to_f32(gguf, data[r0:r1], self.qtype).copy())
        cols = rest[0] if rest else slice(None)
        c0, c1, _ = cols.indices(self.shape[1])
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        raw = data[r0:r1]
        if raw.dtype in (np.float32, np.float16):  # F32 / F16: plain values
            return torch.from_numpy(raw[:, c0:c1].astype(np.float32))
        if c0 % block == 0 and (c1 % block == 0 or c1 == self.shape[1]):
            raw = raw[:, c0 // block * type_size : -(-c1 // block) * type_size]
            c0, c1 = 0, c1 - c0
        out = _to_f32(gguf, raw, self.qtype)[:, c0:c1]
        return torch.from_numpy(np.ascontiguousarray(out))


def _to_f32(gguf: Any, raw: np.ndarray, qtype: Any) -> np.ndarray:
    if raw.dtype in (np.float32, np.float16):
        return raw.astype(np.float32)
    return gguf.quants.dequantize(raw, qtype).astype(np.float32, copy=False)


def _unpermute(w: torch.Tensor, rows: int, per_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` (rows (heads, 2, D/2) -> (heads, D/2, 2)) on whole heads."""
    heads = rows // per_head
    tail = tuple(w.shape[1:])
    return w.reshape(heads, per_head // 2, 2, *tail).transpose(1, 2).reshape(rows, *tail)


def iter_tensors(path: str, model: nn.Module) -> Iterator[tuple[str, str, Any]]:
    """(path, HF name, lazy tensor) for every tensor of the file that `model` has a name for;
    a tensor with no HF name comes with its GGUF name (the loader warns and skips it)."""
    from steadylm.layers.shard import CheckpointTensor

    gguf = _gguf()
    r = reader(path)
    arch = check_file(path)
    cfg = model.cfg
    names = _hf_names(gguf, arch, model)
    for t in r.tensors:
        hf = names.get(t.name, t.name)
        heads = None
        if arch == "llama" and ".attn_q." in t.name:
            heads = cfg.num_heads
        elif arch == "llama" and ".attn_k." in t.name:
            heads = cfg.num_kv_heads
        source = GGUFSlice(t, heads)
        yield path, hf, CheckpointTensor(source, source.shape)


def _hf_names(gguf: Any, arch: str, model: nn.Module) -> dict[str, str]:
    """GGUF name -> HF checkpoint name, through gguf's own tensor name map, for every
    checkpoint name the model loads (merged layers split back into their HF parts)."""
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    tmap = gguf.get_tensor_name_map(arch_id, model.cfg.num_layers)
    unmerge: dict[str, list[str]] = {}
    for frag, (merged, _) in model.packed_modules.items():
        unmerge.setdefault(merged, []).append(frag)
    out: dict[str, str] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        base, suffix = name.rsplit(".", 1)
        module, leaf = base.rsplit(".", 1) if "." in base else ("", base)
        for part in unmerge.get(leaf, [leaf]):
            hf_base = f"{module}.{part}" if module else part
            g = tmap.get_name(hf_base)
            if g is not None:
                out[f"{g}.{suffix}"] = f"{hf_base}.{suffix}"
    return out


def weight_bytes(path: str, dtype: torch.dtype) -> int:
    """Bytes the dequantized weights take in `dtype` (every tensor of the file, as held)."""
    size = torch.tensor([], dtype=dtype).element_size()
    return sum(int(np.prod(t.shape)) * size for t in reader(path).tensors)


def file_bytes(path: str) -> int:
    return os.path.getsize(path)
