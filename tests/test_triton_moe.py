"""The fused MoE kernel (kernels/triton_moe.py) against the pure-torch oracle, in Triton's
interpreter on the CPU (compiled on a GPU): expert counts 1 to 128, top-k 1 to 8, ragged
token counts with experts no token chose, fp32 and fp16; and a MoE model through it."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import triton_device

DEVICE = triton_device("the fused MoE kernel")

from steadylm.kernels import triton_moe  # noqa: E402
from steadylm.layers import moe  # noqa: E402


def _case(tokens, experts, top_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, i = 32, 48  # I not a multiple of the K block: the masked tail is exercised
    x = torch.randn(tokens, h, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(experts, h, i, generator=g) / i**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g).to(dtype)
    weights, ids = moe.select_experts(logits, top_k, renormalize=True)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "experts,top_k,tokens",
    [(1, 1, 5), (8, 2, 1), (8, 2, 33), (64, 8, 7), (128, 8, 3), (128, 1, 20)],
)
def test_fused_experts_match_the_reference(experts, top_k, tokens, dtype):
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, dtype)
    got = triton_moe.fused_experts(x, w13, w2, weights, ids)
    ref = moe.stacked_experts_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)
    if experts >= 64:  # most experts got no token: their blocks never ran
        assert ids.unique().numel() < experts


def test_alignment_pads_each_expert_run_and_marks_the_end():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    pairs, block_expert = triton_moe.align_by_expert(ids, 5, 4)
    n = ids.numel()
    runs = pairs.view(-1, 4)
    for b, e in enumerate(block_expert.tolist()):
        real = [p for p in runs[b].tolist() if p < n]
        if e == 5:
            assert not real  # past the last run
        else:
            assert real and all(ids.flatten()[p] == e for p in real)
    assert sorted(p for p in pairs.tolist() if p < n) == list(range(n))  # each pair once


def test_moe_model_through_the_fused_kernel_matches_transformers(model_dirs, monkeypatch):
    """A Qwen2-MoE model (shared expert) with the fused kernel forced: greedy as transformers."""
    from steadylm.engine.request import SamplingParams
    from tests.conftest import engine_for, hf_greedy

    monkeypatch.setattr(moe.SparseMoeBlock, "kernel_choice", "triton")
    hf, path = model_dirs("qwen2_moe")
    engine = engine_for(path, max_prefill_token_num=5)
    blocks = [m for m in engine.runner.model.modules() if isinstance(m, moe.SparseMoeBlock)]
    assert blocks and all(b.stacked is not None for b in blocks)
    prompts = [[3, 17, 42, 5, 88, 61, 9], [7, 7, 8, 1]]
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [r.output_token_ids for r in reqs] == [hf_greedy(hf, p, 12) for p in prompts]
