"""The CUDA-graph decode path, run eagerly on the CPU: the same static buffers, bucketing and
padded rows the captured graphs replay on a GPU (steadylm/engine/cuda_graph.py)."""

from __future__ import annotations

import random

import pytest
import torch

from steadylm import platform
from steadylm.config import EngineConfig, ModelConfig
from steadylm.engine.cuda_graph import DecodeGraphs
from steadylm.engine.request import SamplingParams
from steadylm.memory import DeviceMemory, GiB, cuda_graph_bytes, graph_buckets, plan_memory
from tests.conftest import engine_for, hf_greedy, make_hf_model

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
needs_triton = pytest.mark.skipif(
    not platform.triton_usable(torch.device("cpu")),
    reason="triton is not installed, or TRITON_INTERPRET is not set",
)


def padded_decode(engine) -> DecodeGraphs:
    """Route the engine's decode steps through the static-buffer path, uncaptured."""
    r = engine.runner
    r.graphs = DecodeGraphs(
        r.model,
        r.backend,
        r.kv_cache,
        r.block_size,
        engine.config.max_batch_size,
        engine.plan.session_len,
        r.device,
        capture=False,
    )
    return r.graphs


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 97) for _ in range(rng.randrange(2, 20))] for _ in range(n)]


def test_buckets_are_powers_of_two_then_the_max():
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)], ids=str)
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_padded_decode_matches_transformers(arch, backend, model_dirs, monkeypatch):
    """Five requests decode as bucket 8 (three padded rows), then fewer as they finish at
    different lengths; every request still gets exactly transformers' greedy tokens."""
    monkeypatch.setenv("STEADYLM_ATTENTION_BACKEND", backend)
    hf, path = model_dirs(arch)
    engine = engine_for(path, max_batch_size=6)
    graphs = padded_decode(engine)
    ps = prompts(5)
    lengths = [4, 13, 7, 11, 9]
    outs = engine.generate(ps, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])
    for p, n, out in zip(ps, lengths, outs):
        assert out.output_token_ids == hf_greedy(hf, p, n)
    assert graphs.replays[6] > 0 and graphs.replays[2] > 0  # 5 rows -> 6; 2 rows -> 2
    assert graphs.replays[1] > 0  # the last one alone
    engine.block_manager.check_integrity()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)], ids=str)
@pytest.mark.parametrize("quant_policy", [8, 4])
def test_padded_rows_write_nothing_to_a_quantized_cache(
    quant_policy, backend, model_dirs, monkeypatch
):
    """Same tokens with and without the padded path (quantized KV is not transformers'),
    and exactly one slot written per computed token: the padded rows write nowhere."""
    monkeypatch.setenv("STEADYLM_ATTENTION_BACKEND", backend)
    _, path = model_dirs("qwen2")
    ps = prompts(3, seed=5)
    plain = engine_for(path, quant_policy=quant_policy, max_batch_size=4)
    expected = [o.output_token_ids for o in plain.generate(ps, GREEDY)]
    engine = engine_for(path, quant_policy=quant_policy, max_batch_size=4)
    codes = engine.kv_cache.k
    codes.fill_(0xAB)
    graphs = padded_decode(engine)
    outs = engine.generate(ps, GREEDY)
    assert [o.output_token_ids for o in outs] == expected
    assert graphs.replays[4] > 0  # 3 rows padded to 4
    rows = codes[0].flatten(0, 1)  # (slots, Hkv, W) of layer 0
    # A written row holds real codes; the reference zeroes a block the first time it is used.
    written = ((rows != 0xAB).flatten(1).any(1) & (rows != 0).flatten(1).any(1)).sum()
    assert int(written) == sum(len(p) + GREEDY.max_new_tokens - 1 for p in ps)


def test_a_table_wider_than_the_buffers_runs_eagerly(model_dirs):
    """The static block tables cover session_len; anything wider takes the eager path."""
    _, path = model_dirs("llama")
    engine = engine_for(path, max_batch_size=2)
    graphs = padded_decode(engine)
    assert graphs.fits(2, graphs.max_blocks) and not graphs.fits(2, graphs.max_blocks + 1)
    assert not graphs.fits(3, 1)


def test_the_plan_counts_graph_memory_on_cuda_only():
    hf = make_hf_model("llama", hidden_size=256, intermediate_size=512).config
    hf.architectures = ["LlamaForCausalLM"]
    mc = ModelConfig.from_hf(hf)
    dev = DeviceMemory("gpu", 8 * GiB, 8 * GiB)
    graphs = cuda_graph_bytes(mc, 32, 2)
    assert graphs > 0
    on_gpu = plan_memory(mc, EngineConfig(max_batch_size=32), dev, 2)
    eager = plan_memory(mc, EngineConfig(max_batch_size=32, eager_mode=True), dev, 2)
    on_cpu = plan_memory(mc, EngineConfig(max_batch_size=32), dev, 2, is_cpu=True)
    assert on_gpu.cuda_graph_bytes == graphs
    assert eager.cuda_graph_bytes == 0 and on_cpu.cuda_graph_bytes == 0
    # tp > 1 decodes eagerly: a replayed graph's all-reduces would bypass the collective timeout
    assert plan_memory(mc, EngineConfig(max_batch_size=32, tp=2), dev, 2).cuda_graph_bytes == 0
    # cache_max_entry_count (0.8) of what is left: the graphs come out before the KV share
    assert eager.kv_cache_bytes - on_gpu.kv_cache_bytes == pytest.approx(
        0.8 * graphs, abs=on_gpu.kv_bytes_per_token * on_gpu.block_size
    )
    assert "CUDA graphs (decode)" in on_gpu.table() and "CUDA graphs" not in eager.table()
