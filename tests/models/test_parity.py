"""Parity with HF transformers (fp32, CPU) for each architecture: prefill logits and greedy."""

from __future__ import annotations

import pytest
import torch

from steadylm.engine.request import SamplingParams
from tests.conftest import ARCHS, engine_for, hf_greedy

PROMPT = [3, 17, 42, 5, 88, 61, 9, 23, 11, 70, 2, 33, 45]


def engine_logits(engine, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position, by running the prompt through the paged path."""
    from steadylm.attention import AttentionGroup, AttentionMetadata

    bm, runner = engine.block_manager, engine.runner
    from steadylm.engine.request import Request

    req = Request("probe", prompt, SamplingParams(max_new_tokens=1))
    bm.allocate(req, len(prompt))
    table = torch.tensor([bm.block_table("probe")])
    pos = torch.arange(len(prompt))
    slots = table[0, pos // bm.block_size] * bm.block_size + pos % bm.block_size
    group = AttentionGroup(
        0,
        len(prompt),
        table,
        torch.tensor([len(prompt)]),
        torch.tensor([len(prompt)]),
        len(prompt),
        len(prompt),
    )
    md = AttentionMetadata(slots, [group], bm.block_size, engine.model_config.sliding_window)
    runner.backend.prepare(md, engine.kv_cache)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(prompt), pos, runner.backend, engine.kv_cache, md)
        logits = runner.model.compute_logits(hidden)
    bm.free(req)
    return logits


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(arch, model_dirs):
    hf, path = model_dirs(arch)
    engine = engine_for(path)
    ours = engine_logits(engine, PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(arch, model_dirs):
    hf, path = model_dirs(arch)
    engine = engine_for(path, max_prefill_token_num=5)  # chunked prefill on purpose
    req = engine.generate([PROMPT], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    assert req.output_token_ids == hf_greedy(hf, PROMPT, 40)
    assert req.finish_reason == "length"


def test_mistral_sliding_window_is_applied(model_dirs):
    """The prompt + output runs past the 24-token window, so a wrong mask would diverge."""
    hf, path = model_dirs("mistral")
    prompt = PROMPT * 2
    engine = engine_for(path)
    req = engine.generate([prompt], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
    assert len(prompt) + 32 > hf.config.sliding_window
    assert req.output_token_ids == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(dtype, model_dirs):
    hf, path = model_dirs("qwen2")
    ours = engine_logits(engine_for(path, dtype=dtype), PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()
