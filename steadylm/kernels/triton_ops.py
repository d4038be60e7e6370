"""The small ops of a decoder layer as one Triton kernel each, for CUDA (on CPU tensors only in
Triton's interpreter, for tests): RMSNorm (optionally fused with the residual add before it),
SiLU-and-multiply, and rotary embedding applied in place.

In eager torch these are 2-6 kernels each (RMSNorm: cast, square, mean, rsqrt, multiply, cast,
weight; rotary: two products, a negation, a concatenation, a sum). A decode step of a 16-layer
model at batch 1 ran ~30 kernels per layer, and on an H200 even under a CUDA graph the tiny
ones cost 2-5 us each: ~1.8 ms of a 2.5 ms step whose weights take 0.4 ms to read
(docs/benchmarks.md). Fused, a layer runs ~11.

Each kernel rounds where its torch reference (steadylm/kernels/__init__.py, layers/rotary.py)
rounds to the model dtype, and computes in fp32 in between, so it agrees with the reference to
an ulp or two (the reductions and exp differ in order and implementation, not in precision).
No host sync: launch parameters come from shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import next_power_of_2


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # rows of N, row r at (r // ROWS) * stride_xt + (r % ROWS) * stride_xh
    res_ptr,  # the residual stream, same layout as out (HAS_RES): read, then x + res written
    w_ptr,  # (N,)
    out_ptr,  # contiguous rows of N
    N,
    ROWS,
    stride_xt,
    stride_xh,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x_row = x_ptr + (r // ROWS).to(tl.int64) * stride_xt + (r % ROWS) * stride_xh
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    if HAS_RES:
        res_row = res_ptr + r.to(tl.int64) * N
        s = (xf + tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_row + offs, s, mask=mask)  # HF's `residual + hidden_states`, rounded
        xf = s.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    h = (xf * inv).to(dtype).to(tl.float32)  # HF casts back before applying the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r.to(tl.int64) * N + offs, (w * h).to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """norm(x) over the last dim, or norm(x + residual) with the sum written into `residual`
    (contiguous, x's shape). x may be a strided view (the q / k heads of a fused qkv output,
    (T, R, N), read in place); the output is contiguous, x's shape."""
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.dim() != 3:
        x = x.reshape(-1, 1, n)  # rows of N (a copy only where they are not evenly strided)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, stride_xt, stride_xh = x.shape[1], x.stride(0), x.stride(1)
    if out.numel() == 0:
        return out
    block = next_power_of_2(n)
    _rms_norm_kernel[(out.numel() // n,)](
        x, residual if residual is not None else out, weight, out, n, rows, stride_xt,
        stride_xh, eps, HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block),
    )  # fmt: skip
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, N, stride_xt, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    row = x_ptr + t.to(tl.int64) * stride_xt
    gate = tl.load(row + offs, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    up = tl.load(row + N + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu, rounded, then the product
    tl.store(out_ptr + t.to(tl.int64) * N + offs, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2N) = [gate | up] -> silu(gate) * up (..., N)."""
    shape = x.shape
    if x.stride(-1) != 1 or x.dim() != 2:
        x = x.reshape(-1, shape[-1]).contiguous()
    n = x.shape[1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.view(*shape[:-1], n)
    block = min(1024, next_power_of_2(n))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](
        x, out, n, x.stride(0), BLOCK=block, num_warps=_warps(block)
    )
    return out.view(*shape[:-1], n)


@triton.jit
def _rotary_kernel(
    x_ptr,  # (T, H, D) rotated in place, unit stride along D
    cos_ptr,  # (T, D) rows at stride_ct (the same for sin)
    sin_ptr,
    H,
    stride_xt,
    stride_xh,
    stride_ct,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < H) & (offs[None, :] < HALF)
    lo = x_ptr + t * stride_xt + heads[:, None] * stride_xh + offs[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0)
    dtype = x1.dtype
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    x1 = x1.to(tl.float32)
    c = cos_ptr + t * stride_ct + offs
    s = sin_ptr + t * stride_ct + offs
    cos1 = tl.load(c, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(c + HALF, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(s, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(s + HALF, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2 | x1], each product rounded
    y1 = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    y2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    tl.store(lo, y1.to(dtype), mask=mask)
    tl.store(lo + HALF, y2.to(dtype), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, D) in place (a strided view of a fused qkv output is fine) by cos / sin
    (T, 1, D) in x's dtype, both with unit stride along D and the same strides (the caller,
    layers/rotary.py, checks); returns x."""
    t, h, d = x.shape
    if t == 0:
        return x
    half = d // 2
    block_d = next_power_of_2(half)
    block_h = max(1, min(next_power_of_2(h), 4096 // block_d))
    _rotary_kernel[(t, triton.cdiv(h, block_h))](
        x, cos, sin, h, x.stride(0), x.stride(1), cos.stride(0),
        HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return x
