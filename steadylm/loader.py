"""Weights from a local HF directory (single or sharded safetensors) or a GGUF file into a
registered model.

Every error names the file and the tensor: a missing shard, a missing tensor, a shape mismatch.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from steadylm import gguf_file, platform
from steadylm.config import ModelConfig
from steadylm.errors import ModelLoadError
from steadylm.layers.shard import CheckpointTensor
from steadylm.models import get_model_class

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        root = os.path.realpath(model_dir)
        for name in files:
            path = os.path.realpath(os.path.join(model_dir, str(name)))
            if not isinstance(name, str) or os.path.commonpath([root, path]) != root:
                raise ModelLoadError(
                    f"{index} maps weights to {name!r}, outside {model_dir}; shard paths must "
                    "stay inside the model directory"
                )
            if not os.path.isfile(os.path.join(model_dir, name)):
                raise ModelLoadError(
                    f"{index} lists shard {name!r}, which is missing from {model_dir}"
                )
        return [os.path.join(model_dir, name) for name in files]
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    found = [f for f in os.listdir(model_dir) if f.endswith(".safetensors")]
    if found:
        return [os.path.join(model_dir, f) for f in sorted(found)]
    raise ModelLoadError(
        f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards "
        "(only safetensors is supported; convert .bin/.pth checkpoints with transformers' "
        "save_pretrained(safe_serialization=True))"
    )


def iter_checkpoint(files: list[str]) -> Iterator[tuple[str, str, CheckpointTensor]]:
    """Every tensor as a lazy `CheckpointTensor`: a weight loader narrows it to this rank's
    part before anything is read from disk."""
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    yield path, name, CheckpointTensor(sl, tuple(sl.get_shape()))
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def tensor_shapes(files: list[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) from the safetensors headers alone: no tensor is read."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for path in files:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (tuple(meta["shape"]), meta["dtype"])
    return out


def create_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model with uninitialised parameters of `dtype` directly on `device`."""
    cls = get_model_class(cfg.architecture)
    if cfg.quantization:
        from steadylm.layers.awq import check_awq_config

        check_awq_config(cfg.quantization)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def load_model(
    model_path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The model of a safetensors directory or a GGUF file (or a directory holding one)."""
    model = create_model(cfg, dtype, device)
    gguf_path = gguf_file.find_gguf(model_path)
    if gguf_path is not None:
        load_weights(model, gguf_file.iter_tensors(gguf_path, model), cfg, [gguf_path])
    else:
        files = safetensors_files(model_path)
        load_weights(model, iter_checkpoint(files), cfg, files)
    return model


def checkpoint_weight_bytes(model_path: str, dtype: torch.dtype) -> int:
    """Bytes the loaded (dequantized, for GGUF) weights take, from the file headers alone."""
    gguf_path = gguf_file.find_gguf(model_path)
    if gguf_path is not None:
        return gguf_file.weight_bytes(gguf_path, dtype)
    return weight_bytes_from_files(safetensors_files(model_path), dtype)


def load_weights(
    model: nn.Module,
    tensors: Iterator[tuple[str, str, CheckpointTensor]],
    cfg: ModelConfig,
    files: list[str],
) -> None:
    """Hand every (path, HF name, lazy tensor) to its parameter's loader, then check that
    nothing is missing and let the layers build their kernels."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = _expected_loads(model, params, cfg)
    loaded: set[tuple[str, object]] = set()
    for path, name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        target, shard = _map_name(model, name)
        param = params.get(target)
        if param is None:
            logger.warning("ignoring tensor %s in %s: the model has no such parameter", name, path)
            continue
        try:
            param.weight_loader(param, tensor, shard)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{path}: tensor {name!r}: {exc.message}") from None
        loaded.add((target, shard))
    _check_missing(expected - loaded, files)
    # Drop the references to the loaded parameters first: a layer that repacks its weight
    # frees the checkpoint-layout copy, and this dict would keep every one of them alive
    # (twice the weights at the peak: an OOM for a model over half the RAM).
    del params
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    t0 = time.perf_counter()
    huge = platform.collapse_huge_pages(_weight_tensors(model))
    if huge:
        logger.info(
            "transparent huge pages: %d MiB of weights %s in %.2f s; torch's allocator: %s",
            huge >> 20,
            "collapsed" if platform.cpu_huge_pages() == "collapse" else "advised",
            time.perf_counter() - t0,
            "on" if platform.torch_huge_pages() else "off",
        )


def _weight_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor the forward streams: parameters, and the kernels' own (packed) copies."""
    yield from model.parameters()
    for module in model.modules():
        kernel = getattr(module, "kernel", None)
        if kernel is not None:
            yield from kernel.tensors()


def _check_missing(missing_pairs: set, files: list[str]) -> None:
    missing = sorted(f"{n} (shard {s})" if s is not None else n for n, s in missing_pairs)
    if missing:
        names = ", ".join(os.path.basename(f) for f in files)
        raise ModelLoadError(
            f"tensors missing from {names}: {', '.join(missing[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )


def _map_name(model: nn.Module, name: str) -> tuple[str, int | None]:
    mapped = model.map_weight_name(name)
    if mapped is not None:
        return mapped
    for frag, (merged, shard) in model.packed_modules.items():
        if f".{frag}." in name:
            return name.replace(f".{frag}.", f".{merged}."), shard
    return name, None


def _expected_loads(model: nn.Module, params: dict, cfg: ModelConfig) -> set[tuple[str, object]]:
    expected: set[tuple[str, object]] = set()
    for name in params:
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        module = model.get_submodule(name.rsplit(".", 1)[0])
        sizes = getattr(module, "output_sizes", None)
        if sizes is None or len(sizes) == 1:
            expected.add((name, None))
        else:
            expected.update((name, i) for i in range(len(sizes)))
    return expected


_HEADER_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def weight_bytes_from_files(files: list[str], dtype: torch.dtype) -> int:
    """Bytes the loaded weights will take: float tensors in `dtype`, integer (packed) tensors
    as stored. Read from the safetensors headers only."""
    size = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for shape, st_dtype in tensor_shapes(files).values():
        n = 1
        for d in shape:
            n *= d
        is_float = st_dtype in ("F64", "F32", "F16", "BF16")
        total += n * (size if is_float else _HEADER_DTYPE_BYTES.get(st_dtype, 4))
    return total


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights occupy now (parameters, and repacked int4 kernels)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for m in model.modules():
        kernel = getattr(m, "kernel", None)
        if kernel is not None and kernel.owns_weights:  # repacked int4, prepacked dense
            total += kernel.num_bytes()
    return total
