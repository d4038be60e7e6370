"""The fused mixture-of-experts MLP in Triton: every routed (token, expert) pair of a step in
two grouped GEMMs over the experts' stacked weights, with no host sync.

  1. `align_by_expert` (torch ops on the device): the T * k (token, slot) pairs sorted by
     expert, each expert's run padded to a multiple of BLOCK_M with a sentinel, and the expert
     of each BLOCK_M block. Sizes come from shapes only: at most min(T k, T k / BLOCK_M + E)
     blocks, those past the last expert's run marked E (their programs return at once).
  2. gate_up: block b of the sorted pairs times w13[expert(b)] (E, 2I, H) -> (T k, 2I), each
     pair's row read from x at token = pair // k.
  3. SiLU-and-multiply -> (T k, I), the small op every MLP takes.
  4. down: times w2[expert(b)] (E, H, I), each row scaled by its routing weight -> (T k, H),
     then summed over the k slots of a token.

AWQ experts take the same two GEMMs over their stacked checkpoint tensors (qweight, qzeros,
scales, AutoAWQ's GEMM layout as kernels/triton_awq.py reads it), the codes unpacked and
dequantized per K step: the weights stay 4-bit and the step has no host sync either.

A program owns one (BLOCK_M pairs, BLOCK_N outputs) tile of one expert and walks K in BLOCK_K
steps with an fp32 accumulator: each routed expert's weights are read once per step for all
its tokens (decode at batch 16 reads each active expert once). The pure-torch oracle is
`layers.moe.experts_reference`; tests run both under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from steadylm import kernels


@triton.jit
def _store_rows(
    acc, pair, mask_m, offs_n, mask_n, c_ptr, stride_cm, scale_ptr, MUL_WEIGHT: tl.constexpr
):
    """Both GEMMs' epilogue: each pair's row of the tile, scaled by its routing weight when
    MUL_WEIGHT (the down GEMM), stored at the pair's row of the output."""
    if MUL_WEIGHT:
        s = tl.load(scale_ptr + pair, mask=mask_m, other=0.0).to(tl.float32)
        acc = acc * s[:, None]
    c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # (rows, K): x (T, H) for gate_up (a pair's row is pair // TOP_K), or (T k, I)
    w_ptr,  # (E, N, K) stacked expert weights, unit stride along K
    c_ptr,  # (T k, N) output, one row per (token, slot) pair
    scale_ptr,  # (T k,) routing weights (read when MUL_WEIGHT)
    sorted_ptr,  # (blocks * BLOCK_M,) pair ids sorted by expert, num_valid = padding
    expert_ptr,  # (blocks,) the expert of each block (NUM_EXPERTS: past the end)
    N,
    K,
    num_valid,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e >= NUM_EXPERTS:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pair < num_valid
    rows = pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = k0 + offs_k < K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _store_rows(acc, pair, mask_m, offs_n, mask_n, c_ptr, stride_cm, scale_ptr, MUL_WEIGHT)


@triton.jit
def _moe_awq_gemm_kernel(
    a_ptr,  # (rows, K) activations, as _moe_gemm_kernel's
    qw_ptr,  # (E, K, N/8) int32: each expert's AutoAWQ qweight, stacked
    qz_ptr,  # (E, K/GROUP, N/8) int32
    s_ptr,  # (E, K/GROUP, N)
    c_ptr,
    scale_ptr,
    sorted_ptr,
    expert_ptr,
    N,
    K,
    num_valid,
    stride_am,
    stride_cm,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """_moe_gemm_kernel over 4-bit experts: each K step unpacks a (BLOCK_K, BLOCK_N) tile of
    the expert's codes and dequantizes it in fp32 as kernels/triton_awq.py does (BLOCK_K
    divides the group: one row of zeros and scales a step)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e >= NUM_EXPERTS:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pair < num_valid
    rows = pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    n_packed = N // 8
    offs_p = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    offs_k = tl.arange(0, BLOCK_K)
    j = tl.arange(0, 8)
    shifts = (j // 2) * 4 + (j % 2) * 16  # AWQ_REVERSE_ORDER, as kernels/triton_awq.py
    col_shifts = (offs_n % 8 // 2) * 4 + (offs_n % 2) * 16
    e64 = e.to(tl.int64)
    qz_base = qz_ptr + e64 * (K // GROUP) * n_packed
    s_base = s_ptr + e64 * (K // GROUP) * N
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    qw_ptrs = qw_ptr + e64 * K * n_packed + offs_k[:, None] * n_packed + offs_p[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        g = k0 // GROUP
        zp = tl.load(qz_base + g * n_packed + offs_n // 8, mask=mask_n, other=0)
        z = ((zp >> col_shifts) & 0xF).to(tl.float32)
        sc = tl.load(s_base + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        packed = tl.load(qw_ptrs, mask=(offs_p < n_packed)[None, :], other=0)
        q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        w = (q.to(tl.float32) * sc[None, :] - z[None, :] * sc[None, :]).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        qw_ptrs += BLOCK_K * n_packed
    _store_rows(acc, pair, mask_m, offs_n, mask_n, c_ptr, stride_cm, scale_ptr, MUL_WEIGHT)


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, k) expert ids -> (pair ids sorted by expert, each expert's run padded to BLOCK_M
    with T k; the expert of each block, num_experts past the last run). Device ops only."""
    flat = ids.flatten()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    blocks = min(n, triton.cdiv(n, block_m) + num_experts)
    sorted_pairs = torch.full((blocks * block_m,), n, dtype=torch.int64, device=ids.device)
    sorted_pairs[(ends - padded)[expert] + rank] = order
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)  # num_experts past the end
    return sorted_pairs, block_expert


def _gemm(a, w, out, scale, sorted_pairs, block_expert, top_k, block_m, mul_weight):
    e, n, k = w.shape
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        w,
        out,
        scale,
        sorted_pairs,
        block_expert,
        n,
        k,
        out.shape[0],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        NUM_EXPERTS=e,
        TOP_K=top_k,
        MUL_WEIGHT=mul_weight,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )


def _awq_gemm(a, w, out, scale, sorted_pairs, block_expert, top_k, block_m, mul_weight):
    qweight, qzeros, scales, group = w
    e, k, n = qweight.shape[0], qweight.shape[1], qweight.shape[2] * 8
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = math.gcd(64, group)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_awq_gemm_kernel[grid](
        a,
        qweight,
        qzeros,
        scales,
        out,
        scale,
        sorted_pairs,
        block_expert,
        n,
        k,
        out.shape[0],
        a.stride(0),
        out.stride(0),
        NUM_EXPERTS=e,
        TOP_K=top_k,
        MUL_WEIGHT=mul_weight,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )


def awq_supported(k: int, n: int, group: int) -> bool:
    """The 4-bit kernel's shapes: K steps inside one group (a multiple of 16 dividing 64),
    whole packed columns."""
    return group % 16 == 0 and k % group == 0 and n % 8 == 0


def fused_experts(
    x: torch.Tensor,
    w13,
    w2,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(SiLU(gate_e x_t) * up_e x_t), e = ids[t, j], for x (T, H):
    the result (T, H) in x's dtype. Dense experts: w13 (E, 2I, H) ([gate | up] rows) and w2
    (E, H, I). AWQ experts: w13 and w2 are (qweight, qzeros, scales, group) of the stacked
    checkpoint tensors, qweight (E, K, N/8) with N = 2I and H."""
    t, h = x.shape
    awq = isinstance(w13, tuple)
    e = w13[0].shape[0] if awq else w13.shape[0]
    two_i = w13[2].shape[2] if awq else w13.shape[1]
    top_k = ids.shape[1]
    if t == 0:
        return x.new_zeros(0, h)
    assert x.is_contiguous()
    gemm = _awq_gemm if awq else _gemm
    block_m = 16 if t * top_k <= 16 * e else 64
    sorted_pairs, block_expert = align_by_expert(ids, e, block_m)
    scale = weights.flatten().contiguous()
    up = torch.empty(t * top_k, two_i, dtype=x.dtype, device=x.device)
    gemm(x, w13, up, scale, sorted_pairs, block_expert, top_k, block_m, False)
    act = kernels.silu_and_mul(up)  # (T k, I)
    down = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)
    gemm(act, w2, down, scale, sorted_pairs, block_expert, 1, block_m, True)
    return down.view(t, top_k, h).sum(1)
