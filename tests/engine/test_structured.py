"""Structured output and thinking budgets in the engine: the bitmask kernel against its torch
oracle, grammars that hold from sampled noise, and matcher state that survives preemption,
chunking and prefix caching."""

from __future__ import annotations

import json
import re

import pytest
import torch

from steadylm.engine.request import RequestStatus, SamplingParams
from steadylm.engine.structured import (
    StructuredOutputs,
    ThinkingParams,
    apply_token_bitmask,
    apply_token_bitmask_reference,
    from_response_format,
)
from steadylm.errors import RequestError
from tests.conftest import STORIES, needs_shared, run_to_end

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("vocab", [97, 128, 151_936])
def test_bitmask_kernel_matches_torch_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    rows = [0, 2, 4]
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask, rows)
    apply_token_bitmask_reference(ref, bitmask, rows)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # unconstrained rows untouched
    bit = (bitmask[1, 7 // 32] >> (7 % 32)) & 1
    assert (ref[2, 7] == logits[2, 7]) == bool(bit)  # the oracle reads bit t as token t


def _engine(**kw):
    from steadylm.config import EngineConfig
    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.tokenizer import load_tokenizer

    tok = load_tokenizer(str(STORIES))
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("block_size", 16)
    return LLMEngine.from_pretrained(str(STORIES), EngineConfig(**kw), tok), tok


def _texts(engine, tok, params: list[SamplingParams], prompt="Once upon a time"):
    reqs = [engine.generate([prompt], p)[0] for p in params]
    return [tok.decode(r.output_token_ids, skip_special_tokens=True) for r in reqs], reqs


@needs_shared
def test_json_schema_regex_and_choice_hold_from_sampling():
    engine, tok = _engine()
    sampling = dict(max_new_tokens=120, temperature=1.5, top_k=0)
    so = StructuredOutputs("json", json.dumps(SCHEMA))
    texts, reqs = _texts(
        engine, tok, [SamplingParams(seed=s, structured_outputs=so, **sampling) for s in range(6)]
    )
    for text, req in zip(texts, reqs):
        assert req.status == RequestStatus.FINISHED_STOPPED, text
        obj = json.loads(text)
        assert set(obj) == {"name", "age", "pet"} and 0 <= obj["age"] <= 120
        assert obj["pet"] in ("cat", "dog") and len(obj["name"]) <= 6
    regex = r"[0-9]{3}-[a-z]{2,4}"
    texts, _ = _texts(
        engine,
        tok,
        [
            SamplingParams(seed=s, structured_outputs=StructuredOutputs("regex", regex), **sampling)
            for s in range(4)
        ],
    )
    assert all(re.fullmatch(regex, t) for t in texts), texts
    choices = ["the cat", "a big dog", "Lily"]
    texts, _ = _texts(
        engine,
        tok,
        [
            SamplingParams(seed=s, structured_outputs=StructuredOutputs.choice(choices), **sampling)
            for s in range(4)
        ],
    )
    assert all(t in choices for t in texts), texts
    # the unconstrained model writes a story, not these
    free, _ = _texts(engine, tok, [SamplingParams(seed=0, max_new_tokens=20)])
    assert not free[0].startswith("{")


@needs_shared
def test_grammar_state_survives_preemption_chunking_and_prefix_cache():
    """Tight pool (preemption), small prefill chunks and prefix caching give the same tokens
    as a roomy run, request by request, with every output valid."""
    so = StructuredOutputs("json", json.dumps(SCHEMA))
    prompt = "Once upon a time there was a little girl named Lily. She"
    params = [
        SamplingParams(max_new_tokens=60, temperature=1.2, seed=s, structured_outputs=so)
        for s in range(6)
    ]

    def run(**kw):
        engine, tok = _engine(**kw)
        ids = [engine.add_request(prompt, p) for p in params]
        reqs = [engine.requests[i] for i in ids]
        run_to_end(engine)
        return [r.output_token_ids for r in reqs], engine, tok

    # the tight pool holds 56 tokens, which caps session_len: the roomy run gets the same cap
    roomy, _, tok = run(num_gpu_blocks=64, block_size=16, session_len=56)
    tight, engine, _ = run(
        num_gpu_blocks=14,
        block_size=4,
        max_prefill_token_num=8,
        enable_prefix_caching=True,
    )
    assert engine.scheduler.stats.num_preemptions > 0
    assert tight == roomy
    for out in roomy:
        json.loads(tok.decode(out, skip_special_tokens=True))


@needs_shared
def test_thinking_budget_forces_the_end_marker_and_grammar_applies_after():
    engine, tok = _engine()
    start, end = 300, 301  # stand-ins for <think> </think>, in no choice's spelling
    for word in ("yes", "no"):
        assert not {start, end} & set(tok.encode(word, add_special_tokens=False))
    for budget in (0, 1, 7):
        thinking = ThinkingParams(start, end, think_by_default=True, max_thinking_tokens=budget)
        p = SamplingParams(
            max_new_tokens=80,
            temperature=1.0,
            seed=budget,
            bad_token_ids=(end,),  # the model could not end the thought by itself
            thinking=thinking,
            structured_outputs=StructuredOutputs.choice(["yes", "no"]),
        )
        req = engine.generate([[1, 100, 200]], p)[0]
        out = req.output_token_ids
        assert out.index(end) == budget  # exactly `budget` thought tokens, then the end
        assert start not in out[:budget]
        assert tok.decode(out[budget + 1 :], skip_special_tokens=True) in ("yes", "no")
    # the prompt closed the thought already: the grammar applies from the first token
    thinking = ThinkingParams(start, end, think_by_default=True, max_thinking_tokens=3)
    p = SamplingParams(
        max_new_tokens=10, thinking=thinking, structured_outputs=StructuredOutputs.choice(["no"])
    )
    req = engine.generate([[1, start, 100, end]], p)[0]
    assert tok.decode(req.output_token_ids, skip_special_tokens=True) == "no"
    # not thinking by default: the model may open a thought with its first token only
    thinking = ThinkingParams(start, end, think_by_default=False, max_thinking_tokens=2)
    p = SamplingParams(
        max_new_tokens=10,
        logit_bias=((start, 100.0),),
        thinking=thinking,
        structured_outputs=StructuredOutputs.choice(["yes"]),
    )
    req = engine.generate([[1, 100]], p)[0]
    out = req.output_token_ids
    assert out[0] == start and out[3] == end
    assert tok.decode(out[4:], skip_special_tokens=True) == "yes"


@needs_shared
@pytest.mark.parametrize(
    "so,needle",
    [
        (StructuredOutputs("json", '{"type": "objectx"}'), "objectx"),
        (StructuredOutputs("json", "{not json"), "json"),
        (StructuredOutputs("regex", "[a-"), "regex"),
        (StructuredOutputs("grammar", 'root ::= "a" | b'), "grammar"),
        (StructuredOutputs("choice", "[]"), "choice"),
        (StructuredOutputs("json", '{"items": ' * 300 + "{}" + "}" * 300), "levels deep"),
    ],
)
def test_invalid_specs_are_request_errors_and_the_engine_goes_on(so, needle):
    engine, _ = _engine()
    with pytest.raises(RequestError, match=needle) as info:
        engine.add_request("Once", SamplingParams(structured_outputs=so))
    assert info.value.param == "response_format"
    assert not engine.has_unfinished()
    assert engine.generate(["Once"], SamplingParams(max_new_tokens=3))[0].output_token_ids


def test_response_format_shapes():
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).kind == "json_object"
    js = from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    )
    assert js.kind == "json" and json.loads(js.spec) == {"type": "object"}
    lm = from_response_format(  # LMDeploy's nesting
        {"type": "json_schema", "json_schema": {"name": "x", "json_schema": {"type": "array"}}}
    )
    assert json.loads(lm.spec) == {"type": "array"}
    assert from_response_format({"type": "regex_schema", "regex_schema": "a+"}).spec == "a+"
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, {"type": "regex_schema"}, []):
        with pytest.raises(RequestError):
            from_response_format(bad)
    with pytest.raises(RequestError):
        StructuredOutputs("xml", "")


@needs_shared
def test_a_matcher_that_fails_to_fill_fails_only_its_request():
    """A bitmask fill that raises for one request finishes that request with the error; the
    others in the same steps (constrained or not) give exactly a clean run's tokens."""
    so = StructuredOutputs.choice(["a big dog", "the cat"])
    params = [
        SamplingParams(max_new_tokens=20, temperature=1.0, seed=s, structured_outputs=so)
        for s in range(3)
    ] + [SamplingParams(max_new_tokens=20, temperature=1.0, seed=9)]

    def run(poison: bool):
        engine, _ = _engine()
        ids = [engine.add_request("Once upon a time", p) for p in params]
        reqs = [engine.requests[i] for i in ids]
        if poison:
            bad = reqs[1].constraint
            fill = engine.structured.fill

            def flaky(constraints):
                if any(c is bad for c in constraints):
                    raise RuntimeError("injected fill fault")
                return fill(constraints)

            engine.structured.fill = flaky
        run_to_end(engine)
        assert engine.healthy
        return reqs

    clean, poisoned = run(False), run(True)
    assert poisoned[1].status == RequestStatus.FINISHED_ERROR
    assert "injected fill fault" in poisoned[1].error
    for i in (0, 2, 3):
        assert poisoned[i].output_token_ids == clean[i].output_token_ids
        assert poisoned[i].status == clean[i].status


@needs_shared
@pytest.mark.parametrize("extra", [{"min_new_tokens": 8}, {"ignore_eos": True}])
def test_a_complete_grammar_ends_the_request(extra):
    """Once the grammar has taken its stop token the answer is whole: min_new_tokens (which
    bans EOS) and ignore_eos do not let unconstrained text follow it."""
    engine, tok = _engine()
    so = StructuredOutputs.choice(["yes", "no"])
    for seed in range(3):
        p = SamplingParams(
            max_new_tokens=30,
            temperature=1.0,
            seed=seed,
            logprobs=1,
            structured_outputs=so,
            **extra,
        )
        req = engine.generate(["Once"], p)[0]
        assert req.status == RequestStatus.FINISHED_STOPPED
        assert req.output_token_ids[-1] in engine.model_config.eos_token_ids
        assert tok.decode(req.output_token_ids[:-1], skip_special_tokens=True) in ("yes", "no")
