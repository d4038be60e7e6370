"""Dense linear kernels: the oneDNN prepacked path against F.linear, and what loading keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from steadylm import kernels, platform
from steadylm.engine.request import SamplingParams
from steadylm.layers.linear import Linear, OneDNNDenseKernel
from steadylm.loader import model_weight_bytes
from tests.conftest import engine_for, hf_greedy

needs_onednn = pytest.mark.skipif(
    not OneDNNDenseKernel.supports(torch.empty(1, 1)), reason="no oneDNN in this torch build"
)


def _skip_without_onednn(dtype: torch.dtype) -> None:
    if not OneDNNDenseKernel.supports(torch.empty(1, 1, dtype=dtype)):
        pytest.skip(f"oneDNN cannot prepack {dtype} on this CPU (bf16 needs AVX512BW/VL/DQ)")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 100])
def test_onednn_kernel_matches_f_linear(dtype, m):
    _skip_without_onednn(dtype)
    torch.manual_seed(0)
    w, b = torch.randn(96, 80, dtype=dtype), torch.randn(96, dtype=dtype)
    x = torch.randn(2, m, 80, dtype=dtype)  # 3-D: the kernel flattens leading dims
    kernel = OneDNNDenseKernel(w, b)
    ref = F.linear(x.double(), w.double(), b.double())
    tol = 1e-4 if dtype == torch.float32 else 0.3
    torch.testing.assert_close(kernel.apply(x).double(), ref, rtol=tol, atol=tol)
    # a non-contiguous input (a column slice of a fused projection) gives the same result
    wide = torch.randn(m, 160, dtype=dtype)
    torch.testing.assert_close(kernel.apply(wide[:, :80]), kernel.apply(wide[:, :80].clone()))


@needs_onednn
def test_linear_swaps_its_weight_for_the_packed_copy():
    lin = Linear(80, 96, bias=True)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    x = torch.randn(5, 80)
    before = lin(x)
    lin.process_weights_after_loading()
    assert isinstance(lin.kernel, OneDNNDenseKernel)
    assert lin.weight is None and lin.bias is None  # no second dense copy stays resident
    torch.testing.assert_close(lin(x), before, rtol=1e-4, atol=1e-4)
    assert lin.kernel.num_bytes() >= (96 * 80 + 96) * 4


@needs_onednn
def test_tied_lm_head_keeps_the_shared_embedding(model_dirs):
    _, path = model_dirs("llama")  # tie_word_embeddings=True
    engine = engine_for(path)
    model = engine.runner.model
    assert model.lm_head.kernel is None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.model.layers[0].mlp.down_proj.kernel, OneDNNDenseKernel)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_head_of_gemv_shapes_shares_one_packed_copy(dtype, tmp_path):
    """With GEMV shapes (vocab and hidden multiples of 64) the tied head gets the packed
    kernel and the embedding reads its rows back out of the same buffer: bit for bit the
    checkpoint's rows, one copy of the matrix, and greedy tokens as transformers (fp32)."""
    from steadylm.config import ModelConfig
    from steadylm.loader import load_model
    from tests.conftest import GEMV_SIZES, make_hf_model

    if dtype == torch.bfloat16 and not platform.cpu_onednn_bf16():
        pytest.skip("oneDNN has no bf16 matmul on this CPU")
    hf = make_hf_model("llama", vocab_size=256, **GEMV_SIZES)  # tied
    hf.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), ModelConfig.from_path(str(tmp_path)), dtype, "cpu")
    kernel = model.lm_head.kernel
    if kernel is None:
        pytest.skip("oneDNN's packed layout here is not one packed_linear reads")
    assert isinstance(kernel, OneDNNDenseKernel) and model.lm_head.weight is None
    assert not hasattr(model.model.embed_tokens, "weight")  # one copy: the packed one
    ids = torch.tensor([0, 1, 63, 64, 100, 255, 5, 5])
    want = hf.model.embed_tokens.weight.detach().to(dtype)[ids]
    assert torch.equal(model.model.embed_tokens(ids), want)
    size = torch.tensor([], dtype=dtype).element_size()
    assert kernel.num_bytes() == hf.model.embed_tokens.weight.numel() * size
    # the checkpoint's bytes, the tied matrix counted once
    assert model_weight_bytes(model) == sum(p.numel() for p in hf.parameters()) * size
    if dtype == torch.float32:
        prompt = [3, 17, 42, 5, 88, 61, 9, 23]
        engine = engine_for(str(tmp_path))
        got = engine.generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True))
        assert got[0].output_token_ids == hf_greedy(hf, prompt, 16)


@needs_onednn
@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_both_gemm_paths_match_transformers(arch, model_dirs, monkeypatch):
    hf, path = model_dirs(arch)
    prompt = [3, 17, 42, 5, 88, 61, 9, 23]
    want = hf_greedy(hf, prompt, 24)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    sizes = {}
    for choice in ("onednn", "torch"):
        monkeypatch.setenv("STEADYLM_CPU_GEMM", choice)
        engine = engine_for(path)
        kernel = engine.runner.model.model.layers[0].self_attn.qkv_proj.kernel
        assert (kernel is not None) == (choice == "onednn")
        assert engine.generate([prompt], params)[0].output_token_ids == want
        sizes[choice] = model_weight_bytes(engine.runner.model)
    assert sizes["onednn"] == sizes["torch"]  # the plan's weight bytes hold for both


# ---- the small-batch GEMV over oneDNN's packed buffer (kernels.packed_linear) -------------
def _gemv_kernel(w, b):
    kernel = OneDNNDenseKernel(w, b)
    if kernel.gemv_address is None:
        pytest.skip(
            f"oneDNN's packed layout for {tuple(w.shape)} {w.dtype} on this CPU is not one "
            f"packed_linear reads (native kernels: {kernels.status()})"
        )
    return kernel


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
# (1280, 768): 20 column blocks, K in whole chunks (32 KiB: 128 fp32 steps, 256 bf16 ones);
# (192, 2016): 3 blocks (one thread's next chunk is another block's), K in chunks whose last
# is short in both dtypes
@pytest.mark.parametrize("n,k", [(1280, 768), (192, 2016)])
def test_packed_gemv_matches_onednn_at_every_small_batch(dtype, bias, n, k):
    _skip_without_onednn(dtype)
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    kernel = _gemv_kernel(w, b)
    assert kernel.apply(torch.empty(0, k, dtype=dtype)).shape == (0, n)  # no rows: oneDNN
    # the GEMV's: 64 with AVX-512, 4 with AVX2; for bf16 in 32-column blocks (where oneDNN
    # runs AMX) 16 through AMX's tiles, else 6 (AMX's matmul wins above)
    gemv = kernels.packed_linear_max_rows(kernel.gemv_address, k)
    assert kernel.gemv_max_rows == kernels.packed_linear_max_rows(kernel.gemv_address, k, dtype)
    assert kernel.gemv_max_rows >= gemv >= 2
    # the last row count is oneDNN's, or (fp32 on AVX-512) the blocked GEMM's
    for m in range(1, gemv + 2):
        x = torch.randn(m, k, dtype=dtype)
        got = kernel.apply(x)
        onednn = torch.ops.mkldnn._linear_pointwise(x, kernel.weight, b, "none", [], "")
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=0.02, atol=0.5)
        torch.testing.assert_close(got.double(), ref, **tol)
        if dtype == torch.bfloat16:  # same products, fp32 sums, one rounding: at most 1 ulp
            assert (
                got.float() - onednn.float()
            ).abs().max() <= 2 * onednn.float().abs().max() / 128
        else:
            torch.testing.assert_close(got, onednn, rtol=1e-4, atol=1e-3)
        if m <= kernel.gemv_max_rows:  # a row's bits do not depend on the rows beside it
            alone = torch.cat([kernel.apply(x[i : i + 1]) for i in range(m)])
            assert torch.equal(got, alone), m


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
# (1280, 768): 10 groups of two 64-column blocks, K in one pass; (192, 2016): a group of one
# block after a whole one, K in two passes (the partial sums wait in the output)
@pytest.mark.parametrize("n,k", [(1280, 768), (192, 2016)])
def test_blocked_gemm_is_the_gemv_bit_for_bit_at_prefill_sizes(bias, n, k, monkeypatch):
    """fp32 past the GEMV's rows (AVX-512): the blocked GEMM, each output the GEMV's chain of
    FMAs, so a row's bits are the same alone or in any batch, and close to oneDNN's; with
    STEADYLM_CPU_PREFILL_GEMM=onednn the layer keeps oneDNN's matmul there."""
    torch.manual_seed(0)
    w = torch.randn(n, k)
    b = torch.randn(n) if bias else None
    kernel = _gemv_kernel(w, b)
    gemv = kernels.packed_linear_max_rows(kernel.gemv_address, k)
    ops = kernels.native_ops()
    if kernel.gemv_max_rows == gemv or not ops.packed_linear_blocked():
        pytest.skip(f"no blocked fp32 GEMM in this build (native kernels: {kernels.status()})")
    assert kernel.gemv_max_rows == kernels.UNBOUNDED_ROWS
    for m in (gemv + 1, 300, 517):  # the GEMV's, then the blocked GEMM's (tiles of 6 and 5)
        x = torch.randn(m, k)
        got = kernel.apply(x)
        alone = torch.cat([kernel.apply(x[i : i + 1]) for i in range(m)])
        assert torch.equal(got, alone), m
        onednn = torch.ops.mkldnn._linear_pointwise(x, kernel.weight, b, "none", [], "")
        torch.testing.assert_close(got, onednn, rtol=1e-4, atol=1e-3)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-3)
    monkeypatch.setenv("STEADYLM_CPU_PREFILL_GEMM", "onednn")
    assert OneDNNDenseKernel(w, b).gemv_max_rows == gemv


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(1280, 768), (192, 2016)])
def test_packed_gemv_reads_bf16_in_64_and_32_column_blocks(bias, n, k):
    """oneDNN packs bf16 weights in 64-column blocks with AVX512-BF16 and in 32-column blocks
    where it runs AMX; the GEMV reads both (the second from a tagged address), with the same
    bits, at every batch it takes. Built here by hand, so any AVX512-BF16 machine runs both."""
    ops = kernels.native_ops()
    if ops is None or "bf16" not in ops.packed_linear_layouts().split(","):
        pytest.skip(f"no bf16 GEMV in this build (native kernels: {kernels.status()})")
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    bits = w.view(torch.int16)
    by64 = bits.view(n // 64, 64, k // 2, 2).transpose(1, 2).contiguous()
    by32 = bits.view(n // 32, 32, k // 2, 2).transpose(1, 2).contiguous()
    for m in (1, 2, 5, 16, 17, kernels.packed_linear_max_rows()):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        y64 = ops.packed_linear(x, by64.data_ptr(), n, b)
        y32 = ops.packed_linear(x, kernels.tag_layout32(by32.data_ptr()), n, b)
        assert torch.equal(y32, y64), m
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(y32.double(), ref, rtol=0.02, atol=0.5)
    with pytest.raises(RuntimeError, match="bf16 layout"):
        ops.packed_linear(x.float(), kernels.tag_layout32(by32.data_ptr()), n, None)


def _amx_rows_or_skip(k: int) -> int:
    ops = kernels.native_ops()
    rows = 0 if ops is None else int(ops.packed_linear_amx_rows(k))
    if not rows:
        pytest.skip(
            f"no AMX GEMV here (AMX tiles need an Intel Xeon 4th gen on; kernels: "
            f"{kernels.status()})"
        )
    return rows


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(1280, 768), (192, 2016)])
def test_the_amx_gemv_keeps_each_row_s_bits_and_the_vector_gemv_s_values(bias, n, k):
    """bf16 in 32-column blocks through AMX's tiles (up to 16 rows): a row's result does not
    depend on the rows beside it, and it is the vector GEMV's (vdpbf16ps) to one bf16 ulp:
    the tile unit sums the same products in its own order (they differ in ~1 output of
    2,000)."""
    rows = _amx_rows_or_skip(k)
    ops = kernels.native_ops()
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    by32 = w.view(torch.int16).view(n // 32, 32, k // 2, 2).transpose(1, 2).contiguous()
    vector = kernels.tag_layout32(by32.data_ptr())
    amx = vector | kernels.AMX
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    for m in range(1, rows + 1):
        got = ops.packed_linear(x[:m], amx, n, b)
        alone = torch.cat([ops.packed_linear(x[i : i + 1], amx, n, b) for i in range(m)])
        assert torch.equal(got, alone), m
        vec = ops.packed_linear(x[:m], vector, n, b)
        ulp = 2.0 ** (torch.floor(torch.log2(vec.float().abs().clamp_min(1e-30))) - 7)
        # (+ 1e-3: a result near zero is a cancellation, whose fp32 sums differ by their
        # rounding, ~2^-24 of the products' magnitude, not by the result's ulp)
        assert ((got.float() - vec.float()).abs() <= ulp + 1e-3).all(), m
        torch.testing.assert_close(got.double(), ref[:m], rtol=0.02, atol=0.5)


@needs_onednn
def test_bf16_linears_take_the_amx_gemv_up_to_16_rows_unless_switched_off(monkeypatch):
    """Where oneDNN packs bf16 in AMX's 32-column blocks, a layer whose K is whole A tiles
    (32) is tagged for the AMX GEMV and takes it up to 16 rows;
    STEADYLM_CPU_AMX_GEMV=off keeps the vector GEMV (6 rows); a mistagged call is refused."""
    _skip_without_onednn(torch.bfloat16)
    _amx_rows_or_skip(768)
    torch.manual_seed(0)
    kernel = OneDNNDenseKernel(torch.randn(256, 768, dtype=torch.bfloat16), None)
    if not kernel.gemv_address or not kernel.gemv_address & kernels.LAYOUT32:
        pytest.skip("oneDNN packed this bf16 weight in 64-column blocks here, not AMX's")
    assert kernel.gemv_address & kernels.AMX and kernel.gemv_max_rows == 16
    # K = 784 (784 % 32 = 16): oneDNN pads such a K, so the GEMV never sees it; by hand
    odd = torch.zeros(256 // 32, 784 // 2, 32, 2, dtype=torch.int16)
    with pytest.raises(RuntimeError, match="AMX tiles take"):
        kernels.native_ops().packed_linear(
            torch.randn(2, 784, dtype=torch.bfloat16),
            kernels.tag_layout32(odd.data_ptr()) | kernels.AMX,
            256,
            None,
        )
    monkeypatch.setenv("STEADYLM_CPU_AMX_GEMV", "off")
    off = OneDNNDenseKernel(torch.randn(256, 768, dtype=torch.bfloat16), None)
    assert not off.gemv_address & kernels.AMX and off.gemv_max_rows == kernels.LAYOUT32_MAX_ROWS


@needs_onednn
def test_packed_gemv_reads_the_layer_s_own_weight():
    """The layout check is against the weight that was packed: another weight's buffer, or a
    shape the kernel does not cover (N % 64), keeps oneDNN's matmul for every batch."""
    torch.manual_seed(0)
    w = torch.randn(256, 128)
    kernel = _gemv_kernel(w, None)
    ops = kernels.native_ops()
    with pytest.raises(RuntimeError, match="no rows"):  # a caller's bug, not a crash
        ops.packed_linear(torch.randn(0, 128), kernel.gemv_address, 256, None)
    with pytest.raises(RuntimeError, match="N % 64"):
        ops.packed_linear(torch.randn(1, 128), kernel.gemv_address, 200, None)
    other = torch.ops.mkldnn._reorder_linear_weight(torch.randn(256, 128))
    assert kernels.packed_linear_address(w, other) is None
    odd = torch.randn(100, 128)
    assert OneDNNDenseKernel(odd, None).gemv_address is None
    assert kernels.packed_linear_address(w, w) is None  # a plain tensor is not oneDNN's buffer


@needs_onednn
@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_greedy_matches_transformers_through_the_packed_gemv(arch, monkeypatch, tmp_path):
    """Shapes the GEMV takes (every N % 64 == 0): decode batches and prefills of up to
    `packed_linear_max_rows()` tokens run it, the 6 prompts' prefill (87 tokens) runs oneDNN,
    or on AVX-512 the blocked GEMM; greedy tokens equal transformers' in every case."""
    from tests.conftest import make_hf_model

    hf = make_hf_model(arch, hidden_size=64, intermediate_size=128, vocab_size=128)
    hf.save_pretrained(tmp_path)
    engine = engine_for(str(tmp_path))
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj.kernel
    if qkv.gemv_address is None:
        pytest.skip(
            f"oneDNN's packed layout here is not one packed_linear reads: {kernels.status()}"
        )
    calls = []
    real = kernels.packed_linear
    monkeypatch.setattr(kernels, "packed_linear", lambda *a: calls.append(len(a[0])) or real(*a))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [[3, 17, 42, 5, 88, 61, 9, 23], [7, 7, 31], list(range(5, 35)), [9], [4, 4, 4, 4, 4]]
    prompts.append([(7 * i) % 120 + 3 for i in range(40)])
    for group in (prompts[:1], prompts[:3], prompts):
        want = [hf_greedy(hf, p, 12) for p in group]
        got = [r.output_token_ids for r in engine.generate(group, params)]
        assert got == want, len(group)
    assert calls, "the GEMV never ran"
    if qkv.gemv_max_rows > kernels.packed_linear_max_rows():  # fp32, AVX-512
        assert max(calls) > kernels.packed_linear_max_rows(), "the blocked GEMM never ran"


@needs_onednn
def test_onednn_matmul_sees_a_bounded_set_of_row_counts(monkeypatch):
    """oneDNN builds and caches a primitive per distinct shape; row counts are bucketed so a
    step's token count (any value up to max_prefill_token_num) cannot fill its caches."""
    torch.manual_seed(0)
    w = torch.randn(24, 16)
    kernel = OneDNNDenseKernel(w, None)
    seen: set[int] = set()
    op = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        seen.add(x.shape[0])
        return op(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for m in range(5, 1025):
        x = torch.randn(m, 16)
        y = kernel.apply(x)
        assert y.shape == (m, 24)
        if m % 97 == 0:
            torch.testing.assert_close(y, F.linear(x, w), rtol=1e-4, atol=1e-4)
    assert len(seen) <= 12 + 8 * 6  # exact up to 16, then 8 per power of two up to 1024


def test_row_buckets_pad_at_most_an_eighth():
    from steadylm.layers.linear import row_bucket

    assert [row_bucket(m) for m in (0, 1, 16, 17, 33, 100, 1000)] == [0, 1, 16, 18, 36, 104, 1024]
    assert all(m <= row_bucket(m) <= m * 1.125 for m in range(1, 8193))
    assert len({row_bucket(m) for m in range(1, 8193)}) == 16 + 8 * 9


# ---- greedy tokens through the LM head's int8 copy (kernels.screened_argmax) ---------------
def _screen_kernel(w):
    kernel = _gemv_kernel(w, None)
    if not kernel.add_screen(w):
        pytest.skip(
            "no int8 LM head screen on this CPU (it needs AMX's int8 tiles: "
            f"{platform.cpu_has_amx_int8()}; native kernels: {kernels.status()})"
        )
    return kernel


@needs_onednn
@pytest.mark.parametrize(
    "dtype, amx_gemv",
    [(torch.float32, "on"), (torch.bfloat16, "on"), (torch.bfloat16, "off")],
    ids=["float32", "bfloat16", "bfloat16-vector-gemv"],
)
@pytest.mark.parametrize("rows", [1, 5, 16, 37])
def test_screened_greedy_tokens_are_the_full_argmax(dtype, amx_gemv, rows, monkeypatch):
    """The tokens a greedy step takes through the int8 copy are the full logits' argmax, bit
    for bit: rows of w in pairs closer than an int8 step (x along one of them), an exact tie
    (the first index wins). The screen may decline (None: the caller computes the logits) but
    must take most of these steps. A bf16 head's candidates are recomputed 16 columns at a
    time on AMX's tiles, or in whole 64-column blocks by the vector GEMV (its full path with
    STEADYLM_CPU_AMX_GEMV=off)."""
    _skip_without_onednn(dtype)  # an AVX2 CPU has no oneDNN bf16 linear to screen
    monkeypatch.setenv("STEADYLM_CPU_AMX_GEMV", amx_gemv)
    torch.manual_seed(0)
    v, k = 4096, 128  # 64 blocks of 64: 16 rows' candidates stay under half of them
    w = torch.randn(v, k) * 0.05
    w[1::2] = w[0::2] + 1e-4 * torch.randn(v // 2, k)  # near twins
    # an exact tie: 300 must win (3000 lies in another thread's share of the screen, whose
    # candidates may reach the merge first)
    w[3000] = w[300]
    w = w.to(dtype)
    kernel = _screen_kernel(w)
    if amx_gemv == "off":
        assert not kernel.gemv_address & kernels.AMX
    if rows > kernel.gemv_max_rows:
        pytest.skip(f"the GEMV takes {kernel.gemv_max_rows} rows here (oneDNN above)")
    screened = 0
    for trial in range(30):
        # each row along a row of w (its twin within an int8 step of it), some noise
        near = torch.randint(0, v, (rows,))
        near[0] = (2 * trial + trial % 2) % v
        x = w[near].float() * (5 + trial) + 0.1 * torch.randn(rows, k)
        if trial % 3 == 0:
            x[-1] = w[300].float() * 10
        x = x.to(dtype)
        want = kernels.argmax(kernel.apply(x)).tolist()
        got = kernels.screened_argmax(
            x, kernel.screen_codes, kernel.screen_stats, kernel.gemv_address
        )
        if got is not None:
            screened += 1
            assert got == want, trial
            if trial % 3 == 0:
                assert got[-1] == 300
    assert screened >= 20, screened


@needs_onednn
def test_screen_declines_what_it_cannot_bound():
    """A row that is not finite, or more rows than the screen takes: None (the full head)."""
    torch.manual_seed(0)
    w = torch.randn(256, 64) * 0.05
    kernel = _screen_kernel(w)
    x = torch.randn(2, 64)
    assert kernel.greedy_tokens(x) == kernels.argmax(kernel.apply(x)).tolist()
    x[1, 3] = float("inf")
    assert kernel.greedy_tokens(x) is None
    assert kernel.greedy_tokens(torch.randn(kernels.SCREEN_MAX_ROWS + 1, 64)) is None


@needs_onednn
def test_greedy_steps_take_the_screen_and_match_transformers(tmp_path, monkeypatch):
    """An untied LM head the screen takes: greedy output equals transformers' with the screen
    on (and it served steps) and off (no copy kept)."""
    from tests.conftest import GEMV_SIZES, make_hf_model

    hf = make_hf_model("qwen2", vocab_size=256, **GEMV_SIZES)
    hf.save_pretrained(tmp_path)
    prompts = [[3, 17, 42, 5, 88, 61, 9, 23], [7, 7, 1, 200, 13]]
    want = [hf_greedy(hf, p, 16) for p in prompts]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    real = kernels.screened_argmax
    for switch in ("on", "off"):
        monkeypatch.setenv("STEADYLM_CPU_LM_HEAD_SCREEN", switch)
        engine = engine_for(str(tmp_path))
        head = engine.runner.model.lm_head
        if switch == "on" and getattr(head.kernel, "screen_codes", None) is None:
            pytest.skip("no int8 LM head screen on this CPU (it needs AMX's int8 tiles)")
        served = []

        def spy(*a, served=served):
            out = real(*a)
            served.append(out is not None)
            return out

        monkeypatch.setattr(kernels, "screened_argmax", spy)
        got = [o.output_token_ids for o in engine.generate(prompts, params)]
        assert got == want, switch
        if switch == "on":
            assert sum(served) >= 8, served
        else:
            assert served == [] and getattr(head.kernel, "screen_codes", None) is None


@needs_onednn
def test_screened_fp32_tokens_follow_the_full_paths_roundings():
    """Two rows of w equal up to swapping pairs of columns, with x equal across each pair:
    their logits are equal in exact arithmetic and differ only in the fp32 sums' rounding, so
    the token is whichever the full path's order of FMAs rounds higher (the first on a tie);
    the screen's recomputation must round the same way."""
    torch.manual_seed(0)
    v, k = 512, 128
    w = torch.randn(v, k) * 0.05
    swapped = w.view(v, k // 2, 2).flip(-1).reshape(v, k)
    w[1::2] = swapped[0::2]  # row 2i + 1: row 2i with each column pair swapped
    kernel = _screen_kernel(w)
    differs = 0
    for trial in range(60):
        a = 2 * trial % v
        x = ((w[a] + w[a + 1]) / 2 * (3 + trial % 7)).view(k // 2, 2).mean(-1)
        x = x.repeat_interleave(2)[None]  # equal across each pair
        logits = kernel.apply(x)
        differs += bool(logits[0, a] != logits[0, a + 1])
        got = kernel.greedy_tokens(x)
        assert got is not None
        assert got == kernels.argmax(logits).tolist(), trial
    assert differs >= 10, differs  # the case tells the sums' orders apart
