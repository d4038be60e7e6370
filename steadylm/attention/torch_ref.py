"""Pure-torch reference attention over a paged KV cache. Runs unchanged on CPU and CUDA.
On the CPU, native kernels in steadylm/kernels read the blocks in place instead: decode groups
of an unquantized cache go to the paged decode kernel, its prefill groups whose contexts are all
short (`short_prefill_context`) to the prefill kernel, and every group of an int8 / int4 cache
(prefill and decode) to the paged attention kernel, which computes each query row as a decode
row does, so a token's bits, and so the codes it writes, do not depend on its batch, chunk,
preemption or cache hit (the prefill kernel's rows are independent of their batch too, but
differ from decode's in the last ulps, as SDPA's do).

Per group, one batched SDPA call: queries padded to (S, max_q), keys gathered from the block
tables up to the group's longest context, and a boolean causal (optionally sliding-window) mask.
No Python loop over sequences or layers happens inside a step; the index tensors are built once
per step in `prepare` and shared by all layers.

KV quantization (quant_policy 8 / 4): asymmetric per token and per head. For each (token, head)
the cache stores `scale = (max - min) / levels` and `zero = min` in the model dtype, and codes
`round((x - zero) / scale)` as uint8 (8 bits) or two 4-bit codes per byte (4 bits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from steadylm import kernels, platform
from steadylm.attention.base import AttentionBackend, AttentionGroup, AttentionMetadata, KVCache

_LEVELS = {8: 255, 4: 15}

# Prefill groups of an unquantized cache whose longest context is at most this many tokens go
# to the native prefill kernel (kernels.native_prefill_attention): it reads the blocks in
# place (no gather), skips the causal half that SDPA's 512-key blocks compute, and holds each
# row's scores whole (so it stays with short contexts). 12 layers of 12 query / 4 KV heads of
# 64, fp32, 2 threads of an Intel Xeon with AMX: 16 prompts of 256 tokens 127 ms against
# SDPA's 203 (the per-row kernel before it: 217); 8 x 512 216 against 362; 4 x 1k 413 against
# 503; 2 x 2k 1025 against 810 (SDPA ahead). bf16 where the CPU has no AMX takes it too: the
# per-row kernel led SDPA there at 256 tokens and trailed it 1.3x at 512 and about level at 1k
# (Zen 4 VM), and this kernel is 1.6x / 1.45x the per-row kernel at 512 / 1k. 0 keeps SDPA for
# every prefill.
SHORT_PREFILL_CONTEXT = 1024
# The same for a bf16 cache on a CPU with AMX (`short_prefill_context`), where SDPA's bf16
# matmuls run on AMX tiles and so do the kernel's (cpu_ops.cpp amx_prefill_attention): same
# shapes, bf16, the kernel against SDPA: 16 x 256 73 / 76 ms, 8 x 512 123 / 129, 4 x 1k
# 220 / 201 (SDPA ahead); the engine's SDPA also gathers the blocks (W1's bf16 first token
# 0.495 -> 0.46 s). 0 keeps SDPA there.
AMX_BF16_PREFILL_CONTEXT = 512


def short_prefill_context(dtype: torch.dtype) -> int:
    """The longest context whose prefill takes the native prefill kernel (unquantized cache):
    SHORT_PREFILL_CONTEXT, or AMX_BF16_PREFILL_CONTEXT for bf16 where the CPU has AMX."""
    if dtype == torch.bfloat16 and platform.cpu_has_amx_bf16():
        return AMX_BF16_PREFILL_CONTEXT
    return SHORT_PREFILL_CONTEXT


# A prefill chunk of at least this many query rows after cached context (a long prompt's later
# chunks, a prefix-cache hit), one sequence, no window, on the CPU: two SDPA calls instead of
# one with a mask, the context before the chunk unmasked and the chunk's own keys causal, merged
# by their log-sum-exp. One 4096-row chunk, 12 query / 4 KV heads of 64, 2 threads, Zen 4 VM,
# a layer: 8k context fp32 924 -> 630 ms, bf16 891 -> 603; 16k 1956 -> 1485 and 1632 -> 1426
# ms; a 512-row chunk gained nothing. 0 keeps the one masked call.
SPLIT_PREFIX_MIN_QUERY = 1024


def quantize_kv(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, H, D) -> codes (T, H, D or D/2) uint8, scale_zero (T, H, 2) in x.dtype."""
    levels = _LEVELS[bits]
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True)
    hi = xf.amax(dim=-1, keepdim=True)
    # A tensor divisor, not a Python number: CUDA torch divides by a host scalar as a multiply
    # by its reciprocal (1 ulp off), while the CPU and the Triton store divide exactly.
    scale = ((hi - lo) / hi.new_full((), levels)).clamp_min(1e-8)
    # Round-trip the stored params through the cache dtype so encode and decode agree.
    scale = scale.to(x.dtype).float().clamp_min(1e-8)
    lo = lo.to(x.dtype).float()
    codes = torch.clamp(torch.round((xf - lo) / scale), 0, levels).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, torch.cat([scale, lo], dim=-1).to(x.dtype)


def dequantize_kv(codes: torch.Tensor, scale_zero: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., D or D/2) uint8, scale_zero (..., 2) -> (..., D) in scale_zero.dtype:
    code * scale + zero computed in fp32, rounded once to the dtype (as the Triton kernels
    dequantize; the native CPU kernels keep the fp32 values, one fused multiply-add)."""
    if bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
    sz = scale_zero.float()
    return (codes.float() * sz[..., :1] + sz[..., 1:]).to(scale_zero.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, md: AttentionMetadata, cache: KVCache) -> None:
        _zero_new_blocks(cache, md)
        if cache.quant_policy:
            self._prepare_quantized(md, cache)
            return
        native = kernels.native_decode_attention(cache.k.dtype, cache.k.device)
        prefill = kernels.native_prefill_attention(cache.k.dtype, cache.k.device)
        short = short_prefill_context(cache.k.dtype)
        for g in md.groups:
            if native is not None and g.max_query_len == 1:
                # Decode reads the paged cache in place: no gather, no tiles, no mask.
                g.prepared = {"native": native, "window": md.sliding_window or 0}
            elif prefill is not None and g.max_context_len <= short:
                g.prepared = _rows_prepared(g, prefill, md.sliding_window, "prefill")
            else:
                g.prepared = {"tiles": _tiles(g, md.block_size, md.sliding_window)}

    def _prepare_quantized(self, md: AttentionMetadata, cache: KVCache) -> None:
        """int8 / int4: every query row, prefill or decode, goes to the native kernel, which
        dequantizes the blocks in place and computes each row on its own. One ulp of K can move
        an int4 code, so the K/V a token writes must not depend on the chunk, batch, preemption
        or cache hit it met; SDPA's result for a row depends on its tile and mask."""
        native = kernels.native_paged_attention(cache.k_scale_zero.dtype, cache.k.device)
        for g in md.groups:
            if native is None:
                g.prepared = {"tiles": _tiles(g, md.block_size, md.sliding_window)}
                continue
            g.prepared = _rows_prepared(g, native, md.sliding_window)

    def write(self, cache: KVCache, layer: int, k, v, md: AttentionMetadata) -> None:
        slots = md.slot_mapping
        if md.num_padded_tokens:  # padding rows come last and write nowhere
            real = len(slots) - md.num_padded_tokens
            slots, k, v = slots[:real], k[:real], v[:real]
        bits = cache.quant_policy
        native = kernels.native_store_kv(k)
        stored = cache.k_scale_zero if bits else cache.k  # what holds k's dtype
        if (
            native is not None
            and kernels.native_store_kv(v) is not None
            and stored.dtype == k.dtype
        ):
            # One pass per tensor (quantised as quantize_kv does, bit for bit).
            native(cache.k[layer], cache.k_scale_zero[layer] if bits else None, k, slots, bits)
            native(cache.v[layer], cache.v_scale_zero[layer] if bits else None, v, slots, bits)
            return
        if cache.quant_policy == 0:
            cache.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
            cache.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)
            return
        for codes, params, x in (
            (cache.k, cache.k_scale_zero, k),
            (cache.v, cache.v_scale_zero, v),
        ):
            q, sz = quantize_kv(x, cache.quant_policy)
            codes[layer].view(-1, *q.shape[1:]).index_copy_(0, slots, q)
            params[layer].view(-1, *sz.shape[1:]).index_copy_(0, slots, sz)

    def forward(self, q, cache: KVCache, layer: int, md: AttentionMetadata, scale: float):
        if len(md.groups) == 1 and md.groups[0].prepared.keys() & _NATIVE:
            return _native(q, cache, layer, md.groups[0], scale)
        out = torch.empty_like(q)
        for g in md.groups:
            if g.prepared.keys() & _NATIVE:
                rows = slice(g.token_start, g.token_end)
                out[rows] = _native(q[rows], cache, layer, g, scale)
                continue
            for t in g.prepared["tiles"]:
                k = _gather(cache, cache.k, cache.k_scale_zero, layer, t["blocks"], q.dtype)
                v = _gather(cache, cache.v, cache.v_scale_zero, layer, t["blocks"], q.dtype)
                if t["ctx"] is not None:  # no padding to mask: cut the block tail off
                    k, v = k[:, : t["ctx"]], v[:, : t["ctx"]]
                if t["decode"]:
                    out_rows = t["slice"] if t["slice"] is not None else t["out_index"]
                    out[out_rows] = _decode_attention(q[out_rows], k, v, t["mask"], scale)
                    continue
                if t["whole"]:  # (S * Q, H, D) rows in order: a view, not a gather
                    qp = q[t["slice"]].unflatten(0, (-1, t["ctx"]))
                else:
                    qp = q[t["q_index"]]  # (S, Q, H, D)
                if t["prefix"] and q.dtype in (torch.float32, torch.bfloat16):
                    o = _prefix_then_causal(qp, k, v, t["prefix"], scale)
                    out[t["out_index"]] = o[t["q_valid"]]
                    continue
                o = F.scaled_dot_product_attention(
                    qp.transpose(1, 2),
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    attn_mask=t["mask"],
                    is_causal=t["causal"],
                    scale=scale,
                    enable_gqa=k.shape[2] != qp.shape[2],
                ).transpose(1, 2)  # (S, Q, H, D)
                if t["whole"]:  # one strided copy into place
                    out[t["slice"]].unflatten(0, (-1, t["ctx"])).copy_(o)
                else:
                    out[t["out_index"]] = o[t["q_valid"]]
        return out


_NATIVE = {"native", "prefill", "rows"}  # the prepared plans a native kernel runs


def _native(q, cache: KVCache, layer: int, g: AttentionGroup, scale: float):
    p = g.prepared
    if "native" in p:  # decode over an unquantized cache
        return p["native"](
            q, cache.k[layer], cache.v[layer], g.block_tables, g.context_lens, scale, p["window"]
        )
    if "prefill" in p:  # a short prefill over an unquantized cache
        return p["prefill"](
            q,
            cache.k[layer],
            cache.v[layer],
            g.block_tables,
            p["token_seq"],
            p["token_ctx"],
            scale,
            p["window"],
        )
    bits = cache.quant_policy
    return p["rows"](
        q,
        cache.k[layer],
        cache.v[layer],
        cache.k_scale_zero[layer] if bits else None,
        cache.v_scale_zero[layer] if bits else None,
        g.block_tables,
        p["token_seq"],
        p["token_ctx"],
        scale,
        p["window"],
        bits,
    )


def _rows_prepared(g: AttentionGroup, rows, window: int | None, key: str = "rows") -> dict:
    """A group's plan for a native kernel that takes its rows one by one (`rows`, under
    `key`): each query row's sequence and context length."""
    if g.max_query_len == 1:  # decode rows: row i is sequence i, at its context length
        seq, ctx = torch.arange(len(g.context_lens), device=g.context_lens.device), g.context_lens
    else:
        seq, ctx = _token_contexts(g)
    return {key: rows, "window": window or 0, "token_seq": seq, "token_ctx": ctx}


def _token_contexts(g: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row of the group: its sequence (block table row) and its context length
    (its position + 1), (T,) int64 each."""
    seqs = torch.arange(len(g.query_lens), device=g.query_lens.device)
    token_seq = torch.repeat_interleave(seqs, g.query_lens)  # (T,)
    starts = torch.cumsum(g.query_lens, 0) - g.query_lens
    offset = torch.arange(len(token_seq), device=seqs.device) - starts[token_seq]
    first_new = (g.context_lens - g.query_lens)[token_seq]
    return token_seq, first_new + offset + 1


def _prefix_then_causal(q, k, v, prefix: int, scale: float) -> torch.Tensor:
    """One sequence's chunk q (1, Q, H, D) after `prefix` cached positions, keys/values
    (1, >= prefix + Q, Hkv, D): attention over the prefix (every row sees all of it: no mask,
    GQA query heads folded into rows) and over the chunk's own Q keys (causal), merged by the
    two parts' log-sum-exp. CPU only (torch's CPU flash kernel returns the log-sum-exp)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    s, n, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qh = q.transpose(1, 2)  # (1, H, Q, D)
    kh, vh = k[:, : prefix + n].transpose(1, 2), v[:, : prefix + n].transpose(1, 2)
    o1, l1 = flash(qh.reshape(s, hkv, g * n, d), kh[:, :, :prefix], vh[:, :, :prefix], scale=scale)
    o1, l1 = o1.reshape(s, h, n, d), l1.reshape(s, h, n)
    own_k = kh[:, :, prefix:].repeat_interleave(g, 1)
    own_v = vh[:, :, prefix:].repeat_interleave(g, 1)
    o2, l2 = flash(qh, own_k, own_v, is_causal=True, scale=scale)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp(), (l2 - m).exp()
    o = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    return o.to(q.dtype).transpose(1, 2)  # (1, Q, H, D)


def _decode_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """One new token per sequence: q (S, H, D), k/v (S, C, Hkv, D) -> (S, H, D).

    The G = H / Hkv query heads that share a KV head go in as G query rows of that head, so
    SDPA sees (S, Hkv, G, D) against (S, Hkv, C, D) and never expands K/V per query head
    (enable_gqa's path, 10x slower in bf16 on CPU, measured). Query head h reads KV head
    h // G, as in transformers' repeat_kv."""
    s, h, d = q.shape
    hkv = k.shape[2]
    o = F.scaled_dot_product_attention(
        q.view(s, hkv, h // hkv, d),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,  # (S, 1, 1, C) or None
        scale=scale,
    )  # (S, Hkv, G, D)
    return o.reshape(s, h, d)


# Upper bound on padded context tokens gathered per attention call (S x max context). Bounds
# the reference backend's workspace whatever the batch; one sequence always fits alone.
ATTN_WORKSPACE_TOKENS = 32768


def workspace_tokens(max_context: int) -> int:
    return max(ATTN_WORKSPACE_TOKENS, max_context)


def _gather(cache: KVCache, data, params, layer: int, blocks, dtype) -> torch.Tensor:
    # Whole blocks, so each copy is one contiguous block: blocks (S, NB) -> (S, NB*bs, Hkv, D)
    # On a 2-D view (one row per block) index_select is a plain row copy, ~4x faster on CPU
    # than on the 4-D block tensor.
    s, nb = blocks.shape
    flat_ids = blocks.flatten()
    rows = data[layer].view(data.shape[1], -1)
    kv = rows.index_select(0, flat_ids).view(s, -1, *data.shape[3:])
    if cache.quant_policy == 0:
        return kv
    prow = params[layer].view(params.shape[1], -1)
    sz = prow.index_select(0, flat_ids).view(s, -1, *params.shape[3:])
    return dequantize_kv(kv, sz, cache.quant_policy).to(dtype)


def _zero_new_blocks(cache: KVCache, md: AttentionMetadata) -> None:
    """The pool is allocated uninitialised (its pages cost nothing until used). The gather
    reads whole blocks, including slots past a sequence's end and padding entries (block 0,
    zeroed at allocation), so a block is zeroed the first time any table names it: masked
    slots then hold finite values, never NaN. Only ever-used blocks are touched. Where the
    runner lists the blocks taken since the last step (md.new_block_ids) only those are
    checked: a decode step that takes none does nothing (a step's torch ops here cost ~0.3
    ms on the CPU, its caches cold from the weights' stream)."""
    if md.new_block_ids is not None:
        if not md.new_block_ids:
            return
        ids = torch.tensor(md.new_block_ids, dtype=torch.long)
    else:
        ids = torch.cat([g.host("block_tables").flatten() for g in md.groups])
    fresh = ids[~cache.initialized[ids]]  # on the CPU: no sync
    if fresh.numel() == 0:
        return
    fresh = fresh.unique()
    on_device = fresh.to(cache.k.device)
    for t in (cache.k, cache.v, cache.k_scale_zero, cache.v_scale_zero):
        if t is not None:
            t.index_fill_(1, on_device, 0)
    cache.initialized[fresh] = True


def _tiles(g: AttentionGroup, block_size: int, window: int | None) -> list[dict]:
    """Split a group into tiles of sequences with similar context lengths, so that the padded
    gather (tile size x longest context) stays under the workspace bound."""
    ctx = [-(-c // block_size) * block_size for c in g.host("context_lens").tolist()]
    limit = workspace_tokens(max(ctx))
    if len(ctx) * max(ctx) <= limit:  # one tile: keep batch order
        return [_prepare_tile(g, list(range(len(ctx))), block_size, window)]
    order = sorted(range(len(ctx)), key=ctx.__getitem__)
    tiles, current = [], []
    for i in order:
        if current and (len(current) + 1) * ctx[i] > limit:
            tiles.append(current)
            current = []
        current.append(i)
    tiles.append(current)
    return [_prepare_tile(g, idx, block_size, window) for idx in tiles]


def _prepare_tile(g: AttentionGroup, seqs: list[int], block_size: int, window: int | None) -> dict:
    device = g.block_tables.device
    sel = torch.tensor(seqs, device=device)
    context_lens, query_lens = g.context_lens[sel], g.query_lens[sel]  # (S,)
    host_ctx, host_q = g.host("context_lens")[seqs], g.host("query_lens")[seqs]  # no sync
    tables = g.block_tables[sel]
    max_ctx, max_q = int(host_ctx.max()), int(host_q.max())
    num_blocks = -(-max_ctx // block_size)
    blocks = tables[:, :num_blocks]  # (S, NB): padding entries name block 0, masked below
    ctx = torch.arange(num_blocks * block_size, device=device)  # (C,)
    qpos = torch.arange(max_q, device=device)  # (Q,)
    q_valid = qpos[None, :] < query_lens[:, None]  # (S, Q)
    # Absolute position of query t of sequence s: context_len - query_len + t.
    abs_q = (context_lens - query_lens)[:, None] + qpos[None, :]  # (S, Q)
    mask = (ctx[None, None, :] <= abs_q[:, :, None]) & (
        ctx[None, None, :] < context_lens[:, None, None]
    )
    if window is not None:
        mask &= ctx[None, None, :] > abs_q[:, :, None] - window
    mask |= ~q_valid[:, :, None] & (ctx == 0)  # padded queries see one key, so no NaN rows
    starts = g.token_start + (torch.cumsum(g.query_lens, 0) - g.query_lens)[sel]  # (S,)
    q_index = (starts[:, None] + qpos[None, :]).clamp(max=g.token_end - 1)  # (S, Q) flat ids
    every = seqs == list(range(len(g.query_lens)))  # the group's sequences, in order
    in_order = every and max_q == 1
    single = len(seqs) == 1 and max_q == 1 and window is None
    # Fresh prompts of one length (no cached context): plain causal attention, no mask.
    causal = (
        max_q > 1
        and window is None
        and bool((host_q == max_q).all())
        and bool((host_ctx == max_q).all())
    )
    # Every sequence of the group, in order, each a fresh prompt of max_q tokens: the tile's
    # query rows are the group's flat slice as they stand (no gather, no scatter back).
    whole = causal and every
    prefix = int(host_ctx[0] - host_q[0]) if len(seqs) == 1 else 0
    split = (
        device.type == "cpu"
        and window is None
        and SPLIT_PREFIX_MIN_QUERY > 0
        and max_q >= SPLIT_PREFIX_MIN_QUERY
        and prefix > 0
    )
    return {
        "prefix": prefix if split else 0,
        "decode": max_q == 1,
        "slice": slice(g.token_start, g.token_end) if in_order or whole else None,
        "ctx": max_ctx if single or causal else None,
        "causal": causal,
        "whole": whole,
        "blocks": blocks,
        "mask": None if single or causal else mask[:, None],
        "q_valid": q_valid,
        "q_index": q_index,
        "out_index": q_index[q_valid],
    }
