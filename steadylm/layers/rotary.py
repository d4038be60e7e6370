"""Rotary position embeddings (rotate-half layout, as HF Llama/Qwen).

The inverse frequencies come from transformers' own RoPE init functions for scaled variants
(llama3, linear, yarn, ...), so they match HF exactly. On the CPU cos/sin come from a table of
the positions seen so far (grown by doubling, at most 8192 positions); past it, and on other
devices, they are computed per step for the step's positions (a CUDA graph captures the ops,
and a table that grew would move under it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from steadylm import kernels


def rope_parameters(hf_config: Any) -> dict:
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def inv_freq_and_scale(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        from steadylm.errors import ModelLoadError

        raise ModelLoadError(f"rope type {rope_type!r} is not supported")
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv.float(), float(scale)


# The table is computed in parts this many positions long: each part's ops stay under
# TensorIterator's grain (32,768 elements at head_dim <= 128), so every element goes through
# the vectorized cos / sin, as a step's few positions do (a thread split of a longer range
# could leave a chunk's tail to the scalar function).
_TABLE_PART = 256
# The table's most positions (8 MiB at head_dim 128 in fp32): a step past them computes its
# cos / sin as CUDA does (~0.15 ms, against a decode step of tens of ms at such contexts),
# so the memory the plan does not count stays small and bounded.
_TABLE_MAX = 8192


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """One per model: cos/sin are computed once per step and shared by every layer."""

    def __init__(self, hf_config: Any, head_dim: int) -> None:
        super().__init__()
        inv_freq, self.scale = inv_freq_and_scale(hf_config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.tables: dict[torch.dtype, torch.Tensor] = {}  # CPU: (positions, 2, D) cos | sin

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, upto: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, 1, D) in dtype for positions (T,); `upto`: a bound the caller knows
        (every position < upto), else read from positions. On the CPU two views of one row
        gather from the table (a decode step's ~8 small ops were ~0.2 ms, its caches cold from
        the weights' stream); the table's rows are `compute`'s, element for element."""
        if upto is None:
            upto = int(positions.max()) + 1 if positions.numel() else 0
        if not positions.is_cpu or upto > _TABLE_MAX:
            return self.compute(positions, dtype)
        table = self.tables.get(dtype)
        if table is None or table.shape[0] < upto:
            size = max(upto, 2 * (0 if table is None else table.shape[0]))
            size = min(-(-size // _TABLE_PART) * _TABLE_PART, _TABLE_MAX)
            parts = [
                torch.cat(self.compute(torch.arange(lo, lo + _TABLE_PART), dtype), dim=1)
                for lo in range(0, size, _TABLE_PART)
            ]
            table = self.tables[dtype] = torch.cat(parts)  # (size, 2, D)
        rows = table.index_select(0, positions)
        return rows[:, :1], rows[:, 1:]

    def compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions[:, None].float() * self.inv_freq  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:  # (a product by 1.0 changes no bit: skipped)
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]  # (T, 1, D)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D); cos, sin (T, 1, D)."""
    return x * cos + rotate_half(x) * sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D) rotated by cos, sin (T, 1, D): in place in one kernel (Triton on CUDA,
    the native op on CPU; x may be a view of the fused qkv output), else a new tensor from
    the reference; use the result."""
    if x.stride(-1) == 1 and x.dtype == cos.dtype and _rows(cos, sin):  # the kernels' layout
        tri = kernels.triton_ops_for(x, cos, sin)
        if tri is not None:
            return tri.rotary_(x, cos, sin)
        native = kernels.native_rotary(x)
        if native is not None:
            return native(x, cos, sin)
    return rotate_ref(x, cos, sin)


def _rows(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """cos and sin of one dtype, laid out alike with unit stride along D (the kernels' one
    row stride)."""
    return cos.dtype == sin.dtype and cos.stride(-1) == 1 and cos.stride() == sin.stride()
