"""The native CPU kernels (steadylm/kernels) against their pure-torch references, and the
engine's greedy tokens against transformers with the kernels on and off."""

from __future__ import annotations

import os

import pytest
import torch

from steadylm import kernels
from steadylm.engine.request import SamplingParams
from steadylm.errors import ConfigError
from tests.conftest import engine_for, hf_greedy

ops = kernels.native_ops()
needs_native = pytest.mark.skipif(ops is None, reason=f"native CPU kernels: {kernels.status()}")
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)


def test_native_kernels_build_in_ci():
    """CI has a compiler: the kernels must build there, or the fast path silently rots."""
    if os.environ.get("CI") != "true":
        pytest.skip("only enforced in CI (CI=true)")
    assert ops is not None, kernels.status()


def test_a_stale_build_lock_does_not_stop_the_next_start(tmp_path):
    """A build killed midway leaves torch's `lock` file behind; torch alone would wait on it
    forever. The next start clears it and loads the kernels within seconds."""
    import subprocess
    import sys

    if kernels.status() != "native":
        pytest.skip(f"no native kernels here: {kernels.status()}")
    lock = os.path.join(kernels._build_directory(kernels._build_name()), "lock")
    with open(lock, "w"):
        pass  # what a killed build leaves
    code = "from steadylm import kernels; print(kernels.status())"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
    finally:
        stale = os.path.exists(lock)
        if stale:
            os.remove(lock)  # never leave the machine hung for the rest of the suite
    assert out.stdout.strip() == "native", out.stderr
    assert not stale
    assert "left by an interrupted kernel build" in out.stderr


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 768), (5, 48), (3, 2, 40)])  # 40, 48: vector tails
def test_rms_norm_matches_reference(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    want = kernels.rms_norm_ref(x, w, 1e-6)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), want, **_tol(dtype))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_the_residual_in_place(dtype):
    torch.manual_seed(0)
    x, r = torch.randn(4, 72, dtype=dtype), torch.randn(4, 72, dtype=dtype)
    w = torch.randn(72, dtype=dtype)
    total = x + r  # rounded to the dtype, as HF's residual add
    want = kernels.rms_norm_ref(total, w, 1e-5)
    r_in = r.clone()
    out, res = kernels.fused_add_rms_norm(x, r_in, w, 1e-5)
    assert res is r_in and torch.equal(res, total)  # the sum is bit-exact
    torch.testing.assert_close(out, want, **_tol(dtype))


@needs_native
def test_bf16_results_keep_denormals_as_torch_does():
    """bf16 outputs go through one AVX512-BF16 conversion where the CPU has it, which flushes
    denormals; a vector holding one takes ATen's rounding: rotary's and the residual sum's
    bits stay torch's, denormals included (and normal values around them)."""
    from steadylm.layers.rotary import RotaryEmbedding, rotate_ref

    torch.manual_seed(0)
    tiny = torch.finfo(torch.bfloat16).tiny  # the smallest normal
    cfg = type("Cfg", (), {"rope_theta": 10000.0})()
    cos, sin = RotaryEmbedding(cfg, 64).cos_sin(torch.arange(8), torch.bfloat16)
    x = (torch.randn(8, 4, 64) * tiny * 4).bfloat16()
    x[::2] = torch.randn(4, 4, 64).bfloat16()  # rows of normal values beside them
    want = rotate_ref(x.clone(), cos, sin)
    assert ((want != 0) & (want.abs() < tiny)).any()  # the case is exercised
    assert torch.equal(ops.rotary_(x, cos, sin), want)
    a = (torch.randn(4, 64) * tiny).bfloat16()
    b = (torch.randn(4, 64) * tiny).bfloat16()
    total = a + b
    assert ((total != 0) & (total.abs() < tiny)).any()
    _, res = kernels.fused_add_rms_norm(a, b, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    assert torch.equal(res, total)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 2 * 80, dtype=dtype) * 4
    torch.testing.assert_close(ops.silu_and_mul(x), kernels.silu_and_mul_ref(x), **_tol(dtype))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 17, 32000, 151936])
def test_argmax_is_torch_argmax_with_ties_nan_and_inf(vocab, dtype):
    """The native argmax returns torch.argmax's index on random rows, on ties (the first
    maximum), on rows holding NaN (the first NaN), and on rows of -inf (index 0), at lengths
    that do and do not fill whole vectors; bf16 rows (more ties) the index of their float32
    copy's."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[1] = x[1].round()  # many ties
    x[2] = 0.0  # all tied
    x[3] = float("-inf")
    x[4, vocab // 2] = float("inf")
    x[5, vocab - 1] = float("nan")
    x[6, vocab // 3] = float("nan")
    x[6, vocab - 1] = float("nan")
    x[7, -1] = x[7].max() + 1  # the maximum in the tail past the last whole vector
    x[8, 0] = x[8].max() + 1
    x = x.to(dtype)
    want = x.float().argmax(dim=-1)
    assert torch.equal(ops.argmax(x), want)
    assert torch.equal(kernels.argmax(x), want)
    half = x[:, : max(vocab // 2, 1)]
    assert torch.equal(kernels.argmax(half), half.float().argmax(dim=-1))  # a strided view


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [0, 8, 4])
@pytest.mark.parametrize("head_dim", [64, 80, 6])
def test_store_kv_writes_the_reference_codes_bit_for_bit(dtype, bits, head_dim):
    """The native KV store against index_copy_ of quantize_kv's codes and scale/zero: same
    bits, padding slots (-1) skipped, every other slot untouched; a bad slot raises before
    anything is written."""
    from steadylm.attention.torch_ref import quantize_kv

    torch.manual_seed(0)
    heads, width = 3, head_dim // 2 if bits == 4 else head_dim
    qkv = (torch.randn(7, 3 * heads, head_dim) * torch.rand(7, 3 * heads, 1) * 10).to(dtype)
    qkv[2, heads + 1] = 0.5  # a constant row: the scale clamps to 1e-8
    x = qkv[:, heads : 2 * heads]  # strided, as the k of the fused qkv output
    slots = torch.tensor([5, 0, 39, -1, 17, 18, 3])
    cache = torch.full((5, 8, heads, width), 7, dtype=dtype if bits == 0 else torch.uint8)
    sz = torch.full((5, 8, heads, 2), 3.0, dtype=dtype) if bits else None
    want_cache, want_sz = cache.clone(), None if sz is None else sz.clone()
    ops.store_kv_(cache, sz, x, slots, bits)
    real = slots >= 0
    if bits:
        codes, params = quantize_kv(x[real], bits)
        want_cache.view(-1, heads, width).index_copy_(0, slots[real], codes)
        want_sz.view(-1, heads, 2).index_copy_(0, slots[real], params)
        assert torch.equal(sz, want_sz)
    else:
        want_cache.view(-1, heads, width).index_copy_(0, slots[real], x[real])
    assert torch.equal(cache, want_cache)
    before = cache.clone()
    with pytest.raises(RuntimeError, match="out of range"):
        ops.store_kv_(cache, sz, x, torch.tensor([0, 1, 2, 3, 4, 5, 40]), bits)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0}])
def test_rotary_table_rows_are_the_computed_cos_sin_bit_for_bit(dtype, rope):
    """On the CPU cos/sin come from a table of the positions seen so far, grown by doubling:
    each row is what computing that position alone gives (a scaled rope's factor included),
    before and after the table grows, for positions in any order and repeated."""
    from transformers import LlamaConfig

    from steadylm.layers.rotary import RotaryEmbedding

    params = {"rope_theta": 10000.0, "rope_type": "default"}
    if rope:
        params = {**params, **rope, "original_max_position_embeddings": 256}
    hf = LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=4096,
        rope_parameters=params,
    )  # fmt: skip
    rot = RotaryEmbedding(hf, 64)
    assert (rot.scale != 1.0) == bool(rope)
    for positions in ([3, 0, 255, 3], [256, 1000, 7], [4095, 1, 2048]):
        pos = torch.tensor(positions)
        cos, sin = rot.cos_sin(pos, dtype, max(positions) + 1)
        want_cos, want_sin = rot.compute(pos, dtype)
        assert cos.shape == want_cos.shape == (len(positions), 1, 64)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert rot.tables[dtype].shape[0] >= max(positions) + 1
    with pytest.raises(IndexError):  # a position past a bound given too low: no silent row
        rot.cos_sin(torch.tensor([rot.tables[dtype].shape[0]]), dtype, 1)
    size = rot.tables[dtype].shape[0]
    far = torch.tensor([9000, 5, 70000])  # past the table's cap: computed, the table as it was
    cos, sin = rot.cos_sin(far, dtype)
    assert torch.equal(cos, rot.compute(far, dtype)[0]) and torch.equal(
        sin, rot.compute(far, dtype)[1]
    )
    assert rot.tables[dtype].shape[0] == size <= 8192


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [(6, 16), (14, 64), (3, 80), (2, 6)])
def test_rotary_in_place_on_a_qkv_view_is_the_reference_bit_for_bit(dtype, heads, head_dim):
    """Each product and the sum rounded as torch's ops round them (no fused multiply-add):
    the same bits as layers.rotary.rotate_ref, written into the q/k heads of the fused qkv
    output and nowhere else."""
    from steadylm.layers.rotary import RotaryEmbedding, rotate, rotate_ref

    torch.manual_seed(0)
    cfg = type("Cfg", (), {"rope_theta": 10000.0})()
    cos, sin = RotaryEmbedding(cfg, head_dim).cos_sin(torch.tensor([0, 1, 7, 300, 4095]), dtype)
    qkv = torch.randn(5, heads + 2, head_dim, dtype=dtype) * 3
    x = qkv[:, :heads]  # strided: the v heads stay where they are
    v_before = qkv[:, heads:].clone()
    want = rotate_ref(x.clone(), cos, sin)
    out = rotate(x, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(qkv[:, :heads], want)
    assert torch.equal(qkv[:, heads:], v_before)
    with pytest.raises(RuntimeError, match="laid out alike"):
        ops.rotary_(x, cos, sin[:, :, :2])


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_seqs,heads,kv_heads,window,d,bs",
    [
        (1, 12, 4, 0, 32, 8),
        (1, 4, 4, 0, 64, 8),
        (3, 8, 2, 0, 32, 8),
        (2, 8, 2, 50, 128, 8),
        (9, 4, 1, 0, 32, 8),
        (2, 6, 2, 0, 80, 8),  # D not a multiple of every vector width
        (1, 3, 1, 0, 36, 8),  # a D tail below one vector
        (1, 12, 4, 0, 64, 64),  # whole-block chunks (the bench model's shape)
        (2, 8, 2, 100, 32, 128),  # chunks that end inside a block, a window
    ],
)
def test_paged_decode_attention_matches_reference(dtype, num_seqs, heads, kv_heads, window, d, bs):
    """Scattered block tables, lengths that end mid-block and span many chunks, spans split
    across threads (one or two sequences), GQA and MHA, sliding windows, head sizes that fill
    whole register passes or leave tails, blocks smaller and larger than a chunk."""
    torch.manual_seed(0)
    nb = 160
    kc = torch.randn(nb, bs, kv_heads, d, dtype=dtype)
    vc = torch.randn(nb, bs, kv_heads, d, dtype=dtype)
    lens = torch.tensor([1000, 157, 83, 64, 1, 200, 31, 120, 77][:num_seqs])
    tables = torch.stack([torch.randperm(nb)[:125] for _ in range(num_seqs)])
    q = torch.randn(num_seqs, heads, d, dtype=dtype)
    want = kernels.paged_decode_attention_ref(q, kc, vc, tables, lens, 0.17, window)
    got = ops.paged_decode_attention(q, kc, vc, tables, lens, 0.17, window)
    torch.testing.assert_close(got, want, **_tol(dtype))
    # q as a row slice of a wider tensor (the fused qkv projection's output)
    wide = torch.cat([q, torch.randn(num_seqs, 2, d, dtype=dtype)], dim=1)
    sliced = ops.paged_decode_attention(wide[:, :heads], kc, vc, tables, lens, 0.17, window)
    torch.testing.assert_close(sliced, got, rtol=0, atol=0)


def _paged_case(dtype, bits, heads, kv_heads, rows_per_seq, lens, nb=120, bs=8, d=32):
    """A paged cache (codes + scale_zero when bits > 0) and query rows: each sequence's last
    rows_per_seq positions, as a prefill chunk (or a decode step when 1) asks for them."""
    from steadylm.attention.torch_ref import quantize_kv

    kv = [torch.randn(nb, bs, kv_heads, d, dtype=dtype) for _ in range(2)]
    sz = [None, None]
    if bits:
        packed = [quantize_kv(x.view(-1, kv_heads, d), bits) for x in kv]
        kv = [c.view(nb, bs, kv_heads, -1) for c, _ in packed]
        sz = [p.view(nb, bs, kv_heads, 2) for _, p in packed]
    tables = torch.stack([torch.randperm(nb)[: -(-max(lens) // bs)] for _ in lens])
    token_seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(rows_per_seq))
    ctx = torch.cat([torch.arange(n - r + 1, n + 1) for n, r in zip(lens, rows_per_seq)])
    q = torch.randn(len(ctx), heads, d, dtype=dtype)
    return q, kv, sz, tables, token_seq, ctx


@needs_native
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 2])
def test_a_bf16_models_quantized_rows_are_dequantized_once(bits, rows):
    """A bf16 model's int8 / int4 rows enter attention as code * scale + zero in fp32, not
    rounded to bf16 after the product and again after the sum: with one key the output is
    that value rounded once (a code times a bf16 scale is exact in fp32, so fp32's product and
    sum are the kernel's fused multiply-add), as the reference's dequantize_kv has it. rows 1:
    a decode row (the codes into registers); 2: a prefill tile (its rows through fp32
    buffers), whose first row sees one key."""
    from steadylm.attention.torch_ref import dequantize_kv

    torch.manual_seed(0)
    q, (kc, vc), (ksz, vsz), tables, seq, ctx = _paged_case(
        torch.bfloat16, bits, 4, 2, [rows], [rows], d=64
    )
    got = ops.paged_attention(q, kc, vc, ksz, vsz, tables, seq, ctx, 0.125, 0, bits)
    slot = int(tables[0, 0])
    codes = vc[slot, 0]  # position 0's values: (kv_heads, d or d / 2)
    if bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
    scale, zero = vsz[slot, 0].float().unbind(-1)
    once = (codes.float() * scale[:, None] + zero[:, None]).bfloat16()
    twice = ((codes.bfloat16() * vsz[slot, 0, :, :1]) + vsz[slot, 0, :, 1:]).bfloat16()
    assert not torch.equal(once, twice)  # the case tells the two apart
    assert torch.equal(got[0], once.repeat_interleave(2, dim=0))
    assert torch.equal(dequantize_kv(vc[slot, 0], vsz[slot, 0], bits), once)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [0, 8, 4])
@pytest.mark.parametrize(
    "heads,kv_heads,rows,lens,window,d",
    [
        (12, 4, [1], [157], 0, 32),  # decode, one sequence
        (8, 2, [1, 1, 1], [1, 600, 83], 0, 32),  # decode batch; 600 keys span three spans
        (4, 4, [20, 1, 5], [20, 300, 261], 0, 32),  # a fresh prompt, a decode, a chunk past 256
        (8, 2, [7, 1], [90, 64], 50, 32),  # sliding window
        (4, 1, [3] * 9, [9, 31, 77, 120, 200, 64, 83, 157, 3], 0, 32),  # MQA, many tiles
        (16, 2, [5, 1], [300, 70], 0, 64),  # 8 query heads per KV head: several head passes
        (4, 2, [6, 1], [100, 40], 0, 36),  # a head size the vector passes do not take
    ],
)
def test_paged_attention_matches_reference(dtype, bits, heads, kv_heads, rows, lens, window, d):
    """Scattered block tables, lengths that end mid-block, prefill rows and decode rows,
    contexts over several spans, GQA / MHA / MQA, sliding windows, int8 / int4 caches."""
    torch.manual_seed(0)
    q, kv, sz, tables, seq, ctx = _paged_case(dtype, bits, heads, kv_heads, rows, lens, d=d)
    args = (*kv, *sz, tables, seq, ctx, 0.17, window, bits)
    want = kernels.paged_attention_ref(q, *args)
    got = ops.paged_attention(q, *args)
    torch.testing.assert_close(got, want, **_tol(dtype))
    # q as a row slice of a wider tensor (the fused qkv projection's output)
    wide = torch.cat([q, torch.randn(len(ctx), 2, q.shape[2], dtype=dtype)], dim=1)
    sliced = ops.paged_attention(wide[:, :heads], *args)
    assert torch.equal(sliced, got)


@needs_native
@pytest.mark.parametrize("bits", [0, 8, 4])
# the vector passes (G = 4 heads of 32 and G = 3 of 64: an AVX-512 decode row over a quantized
# cache then dequantizes in registers, a prefill row through the fp32 buffers), the key-by-key
# path (36)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (8, 2, 32), (12, 4, 64), (8, 2, 36)])
@pytest.mark.parametrize("dtype", DTYPES)
# a sliding window: each prefill row's keys start one later than the last row's, so a tile's
# rows share only part of a span (the rest goes row by row)
@pytest.mark.parametrize("window", [0, 100])
def test_paged_attention_row_is_independent_of_its_batch(dtype, bits, heads, kv_heads, d, window):
    """A row computed alone, in a decode batch, inside a prefill chunk (whose rows take the
    keys they share together), or with more threads gives the same bits: what keeps
    quantized KV (and so the output) independent of scheduling."""
    torch.manual_seed(0)
    q, kv, sz, tables, seq, ctx = _paged_case(
        dtype, bits, heads, kv_heads, [90, 1, 30], [300, 7, 600], d=d
    )

    def run(q, tables, seq, ctx):
        return ops.paged_attention(q, *kv, *sz, tables, seq, ctx, 0.17, window, bits)

    _assert_rows_independent(run, q, tables, seq, ctx)


def _assert_rows_independent(run, q, tables, seq, ctx):
    """run(q, block_tables, token_seq, context_lens) gives every row the same bits alone as in
    the whole batch, and with one thread as with more; returns the batch's result."""
    batch = run(q, tables, seq, ctx)
    for t in range(len(ctx)):
        s = int(seq[t])
        alone = run(q[t : t + 1], tables[s : s + 1], seq[:1] * 0, ctx[t : t + 1])
        assert torch.equal(alone[0], batch[t]), t
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(run(q, tables, seq, ctx), batch)
    finally:
        torch.set_num_threads(threads)
    return batch


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,rows,lens,window,d",
    [
        (12, 4, [256, 256], [256, 256], 0, 64),  # fresh prompts: four 64-row tiles each
        (4, 4, [20, 1, 5], [20, 300, 261], 0, 32),  # a prompt, one row, a chunk after context
        (8, 2, [7, 40], [90, 64], 50, 32),  # sliding window: rows' ranges start apart
        (4, 1, [3] * 9, [9, 31, 77, 120, 200, 64, 83, 157, 3], 0, 32),  # MQA, many tiles
        (16, 2, [5, 70], [300, 70], 0, 128),  # 8 query heads per KV head, head_dim 128
        (4, 2, [300], [1100], 0, 16),  # long: the tiles shrink to fit the score buffer
        (4, 2, [6, 1], [100, 40], 0, 36),  # a head size the blocks do not take: paged_attention
    ],
)
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vector"])
def test_prefill_attention_matches_reference(amx, dtype, heads, kv_heads, rows, lens, window, d):
    """The prefill kernel (unquantized cache): scattered block tables, contexts that end
    mid-block, rows after cached context, GQA / MHA / MQA, windows, tiles of several sizes;
    a bf16 cache on AMX's tiles where the CPU has them (amx), and on the vector path."""
    torch.manual_seed(0)
    q, kv, _, tables, seq, ctx = _paged_case(dtype, 0, heads, kv_heads, rows, lens, nb=200, d=d)
    want = kernels.paged_attention_ref(q, *kv, None, None, tables, seq, ctx, 0.17, window)
    got = ops.prefill_attention(q, *kv, tables, seq, ctx, 0.17, window, amx)
    torch.testing.assert_close(got, want, **_tol(dtype))
    # q as a row slice of a wider tensor (the fused qkv projection's output)
    wide = torch.cat([q, torch.randn(len(ctx), 2, q.shape[2], dtype=dtype)], dim=1)
    sliced = ops.prefill_attention(wide[:, :heads], *kv, tables, seq, ctx, 0.17, window, amx)
    assert torch.equal(sliced, got)


@needs_native
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 32), (12, 4, 64), (6, 6, 16)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "vector"])
def test_prefill_attention_row_is_independent_of_its_batch(amx, dtype, heads, kv_heads, d, window):
    """A prefill row computed alone, in another tile or with another thread count gives the
    same bits: a chunked prefill writes the unchunked one's K/V."""
    torch.manual_seed(0)
    q, kv, _, tables, seq, ctx = _paged_case(
        dtype, 0, heads, kv_heads, [90, 1, 130], [300, 7, 600], d=d
    )

    def run(q, tables, seq, ctx):
        return ops.prefill_attention(q, *kv, tables, seq, ctx, 0.17, window, amx)

    batch = _assert_rows_independent(run, q, tables, seq, ctx)
    # the second half of the last sequence's rows as a chunk of their own
    half = len(ctx) - 65
    assert torch.equal(run(q[half:], tables[2:], seq[half:] * 0, ctx[half:]), batch[half:])


@needs_native
def test_bad_inputs_raise_not_crash():
    q = torch.randn(2, 4, 16)
    kc = torch.randn(10, 4, 2, 16)
    ones = torch.ones(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="int64"):
        ops.paged_attention(
            q, kc, kc, None, None, torch.zeros(2, 3, dtype=torch.int32), ones, ones, 1.0, 0, 0
        )
    with pytest.raises(RuntimeError, match="scale_zero"):
        codes = torch.zeros(10, 4, 2, 8, dtype=torch.uint8)
        ops.paged_attention(
            q, codes, codes, None, None, torch.zeros(2, 3, dtype=torch.long), ones, ones, 1.0, 0, 4
        )
    with pytest.raises(RuntimeError, match="cache dtype must equal"):
        ops.prefill_attention(
            q, kc.bfloat16(), kc.bfloat16(), torch.zeros(2, 3, dtype=torch.long), ones, ones, 1.0, 0
        )
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        ops.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1)


def test_entry_points_fall_back_to_the_references(monkeypatch):
    """Unsupported inputs (float64, non-contiguous) and a missing build take the references."""
    x = torch.randn(3, 32, dtype=torch.float64)
    w = torch.randn(32, dtype=torch.float64)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), kernels.rms_norm_ref(x, w, 1e-6))
    wide = torch.randn(3, 64)
    assert torch.equal(kernels.silu_and_mul(wide[:, ::2]), kernels.silu_and_mul_ref(wide[:, ::2]))
    monkeypatch.setitem(kernels._state, "ops", None)
    y = torch.randn(3, 32)
    out, res = kernels.fused_add_rms_norm(y, y.clone(), torch.ones(32), 1e-6)
    assert torch.equal(res, y + y)
    assert kernels.native_decode_attention(torch.float32, torch.device("cpu")) is None
    assert kernels.native_paged_attention(torch.float32, torch.device("cpu")) is None


def test_cpu_kernels_setting_is_validated(monkeypatch):
    from steadylm import platform

    monkeypatch.setenv("STEADYLM_CPU_KERNELS", "fast")
    with pytest.raises(ConfigError, match="STEADYLM_CPU_KERNELS"):
        platform.cpu_kernels()


@needs_native
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_greedy_matches_transformers_with_kernels_on_and_off(arch, model_dirs, monkeypatch):
    """Batched decode of prompts of different lengths (mistral: past its sliding window)."""
    hf, path = model_dirs(arch)
    prompts = [[3, 17, 42, 5, 88, 61, 9, 23], [7, 7, 31], list(range(5, 35))]
    want = [hf_greedy(hf, p, 20) for p in prompts]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for native in (ops, None):
        monkeypatch.setitem(kernels._state, "ops", native)
        engine = engine_for(path)
        got = [r.output_token_ids for r in engine.generate(prompts, params)]
        assert got == want, f"kernels {'native' if native else 'torch'}"


@needs_native
def test_short_prefills_take_the_prefill_kernel(model_dirs, monkeypatch):
    """An unquantized cache's prefill runs the native prefill kernel while its contexts are
    at most SHORT_PREFILL_CONTEXT tokens, SDPA past that; greedy output matches transformers
    either way."""
    from steadylm.attention import torch_ref

    hf, path = model_dirs("llama")
    prompts = [[3, 17, 42, 5, 88, 61, 9, 23], list(range(5, 35))]
    want = [hf_greedy(hf, p, 12) for p in prompts]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    rows_seen = []

    def counting(dtype, device):
        def run(q, *args):
            rows_seen.append(q.shape[0])
            return ops.prefill_attention(q, *args)

        return run

    monkeypatch.setattr(kernels, "native_prefill_attention", counting)
    for limit, native in ((0, False), (29, False), (30, True)):  # the longest prompt: 30
        monkeypatch.setattr(torch_ref, "SHORT_PREFILL_CONTEXT", limit)
        rows_seen.clear()
        got = [r.output_token_ids for r in engine_for(path).generate(prompts, params)]
        assert got == want, limit
        assert (38 in rows_seen) == native, (limit, rows_seen)  # both prompts, one step


@needs_native
@pytest.mark.parametrize("amx", [False, True])
def test_bf16_prefills_on_amx_have_their_own_limit(amx, model_dirs, monkeypatch):
    """Where the CPU has AMX a bf16 cache's prefills take the prefill kernel (its products on
    AMX's tiles) up to AMX_BF16_PREFILL_CONTEXT tokens, SDPA past it; an fp32 cache there, and
    either dtype without AMX, keep SHORT_PREFILL_CONTEXT."""
    from steadylm import platform
    from steadylm.attention import torch_ref

    _, path = model_dirs("llama")
    monkeypatch.setattr(platform, "cpu_has_amx_bf16", lambda: amx)
    monkeypatch.setattr(torch_ref, "AMX_BF16_PREFILL_CONTEXT", 29)  # the prompt: 30 tokens
    rows_seen = []

    def counting(dtype, device):
        def run(q, *args):
            rows_seen.append((q.dtype, q.shape[0]))
            return ops.prefill_attention(q, *args)

        return run

    monkeypatch.setattr(kernels, "native_prefill_attention", counting)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        rows_seen.clear()
        engine_for(path, dtype=dtype).generate([list(range(5, 35))], params)
        prefill = [r for r in rows_seen if r[1] == 30]  # the prompt's rows, one step
        assert bool(prefill) == (dtype == "float32" or not amx), (dtype, rows_seen)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_long_prefill_chunk_after_context_splits_its_attention(arch, model_dirs, monkeypatch):
    """A chunk of at least SPLIT_PREFIX_MIN_QUERY rows after cached context attends to the
    context unmasked and to its own keys causally, merged by log-sum-exp: greedy output
    matches transformers, and the split ran."""
    from steadylm.attention import torch_ref

    hf, path = model_dirs(arch)
    prompt = list(range(5, 45))  # chunks of 12: 12, 12, 12, 4 rows
    want = hf_greedy(hf, prompt, 10)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    splits = []
    real = torch_ref._prefix_then_causal
    monkeypatch.setattr(
        torch_ref,
        "_prefix_then_causal",
        lambda q, k, v, prefix, scale: (
            splits.append((q.shape[1], prefix)) or real(q, k, v, prefix, scale)
        ),
    )
    monkeypatch.setattr(torch_ref, "SHORT_PREFILL_CONTEXT", 0)  # SDPA for every prefill
    monkeypatch.setattr(torch_ref, "SPLIT_PREFIX_MIN_QUERY", 8)
    engine = engine_for(path, max_prefill_token_num=12)
    assert engine.generate([prompt], params)[0].output_token_ids == want
    layers = engine.model_config.num_layers
    assert splits == [(12, 12)] * layers + [(12, 24)] * layers  # not the first, not the 4-row tail


def test_a_failed_build_falls_back_with_the_reason(monkeypatch, caplog):
    """No compiler (or any build error): the engine keeps running on the references and the
    log says why, instead of failing to start."""
    import torch.utils.cpp_extension as cpp

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'steadylm_cpu_ops': g++ not found")

    monkeypatch.setattr(cpp, "load", broken)
    monkeypatch.setattr(kernels, "_state", {})
    with caplog.at_level("WARNING", logger="steadylm.kernels"):
        assert kernels.native_ops() is None
    assert "g++ not found" in kernels.status()
    assert "pure-torch references" in caplog.text
    x, w = torch.randn(2, 16), torch.randn(16)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), kernels.rms_norm_ref(x, w, 1e-6))


def test_each_torch_installation_and_checkout_gets_its_own_build(monkeypatch, tmp_path):
    """Two virtual environments, or two checkouts of the same code, share torch's extension
    directory; their build commands differ (include paths, the source's path), so one shared
    build would be rebuilt alternately on every start."""
    import shutil

    from steadylm import kernels

    here = kernels._build_name()
    assert kernels._build_name() == here  # stable within one installation
    copy = shutil.copy(kernels._SOURCE, tmp_path / "cpu_ops.cpp")  # the same bytes elsewhere
    monkeypatch.setattr(kernels, "_SOURCE", str(copy))
    assert kernels._build_name() != here
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/site-packages/torch/__init__.py")
    assert kernels._build_name() != here
