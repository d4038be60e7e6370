"""The memory model: bytes per token by hand, weight bytes against published sizes, knob
precedence, conflicts, impossible settings, the engine allocating exactly the plan, and the
per-rank figures of tensor parallelism against checkpoint shapes split by hand."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from steadylm import catalog
from steadylm.config import EngineConfig, ModelConfig
from steadylm.errors import ConfigError, OutOfMemoryPlanError
from steadylm.memory import (
    DeviceMemory,
    GiB,
    activation_bytes,
    check_knobs,
    fmt_bytes,
    kv_bytes_per_token,
    plan_memory,
    tp_shape,
    weight_bytes_from_config,
)
from tests.conftest import MODEL_CONFIGS, engine_for, make_hf_model, needs_shared

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
    # vLLM: 0.5 of *total* covers weights + CUDA graphs + activations + KV.
    assert util.cuda_graph_bytes > 0  # a GPU plan, not eager
    used = util.weight_bytes + util.cuda_graph_bytes + util.activation_bytes + util.kv_cache_bytes
    assert used <= 12 * GiB
    assert 12 * GiB - used < 64 * kv_bytes_per_token(mc, 0, 2)  # less than one block unused
    lmd = plan_memory(mc, ec.replace(cache_max_entry_count=0.5), GPU24, 2)
    # LMDeploy: 0.5 of what is free after weights (and the activation reserve).
    free_after = GPU24.free_bytes - weights - lmd.cuda_graph_bytes - lmd.activation_bytes
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
        ("tp", 0),
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


# ---- tensor parallelism: every figure is one rank's ------------------------------------------

COLUMN = ("q_proj", "gate_proj", "up_proj")  # output rows split over the ranks
KV = ("k_proj", "v_proj")  # output rows: this rank's KV heads (one replicated head, or kv / tp)
ROW = ("o_proj", "down_proj")  # input columns split; o_proj's bias stays whole
VOCAB = ("embed_tokens", "lm_head")  # ceil(V / tp) rows, padding included


def rank_bytes(name: str, t, tp: int, local_kv: int, head_dim: int) -> int:
    """Bytes of one HF state-dict tensor that one rank holds, by the sharding rules."""
    module, kind = name.split(".")[-2:]
    shape = list(t.shape)
    if module in COLUMN:
        shape[0] //= tp
    elif module in KV:
        shape[0] = local_kv * head_dim
    elif module in ROW and kind == "weight":
        shape[1] //= tp
    elif module in VOCAB:
        shape[0] = -(-shape[0] // tp)
    return math.prod(shape) * t.element_size()


@pytest.mark.parametrize("tp,local_kv", [(1, 2), (2, 1), (4, 1)])  # tp=4: 2 KV heads replicated
@pytest.mark.parametrize(
    "arch,kw", [("qwen2", {}), ("qwen3", {}), ("llama", {"attention_bias": True}), ("mistral", {})]
)
def test_dense_weight_bytes_per_rank_equal_the_split_state_dict(arch, kw, tp, local_kv):
    model = make_hf_model(arch, **kw)  # 4 heads, 2 KV heads, intermediate 80, vocab 97
    model.config.architectures = [type(model).__name__]  # as save_pretrained writes it
    mc = ModelConfig.from_hf(model.config)
    assert tp_shape(mc, tp) == (4 // tp, local_kv, 80 // tp, -(-97 // tp))
    expected = sum(
        rank_bytes(name, t, tp, local_kv, mc.head_dim)
        for name, t in model.state_dict().items()
        if not (name.startswith("lm_head") and mc.tie_word_embeddings)
    )
    assert weight_bytes_from_config(mc, 4, tp) == expected


def awq_rank_bytes(k: int, n: int, group: int, layout: str) -> int:
    """One rank's AWQ linear of k inputs and n outputs: checkpoint qweight int32 (k, n/8),
    qzeros int32 (k/g, n/8), scales fp16 (k/g, n); runtime 4-bit codes + bf16 scale and zero."""
    groups = k // group
    if layout == "runtime":
        return k * n // 2 + groups * n * 2 * 2
    return k * (n // 8) * 4 + groups * (n // 8) * 4 + groups * n * 2


@needs_shared
@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("layout", ["checkpoint", "runtime"])
def test_awq_weight_bytes_per_rank_equal_the_split_checkpoint(tp, layout):
    mc = cfg("Qwen2.5-32B-Instruct-AWQ")
    raw = json.loads((MODEL_CONFIGS / "Qwen2.5-32B-Instruct-AWQ.json").read_text())
    c, inter, group = raw["hidden_size"], raw["intermediate_size"], 128
    head_dim = c // raw["num_attention_heads"]
    q = raw["num_attention_heads"] * head_dim // tp
    kv = raw["num_key_value_heads"] // tp * head_dim
    linears = [(c, q), (c, kv), (c, kv), (c, inter // tp), (c, inter // tp)]  # column-parallel
    linears += [(q, c), (inter // tp, c)]  # row-parallel: o_proj, down_proj split their inputs
    # every per-rank n_out (merged qkv and gate_up too) is a multiple of 16: "runtime" repacks all
    per_layer = sum(awq_rank_bytes(k, n, group, layout) for k, n in linears)
    per_layer += (q + 2 * kv) * 2 + 2 * c * 2  # q/k/v biases, the two norms (fp16)
    vocab_rows = -(-raw["vocab_size"] // tp)
    expected = raw["num_hidden_layers"] * per_layer + 2 * vocab_rows * c * 2 + c * 2
    assert weight_bytes_from_config(mc, 2, tp, layout) == expected


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return ModelConfig(**{**base, **kw})


def test_kv_heads_are_replicated_when_tp_is_a_multiple_of_them():
    mc = tiny_cfg(num_kv_heads=2)
    assert tp_shape(mc, 4) == (2, 1, 128, 250)
    assert tp_shape(mc, 8) == (1, 1, 64, 125)
    assert kv_bytes_per_token(mc, 0, 2, tp=4) == 2 * 2 * 1 * 32 * 2  # one head per rank
    assert kv_bytes_per_token(mc, 0, 2, tp=2) == 2 * 2 * 1 * 32 * 2
    assert kv_bytes_per_token(mc, 0, 2, tp=1) == 2 * 2 * 2 * 32 * 2


AWQ128 = {"quant_method": "awq", "group_size": 128}


@pytest.mark.parametrize(
    "kw,tp,message",
    [
        (dict(num_heads=6, num_kv_heads=6, head_dim=32), 4, "6 attention heads.*over 4 ranks"),
        (dict(num_heads=6, num_kv_heads=3, head_dim=32), 2, "3 KV heads neither split.*divide 2"),
        (dict(intermediate_size=500), 8, "intermediate_size 500.*over 8 ranks"),
        (
            dict(quantization=AWQ128, head_dim=16),
            2,
            "o_proj splits its 128 inputs into 64 per rank: the split cuts an AWQ group of 128",
        ),
        (
            dict(quantization=AWQ128, head_dim=64, intermediate_size=384),
            2,
            "down_proj.*384 inputs into 192 per rank: the split cuts an AWQ group of 128",
        ),
        (dict(), 0, "at least 1"),
    ],
)
def test_impossible_splits_are_config_errors_naming_the_numbers_and_the_fix(kw, tp, message):
    mc = tiny_cfg(**kw)
    with pytest.raises(ConfigError, match=message) as info:
        tp_shape(mc, tp)
    assert info.value.param == "tp" and "tp values that split this model: 1" in str(info.value)
    with pytest.raises(ConfigError, match=message):
        weight_bytes_from_config(mc, 2, tp or -1)
    with pytest.raises(ConfigError, match=message):
        plan_memory(mc, EngineConfig(), GPU24, 2, tp=tp or -1)


def test_awq_group_check_is_for_splits_only():
    mc = tiny_cfg(quantization=AWQ128, head_dim=64, intermediate_size=384)
    assert tp_shape(mc, 1) == (8, 2, 384, 1000)
    assert "down_proj" in str(pytest.raises(ConfigError, tp_shape, mc, 2).value)


def test_activations_per_rank_by_hand():
    from steadylm.attention.torch_ref import workspace_tokens

    mc = tiny_cfg()
    t, rows, ctx, d = 512, 8, 1024, 2
    for tp, local_kv in ((1, 2), (2, 1), (4, 1)):
        q, kv, inter, vl = 256 // tp, local_kv * 32, 512 // tp, -(-1000 // tp)
        mlp = 3 * t * inter * d
        attn = 2 * workspace_tokens(ctx) * kv * d + t * ctx  # this rank's K and V heads
        local = 0 if tp == 1 else rows * vl * 4  # rank 0 also gathers (rows, tp * vl)
        expected = (
            4 * t * 256 * d  # the residual stream stays whole
            + t * (q + 2 * kv) * d
            + t * q * d
            + max(mlp, attn)
            + local
            + rows * tp * vl * 4
            + 3 * rows * 1000 * 4
        )
        assert activation_bytes(mc, t, rows, ctx, d, tp) == expected, tp
    assert activation_bytes(mc, t, rows, ctx, d, 2) < activation_bytes(mc, t, rows, ctx, d)


def test_cpu_ranks_share_the_machine_ram():
    mc, cpu = tiny_cfg(), DeviceMemory("cpu", 64 * GiB, 40 * GiB)
    ec = EngineConfig(cache_max_entry_count=0.5, session_len=1024)
    whole = plan_memory(mc, ec, cpu, 2, is_cpu=True, tp=2, local_ranks=1)
    half = plan_memory(mc, ec, cpu, 2, is_cpu=True, tp=2)  # local_ranks defaults to tp
    assert whole.device_free_bytes == 40 * GiB and half.device_free_bytes == 20 * GiB
    for plan, free in ((whole, 40 * GiB), (half, 20 * GiB)):
        left = 0.5 * (free - plan.weight_bytes - plan.activation_bytes)
        assert 0 <= left - plan.kv_cache_bytes < 64 * plan.kv_bytes_per_token
    assert any("2 ranks on this machine share its RAM" in n for n in half.notes)
    assert any("4.00 GiB applies per rank" in n for n in half.notes)
    assert any("one rank on this machine plans against all its RAM" in n for n in whole.notes)
    default = plan_memory(mc, EngineConfig(), cpu, 2, is_cpu=True, tp=2)
    assert default.kv_cache_bytes <= 4 * GiB and "CPU default" in default.budget_source
    tight = DeviceMemory("cpu", 16 * GiB, 8 * GiB)  # 4 GiB per rank: 0.8 of it is the bound
    assert (
        "cache_max_entry_count=0.8"
        in plan_memory(mc, EngineConfig(), tight, 2, is_cpu=True, tp=2).budget_source
    )
    gpu = plan_memory(mc, ec, DeviceMemory("gpu", 40 * GiB, 40 * GiB), 2, tp=2)
    assert gpu.device_free_bytes == 40 * GiB  # a GPU is each rank's own
    with pytest.raises(ConfigError, match="local_ranks=3"):
        plan_memory(mc, ec, cpu, 2, is_cpu=True, tp=2, local_ranks=3)


def test_plan_cli_prints_per_rank_figures(capsys):
    from steadylm.entrypoints.cli import main

    argv = ["plan", "Qwen2.5-32B-Instruct-AWQ", "--gpu", "rtx4090", "--session-len", "8192"]
    assert main([*argv, "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 (per rank: 20 heads, 4 KV heads, intermediate 13,824" in out
    assert "memory plan (tp=2, byte figures per rank):" in out
    for row in ("weights (per rank)", "KV cache (per rank)", "KV bytes per token (per rank)"):
        assert row in out
    assert "activation reserve (rank 0, the largest)" in out
    assert main([*argv, "--tp", "2", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["tp"] == 2 and j["kv_bytes_per_token"] == 64 * 2 * 4 * 128 * 2
    mc = ModelConfig.from_path(catalog.model_config_path(argv[1]))
    assert j["weight_bytes"] == weight_bytes_from_config(
        mc, 2, 2, "cuda"
    )  # a GPU plan: the layout Triton reads
    assert re.search(rf"weights \(per rank\) +{fmt_bytes(j['weight_bytes'])}\n", out)
    assert main(argv) == 0
    single = capsys.readouterr().out
    assert "per rank" not in single and "memory plan:\n" in single
    assert main([*argv, "--tp", "3"]) == 2
    assert "40 attention heads do not split evenly over 3 ranks" in capsys.readouterr().err
