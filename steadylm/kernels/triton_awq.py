"""W4A16 GEMM in Triton on AutoAWQ's GEMM layout, read in place: y (M, N) = x (M, K) @ W.

The checkpoint tensors are used as loaded (layers/awq.py states the format):
  qweight int32 (K, N/8): nibble i of packed column c is output column 8c + AWQ_ORDER[i], so
                          column n sits at bits 4 * AWQ_REVERSE_ORDER[n % 8] of column n // 8
  qzeros  int32 (K/g, N/8), the same packing; scales (K/g, N), fp16 as in the checkpoint
  W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]

A program owns a (BLOCK_M, BLOCK_N) output tile and walks K in BLOCK_K steps. BLOCK_K divides
the group, so each step needs one row of zeros and scales. The step unpacks a (BLOCK_K,
BLOCK_N / 8) int32 tile into (BLOCK_K, BLOCK_N) codes, dequantizes them in fp32 as
q * s + (-z * s) (exact: both products and their sum fit fp32's 24 bits, so W equals the
reference's fp32 weight before the one rounding to the activation dtype), then one tl.dot in
the activation dtype with an fp32 accumulator.

Decode (M <= 16) is memory-bound: the weight is read once, and a layer with few output tiles
would leave most SMs idle, so K is split over up to 16 programs per tile when the tiles number
fewer than the SMs; the fp32 partial sums (split, M, N) are added by torch. The block sizes are
fixed per M range (no autotuning, so nothing is timed at the first call). No host sync: every
launch parameter comes from shapes.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _awq_gemm_kernel(
    x_ptr,  # (M, K) activations, unit stride along K
    qw_ptr,  # (K, N/8) int32
    qz_ptr,  # (K/GROUP, N/8) int32
    s_ptr,  # (K/GROUP, N)
    y_ptr,  # (SPLIT, M, N): the output when SPLIT is 1, else fp32 partial sums
    M,
    N,
    K,
    stride_xm,
    tiles_per_split,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_p = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # packed columns
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    n_packed = N // 8
    # Output column 8c + j sits at bits 4 * AWQ_REVERSE_ORDER[j], AWQ_REVERSE_ORDER[j] being
    # j // 2 + 4 * (j % 2): for the 8 columns of a packed int32 (unpacking qweight) and for
    # each output column (unpacking qzeros).
    j = tl.arange(0, 8)
    shifts = (j // 2) * 4 + (j % 2) * 16  # (8,)
    col_shifts = (offs_n % 8 // 2) * 4 + (offs_n % 2) * 16  # (BLOCK_N,)

    t_start = pid_k * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, K // BLOCK_K)
    k0 = t_start * BLOCK_K
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :]
    qw_ptrs = qw_ptr + (k0 + offs_k)[:, None] * n_packed + offs_p[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t_start, t_end):
        g = t * BLOCK_K // GROUP
        zp = tl.load(qz_ptr + g * n_packed + offs_n // 8, mask=mask_n, other=0)
        z = ((zp >> col_shifts) & 0xF).to(tl.float32)  # (BLOCK_N,)
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zs = -z * s
        x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)  # (BLOCK_M, BLOCK_K)
        packed = tl.load(qw_ptrs, mask=(offs_p < n_packed)[None, :], other=0)
        q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # (BLOCK_K, BLOCK_N / 8, 8)
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        w = (q.to(tl.float32) * s[None, :] + zs[None, :]).to(x.dtype)  # (BLOCK_K, BLOCK_N)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        qw_ptrs += BLOCK_K * n_packed

    y_ptrs = y_ptr + pid_k.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


class Blocks(NamedTuple):
    m: int
    n: int
    k: int  # the most; the launch takes gcd(k, group) so that a K step stays in one group
    warps: int
    stages: int


# By rows: decode batches, then small and large prefill chunks. BLOCK_N 64 keeps a row of a
# weight tile at 32 bytes (one memory sector) for the small-M tiles.
_BLOCKS = (
    (16, Blocks(16, 64, 128, 4, 4)),
    (32, Blocks(32, 64, 128, 4, 4)),
    (64, Blocks(64, 64, 64, 4, 4)),
    (None, Blocks(128, 128, 64, 8, 3)),
)
MAX_SPLIT_K = 16


def blocks_for(m: int) -> Blocks:
    return next(b for rows, b in _BLOCKS if rows is None or m <= rows)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_k_for(tiles: int, k_tiles: int, device: torch.device) -> int:
    """How many programs share one output tile's K range: enough to give every SM two
    programs when the output tiles are fewer than the SMs, each keeping at least 4 K steps."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if tiles >= sms:
        return 1
    return max(1, min(MAX_SPLIT_K, k_tiles // 4, 2 * sms // tiles))


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    split_k: int | None = None,
) -> torch.Tensor:
    """y (..., N) = x (..., K) @ dequant(qweight, qzeros, scales), in x's dtype.

    qweight (K, N/8), qzeros (K/group, N/8) and scales (K/group, N) are contiguous, with
    N % 8 == 0 and group % 32 == 0 dividing K. `split_k` overrides the split of K (tests)."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    assert x.shape[-1] == k and group % 32 == 0 and k % group == 0, (x.shape, k, group)
    assert qzeros.shape == (k // group, n // 8) and scales.shape == (k // group, n)
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    b = blocks_for(m)
    block_k = math.gcd(b.k, group)
    k_tiles = k // block_k
    grid_m, grid_n = triton.cdiv(m, b.m), triton.cdiv(n, b.n)
    split = split_k or split_k_for(grid_m * grid_n, k_tiles, x.device)
    per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per_split)  # no program without a K step
    out_dtype = x.dtype if split == 1 else torch.float32
    y = torch.empty(split, m, n, dtype=out_dtype, device=x.device)
    _awq_gemm_kernel[(grid_m, grid_n, split)](
        x2,
        qweight,
        qzeros,
        scales,
        y,
        m,
        n,
        k,
        x2.stride(0),
        per_split,
        GROUP=group,
        BLOCK_M=b.m,
        BLOCK_N=b.n,
        BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=b.warps,
        num_stages=b.stages,
    )
    y = y[0] if split == 1 else y.sum(0).to(x.dtype)
    return y.view(*lead, n)
