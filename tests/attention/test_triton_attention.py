"""The Triton attention backend against the torch reference, kernel by kernel.

Without a GPU these run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel is defined); with one, the same tests run compiled.
Each case builds one paged cache per backend with the same history, writes a step's new K/V
through each backend's store, and compares the outputs and the stored slots.
"""

from __future__ import annotations

import pytest
import torch

from steadylm import platform
from steadylm.attention.base import AttentionGroup, AttentionMetadata
from steadylm.attention.torch_ref import TorchAttentionBackend, quantize_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    not platform.triton_usable(DEVICE),
    reason="triton is not installed, or no GPU and TRITON_INTERPRET is not set",
)

if platform.triton_usable(DEVICE):
    from steadylm.attention.triton_attn import TritonAttentionBackend, decode_split

TOL = {torch.float32: 2e-5, torch.float16: 4e-3}

# (new tokens, cached tokens) per sequence: decodes, a fresh prompt, chunks over a prefix.
MIXED = ((1, 7), (1, 40), (5, 0), (3, 20), (9, 33))
DECODE = ((1, 5), (1, 70), (1, 33), (1, 1))


def _layout(seqs, block_size, num_blocks):
    """Random distinct blocks per sequence; the slots of its history and of its new tokens."""
    gen = torch.Generator().manual_seed(len(seqs) * 31 + block_size)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, hist, new = [], [], []
    for q_len, cached in seqs:
        n = -(-(q_len + cached) // block_size)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        hist += [table[p // block_size] * block_size + p % block_size for p in range(cached)]
        new += [
            table[p // block_size] * block_size + p % block_size
            for p in range(cached, cached + q_len)
        ]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return padded, torch.tensor(hist), torch.tensor(new)


def _metadata(seqs, tables, slots, block_size, window):
    q_lens = torch.tensor([q for q, _ in seqs])
    ctx = torch.tensor([c for _, c in seqs]) + q_lens
    group = AttentionGroup(
        0,
        int(q_lens.sum()),
        tables.to(DEVICE),
        ctx.to(DEVICE),
        q_lens.to(DEVICE),
        int(q_lens.max()),
        int(ctx.max()),
    )
    return AttentionMetadata(slots.to(DEVICE), [group], block_size, window)


def _run_both(
    seqs,
    *,
    block_size=16,
    quant=0,
    kv_heads=2,
    group=2,
    head_dim=16,
    window=None,
    dtype=torch.float32,
    max_segments=None,
    min_segment_tiles=1,
    seed=0,
):
    """-> (reference output, triton output, reference cache, triton cache, new slots)."""
    torch.manual_seed(seed)
    heads, num_blocks = kv_heads * group, 48
    ref = TorchAttentionBackend()
    tri = TritonAttentionBackend(max_segments=max_segments, min_segment_tiles=min_segment_tiles)
    shape = (1, num_blocks, block_size, kv_heads, head_dim, dtype, DEVICE, quant)
    c_ref, c_tri = ref.allocate(*shape), tri.allocate(*shape)
    tables, hist, new = _layout(seqs, block_size, num_blocks)
    if len(hist):
        kh = torch.randn(len(hist), kv_heads, head_dim).to(dtype).to(DEVICE)
        vh = torch.randn(len(hist), kv_heads, head_dim).to(dtype).to(DEVICE)
        md = _metadata(seqs, tables, hist, block_size, window)
        ref.prepare(md, c_ref)  # zeroes the blocks the reference gathers whole
        ref.write(c_ref, 0, kh, vh, md)
        tri.write(c_tri, 0, kh, vh, md)
    t = sum(q for q, _ in seqs)
    q = torch.randn(t, heads, head_dim).to(dtype).to(DEVICE)
    k = torch.randn(t, kv_heads, head_dim).to(dtype).to(DEVICE)
    v = torch.randn(t, kv_heads, head_dim).to(dtype).to(DEVICE)
    outs = []
    for backend, cache in ((ref, c_ref), (tri, c_tri)):
        md = _metadata(seqs, tables, new, block_size, window)
        backend.prepare(md, cache)
        backend.write(cache, 0, k, v, md)
        outs.append(backend.forward(q, cache, 0, md, head_dim**-0.5))
    return outs[0], outs[1], c_ref, c_tri, torch.cat([hist, new]).to(DEVICE)


def _slots(cache, slots):
    """Every stored tensor of a layer-0 cache at the given flat slots."""
    parts = [cache.k, cache.v, cache.k_scale_zero, cache.v_scale_zero]
    return [p[0].flatten(0, 1)[slots] for p in parts if p is not None]


def _check(seqs, **kw):
    dtype = kw.get("dtype", torch.float32)
    o_ref, o_tri, c_ref, c_tri, slots = _run_both(seqs, **kw)
    torch.testing.assert_close(o_tri.float(), o_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    for a, b in zip(_slots(c_ref, slots), _slots(c_tri, slots)):
        assert torch.equal(a, b)  # the store is bit-exact, quantized or not


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("quant", [0, 8, 4])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_batch_matches_reference(block_size, quant, group):
    _check(MIXED, block_size=block_size, quant=quant, group=group, kv_heads=2 if group < 8 else 1)


@pytest.mark.parametrize("quant", [0, 8, 4])
@pytest.mark.parametrize("group", [1, 4])
def test_fp16_matches_reference(quant, group):
    _check(MIXED, quant=quant, group=group, dtype=torch.float16)


@pytest.mark.parametrize("quant", [0, 8, 4])
@pytest.mark.parametrize("window", [1, 4, 17])
def test_sliding_window_matches_reference(quant, window):
    _check(MIXED, quant=quant, window=window)


@pytest.mark.parametrize("quant", [0, 4])
@pytest.mark.parametrize("segments", [2, 3, 32])
@pytest.mark.parametrize("min_tiles", [1, 2])
def test_split_decode_segments_match_reference(quant, segments, min_tiles):
    """Decode spreads each row's keys over the segments in whole tiles (at least min_tiles
    each); a short context leaves the later segments without keys, and a window leaves the
    first ones empty."""
    kw = dict(quant=quant, max_segments=segments, min_segment_tiles=min_tiles)
    _check(DECODE, group=4, **kw)
    _check(DECODE, window=9, **kw)


def test_a_decode_row_does_not_depend_on_its_batch():
    """A row's split follows from its own context, so its bits are the same alone or in a
    batch with longer and shorter rows (a padded CUDA graph bucket is a batch)."""
    torch.manual_seed(0)
    tri = TritonAttentionBackend(max_context=128, max_segments=2, min_segment_tiles=1)
    cache = tri.allocate(1, 16, 16, 2, 16, torch.float32, DEVICE, 4)
    for t in (cache.k, cache.v):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    for t in (cache.k_scale_zero, cache.v_scale_zero):
        t.copy_(torch.rand(t.shape))
    q = torch.randn(3, 8, 16, device=DEVICE)
    tables = torch.arange(16, device=DEVICE).view(2, 8)

    def decode(rows, ctx, q_rows):
        g = AttentionGroup(
            0,
            len(rows),
            tables[rows],
            torch.tensor(ctx, device=DEVICE),
            torch.ones(len(rows), dtype=torch.long, device=DEVICE),
            1,
            max(ctx),
        )
        md = AttentionMetadata(torch.full((len(rows),), -1, device=DEVICE), [g], 16)
        tri.prepare(md, cache)
        return tri.forward(q[q_rows], cache, 0, md, 0.25)

    # alone, 40 keys are two 1-tile segments; a split that followed the batch's longest row
    # (128 keys: 2 tiles per segment) would sum them in one
    alone = decode([1], [40], [1])
    batch = decode([0, 1, 1], [128, 40, 1], [0, 1, 2])
    assert torch.equal(alone[0], batch[1])


@pytest.mark.parametrize("head_dim", [20, 80])
@pytest.mark.parametrize("quant", [0, 4])
def test_head_dims_that_are_not_powers_of_two(head_dim, quant):
    _check(MIXED[:3], quant=quant, head_dim=head_dim)


def test_block_sizes_below_a_tile_and_not_powers_of_two():
    _check(MIXED, block_size=8)
    _check(MIXED, block_size=24, quant=8)


def test_a_long_chunk_spans_many_query_blocks():
    _check(((40, 30), (1, 3), (37, 0)), group=1)
    _check(((40, 30), (1, 3), (37, 0)), group=8, kv_heads=1, quant=4)


@pytest.mark.parametrize("quant", [0, 8, 4])
def test_store_skips_padded_slots(quant):
    """Slots < 0 (a CUDA graph's padded rows) are written nowhere."""
    tri = TritonAttentionBackend()
    cache = tri.allocate(1, 4, 16, 2, 16, torch.float32, DEVICE, quant)
    for t in (cache.k, cache.v, cache.k_scale_zero, cache.v_scale_zero):
        if t is not None:
            t.fill_(7)
    before = [t.clone() for t in (cache.k, cache.v)]
    k = torch.randn(3, 2, 16, device=DEVICE)
    md = AttentionMetadata(torch.tensor([-1, 5, -1], device=DEVICE), [], 16)
    tri.write(cache, 0, k, k, md)
    flat = cache.k[0].flatten(0, 1)
    changed = (flat != before[0][0].flatten(0, 1)).flatten(1).any(1).nonzero().flatten()
    assert changed.tolist() == [5]
    if quant:
        codes, sz = quantize_kv(k[1:2], quant)
        assert torch.equal(flat[5:6], codes)
        assert torch.equal(cache.k_scale_zero[0].flatten(0, 1)[5:6], sz)
    else:
        assert torch.equal(flat[5], k[1])


def test_decode_split_covers_the_longest_context_in_whole_tiles():
    from steadylm import memory
    from steadylm.attention.triton_attn import MAX_SEGMENTS, TILE

    assert memory._SPLIT_SEGMENTS == MAX_SEGMENTS  # the plan counts the partials it needs
    assert decode_split(32768, 32, 4) == 32
    assert decode_split(100, 32, 1) == -(-100 // TILE)  # one tile each
    assert decode_split(1000, 32, 4) == -(-1000 // (4 * TILE))  # no segment always empty
    assert decode_split(1000, 3, 4) == 3
    assert decode_split(10, 32, 4) == 1


def test_padded_rows_leave_real_rows_alone():
    """A CUDA graph bucket pads its batch with rows of context 1 whose table names block 0,
    whatever it holds (NaN here); a row with context 0 gives zeros. Real rows are exact."""
    torch.manual_seed(1)
    tri = TritonAttentionBackend(max_context=64, max_segments=4, min_segment_tiles=1)
    cache = tri.allocate(1, 4, 16, 2, 16, torch.float32, DEVICE, 0)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    k = torch.randn(20, 2, 16, device=DEVICE)
    v = torch.randn(20, 2, 16, device=DEVICE)
    cache.k[0, 1:3].view(-1, 2, 16)[:20] = k[:20]  # the real row: blocks 1 and 2
    cache.v[0, 1:3].view(-1, 2, 16)[:20] = v[:20]
    q = torch.randn(3, 4, 16, device=DEVICE)
    tables = torch.tensor([[1, 2], [0, 0], [0, 0]], device=DEVICE)
    group = AttentionGroup(
        0,
        3,
        tables,
        torch.tensor([20, 1, 0], device=DEVICE),
        torch.ones(3, dtype=torch.long, device=DEVICE),
        1,
        20,
    )
    md = AttentionMetadata(torch.full((3,), -1, device=DEVICE), [group], 16)
    tri.prepare(md, cache)
    out = tri.forward(q, cache, 0, md, 0.25)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # (20, 4, 16)
    w = torch.softmax(torch.einsum("hd,thd->ht", q[0], kk) * 0.25, dim=-1)
    torch.testing.assert_close(out[0], torch.einsum("ht,thd->hd", w, vv))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
