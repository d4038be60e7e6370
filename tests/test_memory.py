"""The memory model: bytes per token by hand, weight bytes against published sizes, knob
precedence, conflicts, impossible settings, and the engine allocating exactly the plan."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from steadylm.config import EngineConfig, ModelConfig
from steadylm.errors import ConfigError, OutOfMemoryPlanError
from steadylm.memory import (
    DeviceMemory,
    GiB,
    check_knobs,
    kv_bytes_per_token,
    plan_memory,
    weight_bytes_from_config,
)
from tests.conftest import MODEL_CONFIGS, engine_for, needs_shared

CONFIGS = sorted(
    p.stem
    for p in MODEL_CONFIGS.glob("*.json")
    if p.stem not in ("gpus", "sizes") and "generation_config" not in p.stem
)
GPU24 = DeviceMemory("24 GiB test device", 24 * GiB, 24 * GiB - (512 << 20))


def cfg(name: str) -> ModelConfig:
    return ModelConfig.from_path(str(MODEL_CONFIGS / f"{name}.json"))


@needs_shared
@pytest.mark.parametrize("name", CONFIGS)
def test_kv_bytes_per_token_by_hand(name):
    raw = json.loads((MODEL_CONFIGS / f"{name}.json").read_text())
    layers, kv = raw["num_hidden_layers"], raw["num_key_value_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    mc = cfg(name)
    assert kv_bytes_per_token(mc, 0, 2) == layers * 2 * kv * head_dim * 2
    assert kv_bytes_per_token(mc, 8, 2) == layers * 2 * kv * (head_dim + 2 + 2)
    assert kv_bytes_per_token(mc, 4, 2) == layers * 2 * kv * (head_dim // 2 + 2 + 2)
    if head_dim == 128:
        ratio4 = kv_bytes_per_token(mc, 0, 2) / kv_bytes_per_token(mc, 4, 2)
        ratio8 = kv_bytes_per_token(mc, 0, 2) / kv_bytes_per_token(mc, 8, 2)
        assert ratio4 == pytest.approx(256 / 68) and 3.7 < ratio4 < 3.8  # not 4x
        assert ratio8 == pytest.approx(256 / 132) and 1.9 < ratio8 < 2.0


@needs_shared
def test_weight_bytes_equal_published_sizes():
    sizes = json.loads((MODEL_CONFIGS / "sizes.json").read_text())["models"]
    for name, facts in sizes.items():
        expected = facts.get("awq_tensor_bytes", facts["bf16_bytes"])
        assert weight_bytes_from_config(cfg(name), 2) == expected, name


@needs_shared
@pytest.mark.parametrize(
    "knob,value,expected_tokens",
    [
        ("num_gpu_blocks", 100, 6400),
        ("max_total_tokens", 10_000, 10_048),  # rounded up to whole blocks
        ("kv_cache_bytes", 1 * GiB, (GiB // (262_144 * 64)) * 64),
    ],
)
def test_absolute_knobs(knob, value, expected_tokens):
    mc = cfg("DeepSeek-R1-Distill-Qwen-32B")
    plan = plan_memory(
        mc, EngineConfig(**{knob: value}), DeviceMemory("big", 200 * GiB, 200 * GiB), 2
    )
    assert plan.total_tokens == expected_tokens
    assert plan.budget_source.startswith(knob)


def small_model() -> ModelConfig:
    return ModelConfig.from_path(str(MODEL_CONFIGS / "Qwen2.5-0.5B-Instruct.json"))


@needs_shared
def test_share_knobs_follow_vllm_and_lmdeploy_meanings():
    mc, ec = small_model(), EngineConfig(session_len=4096)
    weights = weight_bytes_from_config(mc, 2)
    util = plan_memory(mc, ec.replace(gpu_memory_utilization=0.5), GPU24, 2)
    # vLLM: 0.5 of *total* covers weights + activations + KV.
    assert util.weight_bytes + util.activation_bytes + util.kv_cache_bytes <= 12 * GiB
    assert 12 * GiB - (
        util.weight_bytes + util.activation_bytes + util.kv_cache_bytes
    ) < 64 * kv_bytes_per_token(mc, 0, 2)  # less than one block left unused
    lmd = plan_memory(mc, ec.replace(cache_max_entry_count=0.5), GPU24, 2)
    # LMDeploy: 0.5 of what is free after weights (and the activation reserve).
    free_after = GPU24.free_bytes - weights - lmd.activation_bytes
    assert abs(lmd.kv_cache_bytes - free_after * 0.5) < 64 * kv_bytes_per_token(mc, 0, 2)
    default = plan_memory(mc, ec, GPU24, 2)
    assert default.budget_source.startswith("cache_max_entry_count=0.8")


def test_two_knobs_conflict_and_the_error_says_which_to_drop():
    with pytest.raises(
        ConfigError,
        match="gpu_memory_utilization and cache_max_entry_count.*drop cache_max_entry_count",
    ):
        check_knobs(EngineConfig(gpu_memory_utilization=0.9, cache_max_entry_count=0.5))
    with pytest.raises(ConfigError, match="num_gpu_blocks and kv_cache_bytes"):
        check_knobs(EngineConfig(num_gpu_blocks=10, kv_cache_bytes=1 << 30))


@pytest.mark.parametrize(
    "field,value",
    [
        ("gpu_memory_utilization", 1.5),
        ("cache_max_entry_count", 0.0),
        ("kv_cache_bytes", -1),
        ("quant_policy", 3),
        ("block_size", 0),
        ("tp", 2),
        ("max_batch_size", -4),
        ("eviction_type", "copy"),
        ("dtype", "int3"),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})


@needs_shared
def test_impossible_settings_are_clear_errors():
    mc = cfg("DeepSeek-R1-Distill-Qwen-32B")  # 61 GiB of bf16 weights on a 24 GiB card
    with pytest.raises(OutOfMemoryPlanError, match="does not fit.*weights 61.03 GiB"):
        plan_memory(mc, EngineConfig(session_len=4096), GPU24, 2)
    small = small_model()
    with pytest.raises(OutOfMemoryPlanError, match="does not fit"):
        plan_memory(small, EngineConfig(kv_cache_bytes=100), GPU24, 2)


@needs_shared
def test_prefill_budget_is_lowered_with_numbers_when_activations_do_not_fit():
    mc = small_model()
    tight = DeviceMemory("tight", 2 * GiB, int(1.25 * GiB))
    plan = plan_memory(mc, EngineConfig(session_len=2048, max_prefill_token_num=8192), tight, 2)
    assert plan.max_prefill_token_num < 8192
    assert any(
        n.startswith("max_prefill_token_num 8192 -> 4096") and "GiB" in n for n in plan.notes
    )
    assert plan.num_blocks >= 16


@needs_shared
def test_session_len_is_clamped_to_capacity_in_the_plan():
    plan = plan_memory(
        small_model(), EngineConfig(num_gpu_blocks=10, session_len=100_000), GPU24, 2
    )
    assert plan.session_len == 640
    assert "lowered to 640" in plan.notes[-1]


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_gpu_blocks=37, block_size=4),
        dict(max_total_tokens=999, block_size=16),
        dict(kv_cache_bytes=3_000_000, block_size=8, quant_policy=8),
        dict(kv_cache_bytes=3_000_000, block_size=8, quant_policy=4),
    ],
)
def test_engine_allocates_exactly_the_planned_blocks(model_dirs, kw):
    _, path = model_dirs("qwen2")
    engine = engine_for(path, **kw)
    assert engine.block_manager.num_blocks == engine.plan.num_blocks
    assert engine.kv_cache.num_bytes == engine.plan.kv_cache_bytes
    assert (
        engine.plan.kv_cache_bytes
        == engine.plan.num_blocks * engine.plan.block_size * engine.plan.kv_bytes_per_token
    )


def test_same_budget_holds_more_tokens_with_kv_quantization(model_dirs):
    _, path = model_dirs("qwen2")  # head_dim 16, fp32: 64 B vs 16 + 8 vs 8 + 8 per head
    tokens = {
        q: engine_for(
            path, kv_cache_bytes=1 << 22, block_size=8, quant_policy=q
        ).block_manager.capacity_tokens
        for q in (0, 8, 4)
    }
    assert tokens[8] / tokens[0] == pytest.approx(64 / 24, rel=0.01)
    assert tokens[4] / tokens[0] == pytest.approx(64 / 16, rel=0.01)


def test_cpu_default_is_4_gib_when_no_knob_is_set(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path, num_gpu_blocks=0, block_size=64)
    assert engine.plan.kv_cache_bytes <= 4 * GiB
    assert (
        "CPU default" in engine.plan.budget_source
        or "cache_max_entry_count" in engine.plan.budget_source
    )


PEAK_SCRIPT = r"""
import json, sys, torch
from steadylm.config import EngineConfig
from steadylm.demo import build_random_model, preset_config
from steadylm.engine.llm_engine import LLMEngine
from steadylm.engine.request import SamplingParams
from steadylm.platform import current_rss_bytes
torch.set_num_threads(2)
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1]) * 1024
base = current_rss_bytes()
model = build_random_model(preset_config('tiny-qwen2', 8192))
config = EngineConfig(kv_cache_bytes=64 << 20, max_prefill_token_num=1024, block_size=16,
                      max_batch_size=8)
engine = LLMEngine.from_model(model, config)
prompts = [[(i * 7 + j) % 8000 + 2 for j in range(900)] for i in range(8)]
engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
p = engine.plan
print(json.dumps(dict(peak=hwm() - base, weights=p.weight_bytes, act=p.activation_bytes,
                      kv=p.kv_cache_bytes)))
"""


@pytest.mark.timeout(120)
def test_cpu_peak_memory_stays_within_the_plan():
    """Peak RSS growth of a whole run (weights, KV pool, chunked 1024-token prefills of 8
    prompts) against weights + KV + activation reserve. Tolerance: 96 MiB for torch's CPU
    allocator caching and the interpreter's own growth, measured at about 30-60 MiB here."""
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, check=True
    )
    m = json.loads(out.stdout.strip().splitlines()[-1])
    planned = m["weights"] + m["kv"] + m["act"]
    assert m["peak"] <= planned + (96 << 20), m
    assert m["peak"] >= m["weights"], m  # the weights really were loaded
