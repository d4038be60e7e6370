"""Checks that only a CUDA device can run (`pytest -m gpu`; benchmarks/gpu_check.sh runs them on
a lent GPU): CUDA graphs captured and replayed, no host sync inside a forward, bf16 kernels
(Triton's interpreter cannot run a bf16 dot), and the graphs' memory against the plan."""

from __future__ import annotations

import random

import pytest
import torch

from steadylm.engine.cuda_graph import DecodeGraphs
from steadylm.engine.request import SamplingParams
from tests.conftest import engine_for, hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 97) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


@pytest.mark.parametrize("quant_policy", [0, 8, 4])
def test_graphs_match_eager_and_transformers(quant_policy, model_dirs):
    hf, path = model_dirs("llama")
    ps = _prompts(5)
    lengths = [4, 13, 7, 11, 9]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    graphs = engine_for(path, device="cuda", max_batch_size=8, quant_policy=quant_policy)
    g = graphs.runner.graphs
    assert graphs.runner.backend.name == "triton" and g is not None and g.graphs
    ours = [r.output_token_ids for r in graphs.generate(ps, params)]
    eager = engine_for(
        path, device="cuda", max_batch_size=8, quant_policy=quant_policy, eager_mode=True
    )
    assert eager.runner.graphs is None
    assert ours == [r.output_token_ids for r in eager.generate(ps, params)]
    assert g.replays[8] > 0 and g.replays[1] > 0
    if quant_policy == 0:
        assert ours == [hf_greedy(hf, p, n) for p, n in zip(ps, lengths)]


def test_no_forward_synchronises_with_the_host(model_dirs):
    """Prefill, chunked prefill and eager decode forwards under torch's sync debug mode."""
    _, path = model_dirs("qwen2")
    engine = engine_for(path, device="cuda", eager_mode=True, max_prefill_token_num=8)
    runner = engine.runner
    forward, prepare = runner.model.forward, runner.backend.prepare

    def guarded(fn):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return run

    runner.model.forward = guarded(forward)
    runner.backend.prepare = guarded(prepare)
    outs = engine.generate(_prompts(3), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(o.output_token_ids) == 6 for o in outs)


@pytest.mark.parametrize("quant", [0, 8, 4])
def test_bf16_kernels_match_the_reference(quant):
    from tests.attention import test_triton_attention as t

    t.TOL[torch.bfloat16] = 3e-2
    t._check(t.MIXED, quant=quant, group=4, dtype=torch.bfloat16)
    t._check(t.DECODE, quant=quant, group=5, kv_heads=2, dtype=torch.bfloat16)


def test_graph_memory_stays_within_the_plan():
    """At 8B-like widths (two layers), so the estimate's per-token terms are what is checked,
    not its fixed cost per graph."""
    from transformers import LlamaConfig

    from steadylm.config import EngineConfig, ModelConfig
    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.loader import create_model

    hf = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=1024,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
    )
    model = create_model(ModelConfig.from_hf(hf), torch.bfloat16, torch.device("cuda"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    config = EngineConfig(device="cuda", max_batch_size=256, num_gpu_blocks=64, eager_mode=True)
    engine = LLMEngine.from_model(model, config)
    r = engine.runner
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what stays reserved after capture is the graphs' own pool
    before = torch.cuda.memory_reserved()
    graphs = DecodeGraphs(
        r.model, r.backend, r.kv_cache, r.block_size, 256, 4096, r.device, capture=True
    )
    torch.cuda.empty_cache()
    used = torch.cuda.memory_reserved() - before
    assert len(graphs.graphs) == 9  # 1, 2, 4, ..., 256
    from steadylm.memory import cuda_graph_bytes

    planned = cuda_graph_bytes(engine.model_config, 256, 2)
    assert used <= planned, (used, planned)
