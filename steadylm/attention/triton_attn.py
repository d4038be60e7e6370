"""The Triton attention backend (CUDA; on CPU tensors only in Triton's interpreter, for tests).

One attention kernel serves every group the model runner builds: prefill, decode, mixed
batches and chunked prefill over a cached prefix. It reads each sequence's block table in
place (no gather copy), for any block size: a tile of TILE keys looks up each key's block.
int8 / int4 caches (quant_policy 8 / 4) are dequantized inside the kernel from the layout the
reference uses (steadylm/attention/torch_ref.py: per token and KV head, `scale` and `zero` in
the model dtype; int4 packs dims 2i and 2i+1 in the low and high nibble of byte i).

Grid (query blocks, KV heads, segments). A program takes BLOCK_Q query tokens of one sequence
and the G = H / Hkv query heads that share a KV head: BLOCK_M = BLOCK_Q * G rows against one
stream of K/V tiles, with an online softmax (exp2, the scale folded in). The program finds its
sequence by a binary search over the cumulative query lengths, so the grid size follows from
host-known counts only (tokens and sequences), and nothing synchronises with the host.

Decode batches with few (sequence, KV head) pairs would leave most of the GPU idle, so a
decode group splits each sequence's keys into segments (flash-decoding): each segment writes
its partial max, sum and output, and a second kernel merges them. The grid has a fixed number
of segments (from the engine's longest context, session_len, at most MAX_SEGMENTS); each row
spreads its own context over them in whole tiles, at least MIN_SEGMENT_TILES per segment, and
the segments past its keys return at once. So a decode row's result depends on its own context
only, never on the batch it ran in or the CUDA graph bucket that padded it; one captured graph
serves every context length; and a short context still runs on several programs per KV head
(a fixed span length from session_len left one program per KV head doing all of a 512-token
row in sequence: 23 us per layer on an H200, docs/benchmarks.md).

The store kernel writes a step's new K/V into their slots (quantizing them for 8 / 4 exactly
as `quantize_kv`, the reference) and skips slots < 0: the padded rows of a CUDA graph bucket.
Unlike the reference, the pool needs no zeroing: every load past a sequence's end is masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import next_power_of_2

from steadylm.attention.base import (
    AttentionBackend,
    AttentionGroup,
    AttentionMetadata,
    KVCache,
)

_LOG2E = 1.4426950408889634
TILE = 32  # keys per inner step
MAX_SEGMENTS = 32  # key segments of a decode row at the longest context
MIN_SEGMENT_TILES = 4  # a decode segment spans at least this many tiles (128 keys)


@triton.jit
def _store_kv_kernel(
    x_ptr,  # (T, Hkv, D) new keys or values
    slot_ptr,  # (T,) int64, < 0: write nowhere
    cache_ptr,  # (num_blocks * block_size, Hkv, W) this layer, W = D, or D / 2 for int4
    sz_ptr,  # (num_blocks * block_size, Hkv, 2) scale, zero (quantized caches)
    stride_xt,
    stride_xh,
    stride_cs,
    stride_ch,
    stride_ss,
    stride_sh,
    HEAD_DIM: tl.constexpr,
    PAD: tl.constexpr,  # next power of two of HEAD_DIM (of HEAD_DIM / 2 for int4)
    QUANT: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    x_row = x_ptr + t * stride_xt + h * stride_xh
    c_row = cache_ptr + slot * stride_cs + h * stride_ch
    offs = tl.arange(0, PAD)
    # if / else, never an early return: the compiler type-checks code after a constexpr return.
    if QUANT == 0:
        m = offs < HEAD_DIM
        tl.store(c_row + offs, tl.load(x_row + offs, mask=m), mask=m)
    else:
        # As quantize_kv: scale = (max - min) / levels, both round-tripped through the cache
        # dtype; IEEE divisions (div_rn), as torch's, so the codes match it bit for bit.
        if QUANT == 8:
            m = offs < HEAD_DIM
            x = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
            y = x
            hi = tl.max(tl.where(m, x, float("-inf")), axis=0)
            lo = tl.min(tl.where(m, x, float("inf")), axis=0)
        else:
            m = offs < HEAD_DIM // 2
            x = tl.load(x_row + 2 * offs, mask=m, other=0.0).to(tl.float32)  # dims 0, 2, ...
            y = tl.load(x_row + 2 * offs + 1, mask=m, other=0.0).to(tl.float32)  # 1, 3, ...
            hi = tl.max(tl.where(m, tl.maximum(x, y), float("-inf")), axis=0)
            lo = tl.min(tl.where(m, tl.minimum(x, y), float("inf")), axis=0)
        levels = 255.0 if QUANT == 8 else 15.0
        dtype = sz_ptr.dtype.element_ty
        scale_q = tl.maximum(tl.math.div_rn(hi - lo, levels), 1e-8).to(dtype)
        zero_q = lo.to(dtype)
        scale = tl.maximum(scale_q.to(tl.float32), 1e-8)
        zero = zero_q.to(tl.float32)
        s_row = sz_ptr + slot * stride_ss + h * stride_sh
        tl.store(s_row, scale_q)
        tl.store(s_row + 1, zero_q)
        cx = tl.minimum(tl.maximum(_rint(tl.math.div_rn(x - zero, scale)), 0.0), levels)
        if QUANT == 8:
            tl.store(c_row + offs, cx.to(tl.uint8), mask=m)
        else:
            cy = tl.minimum(tl.maximum(_rint(tl.math.div_rn(y - zero, scale)), 0.0), levels)
            code = cx.to(tl.uint8) | (cy.to(tl.uint8) << 4)
            tl.store(c_row + offs, code, mask=m)


@triton.jit
def _rint(x):
    """Round half to even, as torch.round (no libdevice: the interpreter runs it too)."""
    f = tl.floor(x)
    diff = x - f
    up = (diff > 0.5) | ((diff == 0.5) & ((f - 2.0 * tl.floor(f * 0.5)) == 1.0))
    return tl.where(up, f + 1.0, f)


@triton.jit
def _find_sequence(cu_q_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks contain global block `q_block`: sequence i's blocks
    start at cu_q[i] // BLOCK_Q + i (each sequence rounds its own count up)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_tile(
    cache_ptr,
    sz_ptr,
    rows,  # (TILE,) flat slot of each key
    valid,  # (TILE,) key exists
    kv_head,
    offs_d,
    stride_cs,
    stride_ch,
    stride_ss,
    stride_sh,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """A (TILE, HEAD_PAD) tile of keys or values, dequantized, zero where not `valid`."""
    m = valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    base = cache_ptr + rows[:, None] * stride_cs + kv_head * stride_ch
    if QUANT == 0:
        out = tl.load(base + offs_d[None, :], mask=m, other=0.0).to(OUT_DTYPE)
    else:
        if QUANT == 8:
            codes = tl.load(base + offs_d[None, :], mask=m, other=0).to(tl.float32)
        else:
            packed = tl.load(base + offs_d[None, :] // 2, mask=m, other=0)
            codes = ((packed >> ((offs_d[None, :] % 2) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
        s_row = sz_ptr + rows * stride_ss + kv_head * stride_sh
        scale = tl.load(s_row, mask=valid, other=0.0).to(tl.float32)
        zero = tl.load(s_row + 1, mask=valid, other=0.0).to(tl.float32)
        out = tl.where(m, codes * scale[:, None] + zero[:, None], 0.0).to(OUT_DTYPE)
    return out


@triton.jit
def _attention_kernel(
    out_ptr,  # (T, H, D), or the segment partials when NUM_SEGMENTS > 1
    q_ptr,  # (T, H, D)
    k_ptr,  # this layer: (num_blocks * block_size, Hkv, W)
    v_ptr,
    ksz_ptr,  # (num_blocks * block_size, Hkv, 2), quantized caches only
    vsz_ptr,
    seg_ml_ptr,  # (T, H, NUM_SEGMENTS, 2) fp32 partial max and sum
    min_seg_tiles,  # the least tiles per segment (NUM_SEGMENTS > 1)
    block_tables_ptr,  # (S, max_blocks) int32
    seq_lens_ptr,  # (S,) int32: context after this step
    cu_q_ptr,  # (S + 1,) int32: cumulative query lengths
    num_seqs,
    num_heads,
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (0: none)
    block_size,
    stride_bt,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_os,  # partials only: per segment
    stride_cs,
    stride_ch,
    stride_ss,
    stride_sh,
    G: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    QUANT: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_sequence(cu_q_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    q_local = q_block - (q_start // BLOCK_Q + seq)
    if q_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len
    seg_tiles = _segment_tiles(seq_len, min_seg_tiles, TILE, NUM_SEGMENTS)
    if NUM_SEGMENTS > 1:  # a span past the context: nothing to write, the merge skips it
        if segment * seg_tiles >= tl.cdiv(seq_len, TILE):
            return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_pos = q_local * BLOCK_Q + offs_m // G  # within this step's tokens of the sequence
    head = kv_head * G + offs_m % G
    row_ok = (offs_m < BLOCK_Q * G) & (q_pos < q_len)
    d_ok = offs_d < HEAD_DIM
    q_rows = q_start + q_pos
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    dtype = q_ptr.dtype.element_ty
    abs_pos = cached + q_pos  # each row's position in its sequence

    # Keys this block can see: up to its last query's position; from the window's start.
    end = tl.minimum(seq_len, cached + (q_local + 1) * BLOCK_Q)
    first = tl.where(window > 0, tl.maximum(cached + q_local * BLOCK_Q - window + 1, 0), 0)
    tile_lo = first // TILE
    tile_hi = tl.cdiv(end, TILE)
    if NUM_SEGMENTS > 1:  # the row's own spans: the split does not depend on the batch
        tile_lo = tl.maximum(tile_lo, segment * seg_tiles)
        tile_hi = tl.minimum(tile_hi, (segment + 1) * seg_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    offs_t = tl.arange(0, TILE)
    for j in range(tile_lo, tile_hi):
        key_pos = j * TILE + offs_t
        key_ok = key_pos < end
        block = tl.load(
            block_tables_ptr + seq * stride_bt + key_pos // block_size, mask=key_ok, other=0
        )
        rows = block.to(tl.int64) * block_size + key_pos % block_size
        k = _load_tile(
            k_ptr, ksz_ptr, rows, key_ok, kv_head, offs_d, stride_cs, stride_ch, stride_ss,
            stride_sh, HEAD_DIM, QUANT, dtype,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, TILE)
        see = key_ok[None, :] & (key_pos[None, :] <= abs_pos[:, None])
        see = see & ((window == 0) | (key_pos[None, :] > abs_pos[:, None] - window))
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_tile(
            v_ptr, vsz_ptr, rows, key_ok, kv_head, offs_d, stride_cs, stride_ch, stride_ss,
            stride_sh, HEAD_DIM, QUANT, dtype,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SEGMENTS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptr = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(o_ptr + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        base = q_rows * stride_ot + head * stride_oh + segment * stride_os
        tl.store(out_ptr + base[:, None] + offs_d[None, :], acc, mask=out_mask)
        ml = seg_ml_ptr + ((q_rows * num_heads + head) * NUM_SEGMENTS + segment) * 2
        tl.store(ml, m_i, mask=row_ok)
        tl.store(ml + 1, l_i, mask=row_ok)


@triton.jit
def _segment_tiles(seq_len, min_tiles, TILE: tl.constexpr, NUM_SEGMENTS: tl.constexpr):
    """Tiles per segment of a decode row: its own context over NUM_SEGMENTS spans, at least
    min_tiles each (a function of the row alone)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, TILE), NUM_SEGMENTS), min_tiles)


@triton.jit
def _merge_segments_kernel(
    out_ptr,  # (T, H, D)
    part_ptr,  # (T, H, NUM_SEGMENTS, HEAD_PAD) fp32
    ml_ptr,  # (T, H, NUM_SEGMENTS, 2) fp32
    seq_lens_ptr,  # (T,): a decode group's token t is its sequence t
    min_seg_tiles,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    SEG_PAD: tl.constexpr,  # next power of two of NUM_SEGMENTS
    TILE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    row = t * num_heads + h
    segs = tl.arange(0, SEG_PAD)
    # Only the spans that hold keys were written (the others returned at once).
    seq_len = tl.load(seq_lens_ptr + t)
    seg_tiles = _segment_tiles(seq_len, min_seg_tiles, TILE, NUM_SEGMENTS)
    written = tl.cdiv(tl.cdiv(seq_len, TILE), seg_tiles)
    seg_ok = (segs < NUM_SEGMENTS) & (segs < written)
    offs_d = tl.arange(0, HEAD_PAD)
    m = tl.load(ml_ptr + (row * NUM_SEGMENTS + segs) * 2, mask=seg_ok, other=float("-inf"))
    l_seg = tl.load(ml_ptr + (row * NUM_SEGMENTS + segs) * 2 + 1, mask=seg_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # 0 for a segment that saw no key (m = -inf)
    total = tl.sum(l_seg * w, axis=0)
    part = tl.load(
        part_ptr + (row * NUM_SEGMENTS + segs)[:, None] * HEAD_PAD + offs_d[None, :],
        mask=seg_ok[:, None],
        other=0.0,
    )
    o = tl.sum(part * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    dst = out_ptr + t * stride_ot + h * stride_oh + offs_d
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_split(
    max_context: int, max_segments: int = MAX_SEGMENTS, min_tiles: int = MIN_SEGMENT_TILES
) -> int:
    """The key segments of a decode row (the grid's third axis): at most `max_segments`, and no
    more than the longest context fills at `min_tiles` tiles each. Fixed per engine (from
    session_len); each row spreads its own keys over them (_segment_tiles)."""
    tiles = max(1, -(-max_context // TILE))
    return max(1, min(max_segments, -(-tiles // max(1, min_tiles))))


def block_m(group_size: int, max_query_len: int = 1) -> int:
    """Rows per program: a power of two holding G heads, at least 16 (tl.dot's minimum); for
    prefill up to 64 rows (more queries per K/V tile read)."""
    rows = next_power_of_2(group_size * max_query_len)
    return max(16, next_power_of_2(group_size), min(64, rows))


class TritonAttentionBackend(AttentionBackend):
    """Paged attention and KV store in Triton; same cache layout as the torch reference."""

    name = "triton"

    def __init__(
        self,
        max_context: int | None = None,
        max_segments: int | None = None,
        min_segment_tiles: int = MIN_SEGMENT_TILES,
    ) -> None:
        # The decode split: from the engine's session_len (else each group's longest
        # context); at most max_segments spans (default MAX_SEGMENTS on CUDA, 1 in Triton's
        # interpreter, which runs programs one by one) of at least min_segment_tiles tiles.
        self.max_context = max_context
        self.max_segments = max_segments
        self.min_segment_tiles = min_segment_tiles

    def prepare(self, md: AttentionMetadata, cache: KVCache) -> None:
        """Per group: int32 block tables, context lengths and cumulative query lengths, built
        on the device from the group's tensors (no host round trip)."""
        for g in md.groups:
            num_seqs = g.query_lens.shape[0]
            cu_q = torch.zeros(num_seqs + 1, dtype=torch.int32, device=g.query_lens.device)
            torch.cumsum(g.query_lens, 0, out=cu_q[1:])
            segments = 1
            if g.max_query_len == 1:
                most = self.max_segments
                if most is None:
                    most = MAX_SEGMENTS if cache.k.device.type == "cuda" else 1
                context = self.max_context or g.max_context_len
                segments = decode_split(context, most, self.min_segment_tiles)
            g.prepared = {
                "cu_q": cu_q,
                "seq_lens": g.context_lens.to(torch.int32),
                "tables": g.block_tables.to(torch.int32),
                "split": (segments, self.min_segment_tiles),
            }

    def write(self, cache: KVCache, layer: int, k, v, md: AttentionMetadata) -> None:
        t, hkv, d = k.shape
        if t == 0:
            return
        quant = cache.quant_policy
        pad = next_power_of_2(d // 2 if quant == 4 else d)
        for x, data, sz in ((k, cache.k, cache.k_scale_zero), (v, cache.v, cache.v_scale_zero)):
            x = x if x.stride(-1) == 1 else x.contiguous()
            c = data[layer].view(-1, hkv, data.shape[-1])
            s = sz[layer].view(-1, hkv, 2) if sz is not None else c
            _store_kv_kernel[(t, hkv)](
                x, md.slot_mapping, c, s,
                x.stride(0), x.stride(1), c.stride(0), c.stride(1), s.stride(0), s.stride(1),
                HEAD_DIM=d, PAD=pad, QUANT=quant,
            )  # fmt: skip

    def forward(self, q, cache: KVCache, layer: int, md: AttentionMetadata, scale: float):
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty_like(q)
        for g in md.groups:
            rows = slice(g.token_start, g.token_end)
            _group_attention(q[rows], out[rows], cache, layer, g, md, scale)
        return out


def _group_attention(q, out, cache: KVCache, layer: int, g: AttentionGroup, md, scale: float):
    t, h, d = q.shape
    hkv = cache.k.shape[3]
    p = g.prepared
    num_seqs = g.query_lens.shape[0]
    group = h // hkv
    bm = block_m(group, g.max_query_len)
    block_q = bm // group
    segments, min_seg_tiles = p["split"]
    k = cache.k[layer].view(-1, hkv, cache.k.shape[-1])
    v = cache.v[layer].view(-1, hkv, cache.v.shape[-1])
    quant = cache.quant_policy
    ksz = cache.k_scale_zero[layer].view(-1, hkv, 2) if quant else k
    vsz = cache.v_scale_zero[layer].view(-1, hkv, 2) if quant else v
    pad = max(16, next_power_of_2(d))  # tl.dot's smallest K
    if segments > 1:
        target = torch.empty(t, h, segments, pad, dtype=torch.float32, device=q.device)
        ml = torch.empty(t, h, segments, 2, dtype=torch.float32, device=q.device)
        so_t, so_h, so_s = target.stride(0), target.stride(1), target.stride(2)
    else:
        target, ml = out, out
        so_t, so_h, so_s = out.stride(0), out.stride(1), 1
    grid = (t // block_q + num_seqs, hkv, segments)
    _attention_kernel[grid](
        target, q, k, v, ksz, vsz, ml, min_seg_tiles, p["tables"], p["seq_lens"], p["cu_q"],
        num_seqs, h, scale * _LOG2E, md.sliding_window or 0, md.block_size, p["tables"].stride(0),
        q.stride(0), q.stride(1), so_t, so_h, so_s,
        k.stride(0), k.stride(1), ksz.stride(0), ksz.stride(1),
        G=group, HEAD_DIM=d, HEAD_PAD=pad, BLOCK_M=bm, BLOCK_Q=block_q, TILE=TILE,
        QUANT=quant, NUM_SEGMENTS=segments,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    if segments > 1:
        _merge_segments_kernel[(t, h)](
            out, target, ml, p["seq_lens"], min_seg_tiles, h, out.stride(0), out.stride(1),
            HEAD_DIM=d, HEAD_PAD=pad, NUM_SEGMENTS=segments, SEG_PAD=next_power_of_2(segments),
            TILE=TILE,
        )  # fmt: skip


__all__ = ["TritonAttentionBackend", "block_m", "decode_split"]
