"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers (fp32, CPU):
prefill logits and greedy tokens under batching, chunked prefill, preemption, prefix caching
and int8 / int4 KV; the routing rule; the config's sparse layers; the plan's bytes and counts."""

from __future__ import annotations

import json
import re

import pytest
import torch

from steadylm.config import ModelConfig
from steadylm.engine.request import SamplingParams
from steadylm.layers import moe
from steadylm.loader import model_weight_bytes
from steadylm.memory import parameter_counts, weight_bytes_from_config
from tests.conftest import MOE_ARCHS, engine_for, hf_greedy, make_hf_model, run_to_end
from tests.models.test_parity import PROMPT, engine_logits

PROMPTS = [PROMPT, [7, 7, 8, 1], [50, 60, 70, 80, 90, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_prefill_logits_match_transformers(arch, model_dirs):
    hf, path = model_dirs(arch)
    ours = engine_logits(engine_for(path), PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_batched_chunked_greedy_matches_transformers(arch, model_dirs):
    """Three prompts in one batch, prefilled in 5-token chunks: each row routes alone."""
    hf, path = model_dirs(arch)
    engine = engine_for(path, max_prefill_token_num=5)
    reqs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [r.output_token_ids for r in reqs] == [hf_greedy(hf, p, 24) for p in PROMPTS]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_preemption_and_prefix_caching_keep_the_tokens(arch, model_dirs):
    """A pool too small for the batch (preemption by recompute) and shared prefixes (cache
    hits): the tokens of each request stay transformers'."""
    hf, path = model_dirs(arch)
    shared = PROMPT * 2
    prompts = [shared + [1], shared + [2, 3], PROMPTS[2], shared + [4]]
    engine = engine_for(
        path, num_gpu_blocks=24, enable_prefix_caching=True, max_prefill_token_num=7
    )
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=30, ignore_eos=True))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0
    assert [r.output_token_ids for r in reqs] == [hf_greedy(hf, p, 30) for p in prompts]


@pytest.mark.parametrize("quant_policy", [8, 4])
def test_quantized_kv_cache_is_batch_invariant(quant_policy, model_dirs):
    """int8 / int4 KV (no transformers equivalent): a request's tokens alone equal its tokens
    in a batch with chunked prefill, and stay close to the unquantized run's."""
    _, path = model_dirs("qwen3_moe")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    alone = [
        engine_for(path, quant_policy=quant_policy).generate([p], params)[0].output_token_ids
        for p in PROMPTS
    ]
    engine = engine_for(path, quant_policy=quant_policy, max_prefill_token_num=5)
    batched = [r.output_token_ids for r in engine.generate(PROMPTS, params)]
    assert batched == alone
    plain = engine_for(path).generate([PROMPT], params)[0].output_token_ids
    if quant_policy == 8:  # 8-bit codes of random weights: the same greedy tokens
        assert alone[0] == plain


def test_routing_follows_transformers():
    """Softmax in fp32, top k, renormalised where asked; Mixtral keeps fp32 weights."""
    logits = torch.randn(5, 8, dtype=torch.bfloat16)
    w, ids = moe.select_experts(logits, 2, renormalize=True)
    probs = torch.softmax(logits.float(), -1)
    ref_w, ref_ids = probs.topk(2, -1)
    assert torch.equal(ids, ref_ids)
    assert w.dtype == torch.bfloat16
    torch.testing.assert_close(w, (ref_w / ref_w.sum(-1, keepdim=True)).bfloat16())
    w, _ = moe.select_experts(logits, 2, renormalize=False, weights_fp32=True)
    assert w.dtype == torch.float32 and torch.equal(w, ref_w)


def test_experts_no_token_chose_are_skipped(monkeypatch):
    """The reference runs only the experts some token routed to, each once."""
    calls: list[int] = []

    class Expert(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i

        def forward(self, x):
            calls.append(self.i)
            return x * (self.i + 1)

    experts = torch.nn.ModuleList(Expert(i) for i in range(6))
    x = torch.randn(4, 3)
    ids = torch.tensor([[1, 4], [4, 1], [1, 0], [4, 1]])
    w = torch.rand(4, 2)
    out = moe.experts_reference(x, w, ids, experts)
    assert calls == [0, 1, 4]
    ref = torch.stack([sum(w[t, j] * x[t] * (ids[t, j] + 1) for j in range(2)) for t in range(4)])
    torch.testing.assert_close(out, ref)


def test_sparse_layers_follow_the_config():
    """Qwen's decoder_sparse_step and mlp_only_layers pick the sparse layers; Mixtral's are all."""
    import transformers as tf

    hf = tf.Qwen3MoeConfig(
        num_hidden_layers=6, num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3]
    )
    hf.architectures = ["Qwen3MoeForCausalLM"]
    mc = ModelConfig.from_hf(hf)
    assert mc.moe_layers == (1, 5) and mc.num_experts == 4 and mc.qk_norm
    hf = tf.MixtralConfig(num_hidden_layers=3)
    hf.architectures = ["MixtralForCausalLM"]
    mc = ModelConfig.from_hf(hf)
    assert mc.moe_layers == (0, 1, 2) and mc.norm_topk_prob
    assert mc.moe_intermediate_size == hf.intermediate_size


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_weight_bytes_equal_the_loaded_model(arch, model_dirs):
    """The plan's bytes (from the config alone) are the bytes the loaded model holds, and the
    parameter counts are the checkpoint's."""
    hf, path = model_dirs(arch)
    engine = engine_for(path)
    mc = engine.model_config
    assert weight_bytes_from_config(mc, 4) == model_weight_bytes(engine.runner.model)
    total, active = parameter_counts(mc)
    assert total == sum(p.numel() for p in hf.parameters())
    expert = sum(p.numel() for p in hf.model.layers[0].mlp.experts.parameters()) // mc.num_experts
    sparse = len(mc.moe_layers)
    assert total - active == sparse * (mc.num_experts - mc.num_experts_per_tok) * expert


def test_a_dense_layer_of_a_moe_model_is_a_plain_mlp(model_dirs):
    _, path = model_dirs("qwen3_moe")
    layers = engine_for(path).runner.model.model.layers
    assert isinstance(layers[0].mlp, moe.SparseMoeBlock)
    assert not isinstance(layers[1].mlp, moe.SparseMoeBlock)  # mlp_only_layers=[1]


def test_bf16_runs_close_to_fp32(model_dirs):
    hf, path = model_dirs("qwen2_moe")
    ours = engine_logits(engine_for(path, dtype="bfloat16"), PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from steadylm.errors import ModelLoadError

    hf = make_hf_model("mixtral")
    hf.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts\.5\.gate_up_proj"):
        engine_for(str(tmp_path))


def test_engine_runs_to_end_with_sampling(model_dirs):
    _, path = model_dirs("mixtral")
    engine = engine_for(path)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(max_new_tokens=12, temperature=0.8, seed=i))
    run_to_end(engine)


_QUANTIZED = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)


def save_awq_moe(arch: str, tmp_path, group: int = 64):
    """An AWQ checkpoint of a tiny MoE model: every linear (attention, each expert's, a dense
    layer's) quantized as benchmarks/make_awq_model.py does, the router left dense. Returns
    (transformers model holding the dequantized weights, checkpoint dir)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tests.conftest import GEMV_SIZES
    from tests.test_awq import awq_config, awq_quantize

    shapes = dict(GEMV_SIZES, vocab_size=256, moe_intermediate_size=64)
    if arch == "mixtral":
        shapes["intermediate_size"] = 64
    dense_dir, deq_dir, awq_dir = (tmp_path / n for n in ("dense", "deq", "awq"))
    make_hf_model(arch, **shapes).save_pretrained(dense_dir)
    deq, awq = {}, {}
    for name, t in load_file(dense_dir / "model.safetensors").items():
        if _QUANTIZED.search(name):
            base = name[: -len(".weight")]
            qw, qz, sc, w = awq_quantize(t, group)
            awq.update({f"{base}.qweight": qw, f"{base}.qzeros": qz, f"{base}.scales": sc})
            deq[name] = w
        else:
            awq[name] = deq[name] = t.half().float()
    for d, tensors in ((deq_dir, deq), (awq_dir, awq)):
        d.mkdir()
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dense_dir / "config.json").read_text())
    (deq_dir / "config.json").write_text(json.dumps(cfg))
    cfg["quantization_config"] = awq_config(group)
    (awq_dir / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
    return hf, str(awq_dir)


@pytest.mark.parametrize("kernel", ["reference", "auto"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_awq_moe_checkpoint_matches_dequantized_transformers(arch, kernel, tmp_path, monkeypatch):
    """The experts stay 4-bit and the logits are the dequantized model's (the reference
    kernel exactly; torch's int4 kernel within its bf16 rounding, as the dense AWQ test)."""
    from steadylm.layers.awq import AWQLinear

    monkeypatch.setattr(AWQLinear, "kernel_choice", kernel)
    hf, path = save_awq_moe(arch, tmp_path)
    engine = engine_for(path)
    block = next(m for m in engine.runner.model.modules() if isinstance(m, moe.SparseMoeBlock))
    assert isinstance(block.experts[0].down_proj, AWQLinear)
    if kernel == "auto":  # the plan counts the 4-bit layout held (and the LM head's copy)
        assert model_weight_bytes(engine.runner.model) == engine.plan.weight_bytes
    logits = engine.score(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    err = float((logits - ref).abs().max() / ref.abs().max())
    assert err < (1e-5 if kernel == "reference" else 8e-2), err
    if kernel == "reference":
        out = engine.generate([PROMPT], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
        assert out.output_token_ids == hf_greedy(hf, PROMPT, 16)
