"""A decode step's decoder layers in one native call (models/llama.py `NativeDecode`): taken
where it applies (plain and int8 / int4 caches), the same tokens as transformers, the same
bits as the module path."""

from __future__ import annotations

import pytest
import torch

from steadylm import kernels
from steadylm.engine.request import SamplingParams
from tests.conftest import GEMV_SIZES, engine_for, hf_greedy, make_hf_model

pytestmark = pytest.mark.skipif(
    kernels.native_ops() is None or kernels.packed_linear_max_rows() == 0,
    reason="the native CPU kernels (with the packed GEMV) are not built here",
)

PROMPTS = [[3, 17, 42, 5, 88, 61, 9, 23, 11, 70, 2, 33, 45], [7, 1, 64, 30, 30, 12]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            model = make_hf_model(arch, **GEMV_SIZES)
            path = tmp_path_factory.mktemp(f"{arch}-gemv")
            model.save_pretrained(path)
            cache[arch] = (model, str(path))
        return cache[arch]

    return get


def _generate(path: str, monkeypatch, layers: str, **kw):
    """(requests, calls of the native op) for PROMPTS, greedy with logprobs, batched."""
    monkeypatch.setenv("STEADYLM_CPU_DECODE_LAYERS", layers)
    engine = engine_for(path, **kw)
    model = engine.runner.model.model
    calls = []
    real = model._native_decode

    def spy(x, cache, md):
        plan = real(x, cache, md)
        calls.append(plan is not None)
        return plan

    monkeypatch.setattr(model, "_native_decode", spy)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, logprobs=2)
    return engine.generate(PROMPTS, params), calls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_native_layers_match_transformers_and_the_modules_bit_for_bit(arch, dirs, monkeypatch):
    """qwen2 brings a qkv bias; mistral a 24-token sliding window the outputs run past."""
    hf, path = dirs(arch)
    native, calls = _generate(path, monkeypatch, "native")
    assert sum(calls) >= 29  # every decode step (the prefill steps take the modules)
    modules, calls_off = _generate(path, monkeypatch, "modules")
    assert not any(calls_off)
    for prompt, a, b in zip(PROMPTS, native, modules):
        assert a.output_token_ids == hf_greedy(hf, prompt, 30)
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == b.output_logprobs  # the same floats, not just close


@pytest.mark.parametrize("quant_policy", [8, 4])
def test_quantized_caches_take_the_native_layers_too(quant_policy, dirs, monkeypatch):
    _, path = dirs("qwen2")
    native, calls = _generate(path, monkeypatch, "native", quant_policy=quant_policy)
    assert sum(calls) >= 29
    modules, _ = _generate(path, monkeypatch, "modules", quant_policy=quant_policy)
    for a, b in zip(native, modules):
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == b.output_logprobs


def test_bf16_batches_of_up_to_16_rows_match_the_modules_bit_for_bit(dirs, monkeypatch):
    """bf16 decode steps of 12 rows: on an AMX machine every linear runs the AMX GEMV (up to
    16 rows), elsewhere the vector GEMV or oneDNN's matmul, inside the native call as in the
    modules: the same tokens and logprob floats either way."""
    from steadylm.layers.linear import OneDNNDenseKernel

    if not OneDNNDenseKernel.supports(torch.empty(1, 1, dtype=torch.bfloat16)):
        pytest.skip("oneDNN cannot prepack bf16 on this CPU (it needs AVX512BW/VL/DQ)")
    _, path = dirs("llama")
    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + i)] for i in range(12)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2)
    outs, rows = {}, []
    for layers in ("native", "modules"):
        monkeypatch.setenv("STEADYLM_CPU_DECODE_LAYERS", layers)
        engine = engine_for(path, dtype="bfloat16")
        model = engine.runner.model.model
        real = model._native_decode

        def spy(x, cache, md, real=real):
            plan = real(x, cache, md)
            if plan is not None:
                rows.append((x.shape[0], plan.gemv_rows))
            return plan

        monkeypatch.setattr(model, "_native_decode", spy)
        outs[layers] = engine.generate(prompts, params)
    assert (12, rows[0][1]) in rows  # the native call ran the 12-row steps
    if kernels.native_ops().packed_linear_amx_rows(128):  # AMX here: its GEMV took them
        assert rows[0][1] == 16
    for a, b in zip(outs["native"], outs["modules"]):
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == b.output_logprobs


def test_the_native_layers_leave_larger_batches_to_onednn_where_the_gemv_does(dirs, monkeypatch):
    """Where the GEMV takes fewer rows than the native call (bf16 in AMX's 32-column layout:
    2), the call runs oneDNN's matmul on the packed weights for larger batches. Forced here in
    fp32 on any machine (the GEMV off for every linear): the same tokens as transformers and
    the same bits as the modules, which then run oneDNN's matmul too."""

    def run(layers: str):
        monkeypatch.setenv("STEADYLM_CPU_DECODE_LAYERS", layers)
        engine = engine_for(path)
        model = engine.runner.model.model
        for module in model.modules():
            if getattr(getattr(module, "kernel", None), "gemv_max_rows", 0):
                module.kernel.gemv_max_rows = 0
        calls = []
        real = model._native_decode

        def spy(*args):
            plan = real(*args)
            if plan is not None:  # the GEMV's addresses made to read zeros: it must not run
                zeros = [poison.data_ptr()] * len(plan.qkv)
                plan.qkv, plan.o_proj, plan.gate_up, plan.down = zeros, zeros, zeros, zeros
            calls.append(plan)
            return plan

        monkeypatch.setattr(model, "_native_decode", spy)
        params = SamplingParams(max_new_tokens=30, ignore_eos=True, logprobs=2)
        return engine.generate(PROMPTS, params), calls

    poison = torch.zeros(1 << 20)
    hf, path = dirs("qwen2")
    native, calls = run("native")
    plans = [c for c in calls if c is not None]
    assert len(plans) >= 29 and plans[0].onednn and plans[0].gemv_rows == 0
    modules, _ = run("modules")
    for prompt, a, b in zip(PROMPTS, native, modules):
        assert a.output_token_ids == hf_greedy(hf, prompt, 30)
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == b.output_logprobs


def test_a_model_it_does_not_cover_takes_the_modules(dirs, monkeypatch):
    hf, path = dirs("qwen3")  # q/k norms
    reqs, calls = _generate(path, monkeypatch, "native")
    assert calls and not any(calls)
    assert reqs[0].output_token_ids == hf_greedy(hf, PROMPTS[0], 30)


@pytest.mark.parametrize("switch", ["STEADYLM_CPU_DECODE_LAYERS", "STEADYLM_CPU_AMX_GEMV"])
def test_a_bad_switch_value_fails_at_start_up(dirs, monkeypatch, switch):
    from steadylm.errors import ConfigError

    _, path = dirs("llama")
    monkeypatch.setenv(switch, "fused")
    with pytest.raises(ConfigError, match=switch):
        engine_for(path)
