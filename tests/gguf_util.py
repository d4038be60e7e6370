"""Writing tiny GGUF files from HF models, as llama.cpp's converter lays them out.

Float tensors quantize through `gguf.quants` where it can (F16, BF16, Q4_0 ... Q8_0); the
K-quant types, which `gguf` only dequantizes, get random blocks with small finite scales. The
reference model is transformers reading the same file, so both sides dequantize the same bytes.
"""

from __future__ import annotations

import numpy as np
import torch

# Where each K-quant block keeps its fp16 scales (byte offsets), as ggml lays the blocks out.
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
ARCH_NAMES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: HF's rotary halves into interleaved pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def encode(w: np.ndarray, qtype_name: str, rng: np.random.Generator):
    """(array, raw_dtype) for GGUFWriter.add_tensor."""
    import gguf

    q = gguf.GGMLQuantizationType[qtype_name]
    if qtype_name == "F32":
        return w.astype(np.float32), None
    if qtype_name == "F16":
        return w.astype(np.float16), None
    if qtype_name in _K_SCALES:
        block, size = gguf.GGML_QUANT_SIZES[q]
        rows, cols = w.shape
        raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        for off in _K_SCALES[qtype_name]:
            scale = rng.uniform(0.002, 0.01, raw.shape[:2]).astype(np.float16)
            raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
        return raw.reshape(rows, -1), q
    return gguf.quants.quantize(w.astype(np.float32), q), q


def write_gguf(model, path: str, arch: str, types: list[str], seed: int = 0) -> None:
    """`model` (an HF Llama / Qwen2 / Qwen3) as a GGUF file; its 2-D tensors take `types` in
    turn, 1-D ones (norms, biases) stay F32."""
    import gguf

    cfg = model.config
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, ARCH_NAMES[arch])
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    turn = 0
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        data = t.float().numpy()
        if arch == "llama" and base.endswith("q_proj"):
            data = permute(data, cfg.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            data = permute(data, cfg.num_key_value_heads)
        qtype = "F32"
        if data.ndim == 2:
            qtype, turn = types[turn % len(types)], turn + 1
        array, raw = encode(data, qtype, rng)
        w.add_tensor(f"{tmap.get_name(base)}.{suffix}", array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_from_gguf(path: str):
    """transformers' own reading of the file, in fp32: the reference."""
    import os

    from transformers import AutoModelForCausalLM

    d, f = os.path.split(os.path.abspath(path))
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
