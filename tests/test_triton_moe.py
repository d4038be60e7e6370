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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "experts,top_k,tokens,group", [(8, 2, 1, 32), (8, 2, 33, 64), (64, 8, 5, 128)]
)
def test_fused_awq_experts_match_the_dequantized_reference(experts, top_k, tokens, group, dtype):
    """4-bit experts in AutoAWQ's layout, stacked: the kernel's result is the dense kernel's
    oracle over the dequantized weights."""
    from tests.test_awq import awq_quantize  # (qweight, qzeros, scales, fp32 dequantized)

    g = torch.Generator().manual_seed(1)
    h, i = 128, 64 if group < 128 else 128  # K a multiple of the group for both GEMMs
    x = torch.randn(tokens, h, generator=g).to(dtype)
    dense13 = torch.randn(experts, 2 * i, h, generator=g) / h**0.5
    dense2 = torch.randn(experts, h, i, generator=g) / i**0.5

    def pack(w):  # (E, N, K) -> stacked (qweight, qzeros, scales), dequantized (E, N, K)
        parts = [awq_quantize(w[e], group) for e in range(w.shape[0])]
        stacked = tuple(torch.stack([p[j] for p in parts]).to(DEVICE) for j in range(3))
        deq = torch.stack([p[3] for p in parts])
        return (*stacked, group), deq

    w13, deq13 = pack(dense13)
    w2, deq2 = pack(dense2)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = moe.select_experts(logits, top_k, renormalize=True)
    got = triton_moe.fused_experts(
        x.to(DEVICE), w13, w2, weights.to(dtype).to(DEVICE), ids.to(DEVICE)
    )
    ref = moe.stacked_experts_reference(x.float(), deq13, deq2, weights.to(dtype).float(), ids)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), ref, rtol=tol, atol=tol)


def test_awq_moe_model_through_the_fused_kernel(tmp_path, monkeypatch):
    """An AWQ Qwen3-MoE checkpoint with the fused 4-bit kernel forced: the experts' tensors
    are stacked once (views, no copy) and the tokens are the dequantized model's."""
    from steadylm.layers.awq import AWQLinear
    from tests.models.test_moe import PROMPT, save_awq_moe

    monkeypatch.setattr(moe.SparseMoeBlock, "kernel_choice", "triton")
    monkeypatch.setattr(AWQLinear, "kernel_choice", "triton")
    from steadylm.engine.request import SamplingParams
    from tests.conftest import engine_for, hf_greedy

    hf, path = save_awq_moe("qwen3_moe", tmp_path)
    engine = engine_for(path)
    block = next(m for m in engine.runner.model.modules() if isinstance(m, moe.SparseMoeBlock))
    qweight = block.stacked[0][0]
    assert qweight.dtype == torch.int32 and qweight.shape[0] == 8  # (E, K, 2I / 8)
    assert block.experts[3].gate_up_proj.kernel.qweight.data_ptr() == qweight[3].data_ptr()
    out = engine.generate([PROMPT], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert out.output_token_ids == hf_greedy(hf, PROMPT, 12)
