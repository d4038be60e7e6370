"""Prompt logprobs (echo, lm-eval): computed in the request's own prefill chunks, equal to the
engine's scoring under chunking, logit slicing, preemption and prefix caching."""

from __future__ import annotations

import pytest
import torch

from steadylm.engine.request import SamplingParams
from tests.conftest import STORIES, needs_shared, run_to_end

pytestmark = needs_shared
TEXT = "Once upon a time there was a little girl named Lily. She loved to play outside in the sun"


def _engine(**kw):
    from steadylm.config import EngineConfig
    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.tokenizer import load_tokenizer

    tok = load_tokenizer(str(STORIES))
    config = EngineConfig(**{"num_gpu_blocks": 64, "block_size": 16, **kw})
    return LLMEngine.from_pretrained(str(STORIES), config, tok), tok


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_prefill_token_num": 5},  # the prompt in several chunks
        {"max_batch_size": 2},  # logits for at most 2 rows at a time
        {"num_gpu_blocks": 12, "block_size": 4, "enable_prefix_caching": True},  # preemption
    ],
    ids=["whole", "chunked", "sliced", "tight"],
)
def test_prompt_logprobs_equal_the_engines_scoring(kw):
    engine, tok = _engine(**kw)
    ids = tok.encode(TEXT)
    reference = torch.log_softmax(_engine()[0].score(ids).float(), dim=-1)
    rid = engine.add_request(ids, SamplingParams(max_new_tokens=12, prompt_logprobs=3))
    others = [  # company: batching, and in the tight pool preemption
        engine.add_request(ids[: 7 + i], SamplingParams(max_new_tokens=20, ignore_eos=True))
        for i in range(3)
    ]
    firsts = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.prompt_logprobs is not None:
                firsts.append(out.prompt_logprobs)
        engine.block_manager.check_integrity()
    assert len(firsts) == 1  # reported once, with the first token
    plp = firsts[0]
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        assert plp[j][ids[j]] == pytest.approx(float(reference[j - 1, ids[j]]), abs=1e-4)
        top = sorted(plp[j].values(), reverse=True)
        assert top[0] == pytest.approx(float(reference[j - 1].max()), abs=1e-4)
    if kw.get("num_gpu_blocks") == 12:
        assert engine.scheduler.stats.num_preemptions > 0
    assert all(o not in engine.requests for o in others)


def test_prompt_logprob_requests_skip_the_prefix_cache_and_others_still_hit():
    engine, tok = _engine(enable_prefix_caching=True)
    ids = tok.encode(TEXT)
    engine.generate([ids], SamplingParams(max_new_tokens=2))  # fills the cache
    scored = engine.add_request(ids, SamplingParams(max_new_tokens=2, prompt_logprobs=0))
    req = engine.requests[scored]
    run_to_end(engine)
    assert req.num_cached_tokens == 0 and None not in req.prompt_logprobs[1:]
    plain = engine.generate([ids], SamplingParams(max_new_tokens=2))[0]
    assert plain.num_cached_tokens > 0
