"""The engine on the Triton attention backend (STEADYLM_ATTENTION_BACKEND=triton) and the
small-op Triton kernels against transformers, greedy token for token, under chunked prefill,
batching, preemption and prefix cache hits. Without a GPU the kernels run in Triton's
interpreter (tests/conftest.py)."""

from __future__ import annotations

import random
import types

import pytest
import torch

from steadylm import platform
from steadylm.engine.request import SamplingParams
from tests.conftest import ARCHS, MOE_ARCHS, STORIES, engine_for, hf_greedy, needs_shared

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    not platform.triton_usable(DEVICE),
    reason="triton is not installed, or no GPU and TRITON_INTERPRET is not set",
)
PROMPT = [3, 17, 42, 5, 88, 61, 9, 23, 11, 70, 2, 33, 45]


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    """The Triton attention backend, and the small-op Triton kernels (norms, SiLU-and-mul,
    rotary) on any device: what a CUDA engine runs."""
    from steadylm import kernels
    from steadylm.kernels import triton_ops

    calls = {}

    def counted(name):
        def run(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return getattr(triton_ops, name)(*args, **kwargs)

        return run

    ops = types.SimpleNamespace(**{n: counted(n) for n in ("rms_norm", "silu_and_mul", "rotary_")})
    monkeypatch.setenv("STEADYLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(kernels, "triton_ops_for", lambda *tensors: ops)
    return calls


def test_the_engine_runs_the_triton_kernels(model_dirs, triton_backend):
    _, path = model_dirs("llama")
    engine = engine_for(path)
    assert engine.runner.backend.name == "triton"
    engine.generate([PROMPT], SamplingParams(max_new_tokens=2, ignore_eos=True))
    layers = engine.model_config.num_layers
    steps = 2  # the prefill and one decode step
    assert triton_backend == {
        "rms_norm": steps * (2 * layers + 1),  # two per layer and the final norm
        "silu_and_mul": steps * layers,
        "rotary_": steps * layers,
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(arch, model_dirs):
    hf, path = model_dirs(arch)
    prompt = PROMPT * 2 if arch == "mistral" else PROMPT  # past mistral's 24-token window
    engine = engine_for(path, max_prefill_token_num=5)  # chunked prefill over a prefix
    req = engine.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    assert req.output_token_ids == hf_greedy(hf, prompt, 20)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_through_every_triton_kernel_matches_transformers(arch, model_dirs, monkeypatch):
    """What a CUDA engine runs for a mixture of experts: Triton attention, small ops and the
    fused MoE kernel, batched with chunked prefill."""
    from steadylm.layers import moe

    monkeypatch.setattr(moe.SparseMoeBlock, "kernel_choice", "triton")
    hf, path = model_dirs(arch)
    engine = engine_for(path, max_prefill_token_num=5)
    assert all(
        b.stacked is not None
        for b in engine.runner.model.modules()
        if isinstance(b, moe.SparseMoeBlock)
    )
    prompts = [PROMPT, [7, 7, 8, 1]]
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [r.output_token_ids for r in reqs] == [hf_greedy(hf, p, 12) for p in prompts]


def test_batching_preemption_and_cache_hits_keep_transformers_tokens(model_dirs):
    hf, path = model_dirs("qwen2")
    rng = random.Random(7)
    shared = [rng.randrange(3, 97) for _ in range(16)]
    prompts = [
        shared[: rng.randrange(8, 17)] + [rng.randrange(3, 97) for _ in range(n)]
        for n in (3, 9, 14)
    ]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    engine = engine_for(
        path, enable_prefix_caching=True, max_prefill_token_num=5, num_gpu_blocks=12, block_size=4
    )
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for _ in range(2):  # the second round starts from the first round's cached blocks
        assert [r.output_token_ids for r in engine.generate(prompts, params)] == expected
    assert engine.stats().num_preemptions > 0
    assert engine.block_manager.hit_rate > 0.2
    engine.block_manager.check_integrity()


@pytest.mark.parametrize("quant", [8, 4])
def test_quantized_cache_matches_the_reference_backend(quant, model_dirs, monkeypatch):
    """A quantized cache is not transformers': the Triton engine gives the reference
    backend's greedy tokens (the kernels agree to float rounding; codes to the bit)."""
    _, path = model_dirs("llama")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:5]]
    ours = engine_for(path, quant_policy=quant).generate(prompts, params)
    monkeypatch.setenv("STEADYLM_ATTENTION_BACKEND", "torch")
    ref = engine_for(path, quant_policy=quant).generate(prompts, params)
    assert [r.output_token_ids for r in ours] == [r.output_token_ids for r in ref]


@needs_shared
def test_stories260k_matches_llama2c_reference():
    """A real trained model: the first 32 greedy tokens from BOS, as llama2.c wrote them, with
    the decode steps through the padded static-buffer path (CUDA graphs on a GPU)."""
    import json

    ref = json.loads((STORIES / "reference.json").read_text())["greedy_from_bos"]["token_ids"]
    engine = engine_for(str(STORIES), block_size=16, num_gpu_blocks=64)
    from tests.engine.test_decode_graphs import padded_decode

    if engine.runner.graphs is None:
        padded_decode(engine)
    n = min(32, len(ref) - 1)
    req = engine.generate([ref[:1]], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
    assert [ref[0]] + req.output_token_ids == ref[: n + 1]
