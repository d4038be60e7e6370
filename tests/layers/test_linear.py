"""Dense linear kernels: the oneDNN prepacked path against F.linear, and what loading keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from steadylm.engine.request import SamplingParams
from steadylm.layers.linear import Linear, OneDNNDenseKernel
from steadylm.loader import model_weight_bytes
from tests.conftest import engine_for, hf_greedy

needs_onednn = pytest.mark.skipif(
    not OneDNNDenseKernel.supports(torch.empty(1, 1)), reason="no oneDNN in this torch build"
)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 100])
def test_onednn_kernel_matches_f_linear(dtype, m):
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
