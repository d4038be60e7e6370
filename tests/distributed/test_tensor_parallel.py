"""Tensor parallelism on CPU with gloo: tp=2 (rank 0 here, one worker process) gives the same
greedy tokens as tp=1 and as transformers, for every architecture and engine feature; each rank
reads only its shard and allocates exactly the plan's bytes; a bad split is a clear error."""

from __future__ import annotations

import os
import re

import pytest
import torch

from steadylm import parallel
from steadylm.config import EngineConfig, ModelConfig
from steadylm.engine.llm_engine import LLMEngine
from steadylm.engine.request import SamplingParams
from steadylm.errors import ConfigError, ModelLoadError
from tests.conftest import MOE_ARCHS, STORIES, engine_for, hf_greedy, make_hf_model, needs_shared

PROMPTS = [
    [3, 17, 42, 5, 88, 61, 9, 23, 11, 70, 2, 33, 45],
    [7, 7, 8, 1],
    [50, 60, 70, 80, 90, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def tp_engine(path: str, **kw) -> LLMEngine:
    return engine_for(path, tp=2, **kw)


def generate(engine: LLMEngine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    try:
        return [r.output_token_ids for r in engine.generate(prompts, params)]
    finally:
        engine.shutdown()


def assert_exact_plan(engine: LLMEngine) -> None:
    """Every rank holds exactly the plan's per-rank weight and KV bytes."""
    reports = engine.runner.rank_reports
    assert [r.rank for r in reports] == [0, 1]
    for r in reports:
        assert r.weight_bytes == engine.plan.weight_bytes, r
        assert r.kv_cache_bytes == engine.plan.kv_cache_bytes, r


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", *MOE_ARCHS])
def test_tp2_greedy_equals_transformers(arch, model_dirs):
    """Chunked prefill (5-token chunks) and a batch of three, as in the tp=1 parity test."""
    hf, path = model_dirs(arch)
    engine = tp_engine(path, max_prefill_token_num=5)
    assert_exact_plan(engine)
    procs = engine.executor.procs
    outs = generate(engine)
    assert outs == [hf_greedy(hf, p, 24) for p in PROMPTS]
    assert all(p.poll() is not None for p in procs), "a worker outlived shutdown"


def test_fewer_kv_heads_than_ranks(tmp_path):
    """One KV head, two ranks: each rank holds a replica of it."""
    hf = make_hf_model("llama", num_key_value_heads=1)
    hf.save_pretrained(tmp_path)
    engine = tp_engine(str(tmp_path))
    assert engine.runner.model.num_kv_heads == 1
    assert generate(engine) == [hf_greedy(hf, p, 24) for p in PROMPTS]


def test_prefix_caching_chunking_and_preemption(model_dirs):
    """A pool too small for the batch forces preemption; shared prefixes hit the cache."""
    hf, path = model_dirs("qwen2")
    shared = PROMPTS[0] * 2
    prompts = [shared + [1], shared + [2, 3], PROMPTS[2], shared + [4]]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    kw = dict(num_gpu_blocks=24, enable_prefix_caching=True, max_prefill_token_num=7)
    engine = tp_engine(path, **kw)
    try:
        reqs = engine.generate(prompts, params)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hit_rate > 0
    assert [r.output_token_ids for r in reqs] == [hf_greedy(hf, p, 30) for p in prompts]


def test_speculative_decoding_at_tp2(model_dirs):
    """Drafts go to the workers in the contract; every rank scores them in one forward; only
    rank 0 verifies. Greedy tokens as transformers, with a tight pool (preemption)."""
    hf, path = model_dirs("llama")
    prompts = [p * 2 for p in PROMPTS]  # repeats: drafts to accept
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "adaptive": False,
    }
    engine = tp_engine(path, speculative_config=spec, num_gpu_blocks=30)
    try:
        reqs = engine.generate(prompts, GREEDY)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert [r.output_token_ids for r in reqs] == [hf_greedy(hf, p, 24) for p in prompts]
    assert stats.spec_decode.num_accepted_tokens > 0 and stats.num_preemptions > 0


@pytest.mark.parametrize("arch,quant_policy", [("llama", 8), ("qwen3", 4)])
def test_quantized_kv_cache_equals_tp1(arch, quant_policy, model_dirs):
    """int8 / int4 KV is not transformers-exact, so tp=2 is checked against tp=1: each rank
    quantizes its own heads with the same per-token, per-head scales."""
    _, path = model_dirs(arch)
    one = generate(engine_for(path, quant_policy=quant_policy))
    engine = tp_engine(path, quant_policy=quant_policy)
    assert_exact_plan(engine)
    assert generate(engine) == one


@needs_shared
def test_stories260k_tp2_matches_transformers():
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(STORIES)
    hf = LlamaForCausalLM.from_pretrained(STORIES).eval()
    prompts = [tok.encode(p) for p in ("Once upon a time", "Tom and Sue went to the park.")]
    engine = tp_engine(str(STORIES), block_size=8, num_gpu_blocks=256, max_prefill_token_num=6)
    assert ModelConfig.from_path(str(STORIES)).num_kv_heads == 4
    assert engine.runner.model.num_kv_heads == 2
    outs = generate(engine, prompts, SamplingParams(max_new_tokens=60, ignore_eos=True))
    assert outs == [hf_greedy(hf, p, 60) for p in prompts]


@needs_shared
def test_structured_output_at_tp2_equals_tp1():
    """Only rank 0 samples: the bitmask stays with it, and the constrained tokens match tp=1."""
    from steadylm.engine.structured import StructuredOutputs
    from steadylm.tokenizer import load_tokenizer

    tok = load_tokenizer(str(STORIES))
    so = StructuredOutputs("regex", r"[a-z]{2,5} [0-9]{2}")
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=5, structured_outputs=so)
    outs = []
    for tp in (1, 2):
        config = EngineConfig(tp=tp, block_size=8, num_gpu_blocks=64)
        engine = LLMEngine.from_pretrained(str(STORIES), config, tok)
        outs.append(generate(engine, ["Once upon a time", "Tom and Sue"], params))
    assert outs[0] == outs[1]
    for out in outs[1]:
        assert re.fullmatch(r"[a-z]{2,5} [0-9]{2}", tok.decode(out, skip_special_tokens=True))


def test_awq_tp2_matches_dequantized_transformers(tmp_path):
    """Row-parallel AWQ layers split on group boundaries (64 of 128 and 256 inputs)."""
    from tests.test_awq import save_awq

    hf = save_awq("llama", tmp_path, group=64)
    prompt = PROMPTS[0]
    engine = tp_engine(str(tmp_path))
    try:
        assert_exact_plan(engine)
        logits = engine.score(prompt)
        out = engine.generate([prompt], GREEDY)[0].output_token_ids
    finally:
        engine.shutdown()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    # torch's int4 kernel takes bf16 activations (see test_awq): the same 8% bound as tp=1.
    assert float((logits - ref).abs().max() / ref.abs().max()) < 8e-2
    assert out[:8] == hf_greedy(hf, prompt, 8)


def test_awq_split_that_cuts_a_group_is_refused(tmp_path):
    """192 MLP inputs over 2 ranks is 96 each: not a multiple of the 64-wide groups. The
    error names the cut; the worker process is gone afterwards."""
    from tests.test_awq import save_awq

    save_awq("llama", tmp_path, group=64, intermediate_size=192)
    with pytest.raises((ModelLoadError, ConfigError), match="AWQ group"):
        tp_engine(str(tmp_path))
    assert parallel.world_size() == 1


def test_impossible_head_split_is_a_config_error(tmp_path):
    make_hf_model("llama", num_attention_heads=3, head_dim=16).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="tp=2"):
        tp_engine(str(tmp_path))


# ---- sharded loading, in one process (no group: the ranks are built one after another) ----
def _rank_model(path: str, rank: int, world: int):
    from steadylm.loader import load_model

    parallel.set_local_state(rank, world)
    try:
        return load_model(path, ModelConfig.from_path(path), torch.float32, torch.device("cpu"))
    finally:
        parallel.set_local_state(0, 1)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_rank_shards_reassemble_the_checkpoint(kv_heads, tmp_path, monkeypatch):
    """Column shards stack, row shards concatenate along the input, vocab blocks stack (with
    zero padding), KV heads are split or replicated, norms are whole."""
    monkeypatch.setenv("STEADYLM_CPU_GEMM", "torch")  # keep dense weights to inspect
    hf = make_hf_model("llama", num_key_value_heads=kv_heads, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    sd = hf.state_dict()
    ranks = [_rank_model(str(tmp_path), r, 2) for r in range(2)]
    at = "model.layers.1.self_attn."
    d = hf.config.head_dim
    q = sd[at + "q_proj.weight"]
    k = sd[at + "k_proj.weight"]
    qkv = [dict(m.named_parameters())[at + "qkv_proj.weight"] for m in ranks]
    q_rows = q.shape[0] // 2
    assert torch.equal(torch.cat([w[:q_rows] for w in qkv]), q)
    kv_per_rank = max(1, kv_heads // 2) * d
    k_parts = [w[q_rows : q_rows + kv_per_rank] for w in qkv]
    if kv_heads == 2:
        assert torch.equal(torch.cat(k_parts), k)
    else:
        assert all(torch.equal(p, k) for p in k_parts)
    o = [dict(m.named_parameters())[at + "o_proj.weight"] for m in ranks]
    assert torch.equal(torch.cat(o, dim=1), sd[at + "o_proj.weight"])
    vocab = hf.config.vocab_size  # 97: blocks of 49, the last padded with one zero row
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        blocks = [dict(m.named_parameters())[name] for m in ranks]
        assert blocks[0].shape[0] == blocks[1].shape[0] == 49
        assert torch.equal(torch.cat(blocks)[:vocab], sd[name])
        assert not blocks[1][vocab - 49 :].any()
    norm = "model.layers.0.input_layernorm.weight"
    assert all(torch.equal(dict(m.named_parameters())[norm], sd[norm]) for m in ranks)


def test_a_rank_reads_only_its_shard(tmp_path, monkeypatch):
    """Weight loaders narrow the lazy checkpoint tensor before reading: a rank reads exactly
    the elements it holds (its padding row excepted), about half the model."""
    from steadylm.layers import shard

    monkeypatch.setenv("STEADYLM_CPU_GEMM", "torch")
    hf = make_hf_model("llama", tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    read = []
    original = shard.CheckpointTensor.materialize

    def counting(self):
        t = original(self)
        read.append(t.numel())
        return t

    monkeypatch.setattr(shard.CheckpointTensor, "materialize", counting)
    model = _rank_model(str(tmp_path), 1, 2)
    held = sum(p.numel() for p in model.parameters())
    padding = 2 * hf.config.hidden_size  # one zero row each in the embedding and the LM head
    assert sum(read) == held - padding
    assert sum(read) < 0.6 * sum(v.numel() for v in hf.state_dict().values())


def test_tp_needs_a_model_directory(model_dirs):
    """from_model has no files for the workers to load their shards from."""
    _, path = model_dirs("llama")
    engine = engine_for(path)
    with pytest.raises(ConfigError, match="model directory"):
        LLMEngine.from_model(engine.runner.model, EngineConfig(tp=2, num_gpu_blocks=8))


def test_shutdown_removes_the_rendezvous_store(model_dirs):
    """The workers' rendezvous directory is removed at shutdown."""
    _, path = model_dirs("llama")
    engine = tp_engine(path)
    store = engine.executor._tmp.name
    assert os.path.isdir(store)
    engine.shutdown()
    assert not os.path.exists(store)


def test_sampler_fault_at_tp2_fails_only_its_request(model_dirs):
    """A fault after the forward (rank 0's sampler) leaves the group in step: it is retried
    request by request, as at tp=1, and the others get their exact tokens."""
    from tests.engine.test_faults import POISON_TOP_K, poison_sampler, run_all

    hf, path = model_dirs("llama")
    bad = SamplingParams(max_new_tokens=8, top_k=POISON_TOP_K, temperature=0.7, seed=1)
    engine = tp_engine(path)
    try:
        poison_sampler(engine)
        outs = run_all(engine, PROMPTS, [GREEDY, bad, GREEDY])
        healthy = engine.healthy
    finally:
        engine.shutdown()
    assert outs[1][0].finish_reason == "error" and "poisoned" in outs[1][0].error
    for i in (0, 2):
        assert outs[i][1] == hf_greedy(hf, PROMPTS[i], 24)
    assert healthy


def test_forward_fault_on_rank0_is_fatal_and_clean(model_dirs):
    """A fault inside the forward leaves the workers waiting in a collective: the group is
    declared dead at once, the worker is stopped, and later calls raise EngineDeadError."""
    from steadylm.errors import EngineDeadError
    from tests.engine.test_faults import FaultyForward

    _, path = model_dirs("llama")
    engine = tp_engine(path)
    model = engine.runner.model
    model.forward = FaultyForward(model, always_from=3)  # after one 2-token request
    try:
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
        engine.add_request(PROMPTS[1], GREEDY)
        with pytest.raises(EngineDeadError, match="injected fault"):
            engine.step()
        assert not engine.healthy
        assert all(p.poll() is not None for p in engine.executor.procs)
        with pytest.raises(EngineDeadError):
            engine.step()
    finally:
        engine.shutdown()
    # The dead group is torn down too: the next tp engine in this process starts cleanly.
    assert not torch.distributed.is_initialized() and parallel.world_size() == 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tp2_gguf_equals_transformers(arch, tmp_path):
    """Each rank narrows the quantized tensors to its rows (llama.cpp's permuted q / k rows
    taken by whole heads) and columns before dequantizing: the tokens are transformers'."""
    pytest.importorskip("gguf", reason="the gguf package is not installed")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    from tests.gguf_util import hf_from_gguf, write_gguf

    hf = make_hf_model(arch, hidden_size=256, intermediate_size=512, head_dim=64)
    path = str(tmp_path / "m.gguf")
    write_gguf(hf, path, arch, ["Q4_K", "Q8_0", "Q6_K", "Q4_1", "F16"])
    ref = hf_from_gguf(path)
    engine = tp_engine(path, max_prefill_token_num=5)
    assert_exact_plan(engine)
    assert generate(engine) == [hf_greedy(ref, p, 24) for p in PROMPTS]
