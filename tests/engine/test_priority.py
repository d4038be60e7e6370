"""Priorities (vLLM's `priority` under scheduling_policy="priority") and deadlines
(`SamplingParams.timeout`): who runs first, what a deadline ends, and that every token stays
the one transformers gives."""

from __future__ import annotations

import pytest

from steadylm.engine.request import RequestStatus, SamplingParams
from steadylm.errors import ConfigError, RequestError
from tests.conftest import STORIES, engine_for, hf_greedy, needs_shared

LOW = [[3, 17, 42, 5, 88, 61, 9, 23], [7, 7, 8, 1, 9, 30, 31, 32]]
HIGH = [[50, 60, 70, 80, 90, 5], [11, 12, 13, 14]]


def _run(engine, max_steps=10_000, tokens=None):
    """Step to the end (or max_steps): (request id -> tokens, ids in the order they
    finished), adding to `tokens`."""
    tokens, order = {} if tokens is None else tokens, []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                order.append(out.request_id)
        engine.block_manager.check_integrity()
    return tokens, order


def test_high_priority_requests_preempt_and_finish_first(model_dirs):
    """Two priority-10 requests fill the batch; two priority-0 requests arrive later: they
    preempt the running ones, finish first (in arrival order), and every request's tokens
    are transformers'."""
    hf, path = model_dirs("llama")
    engine = engine_for(path, max_batch_size=2, scheduling_policy="priority")
    low = [engine.add_request(p, SamplingParams(max_new_tokens=40, ignore_eos=True, priority=10))
           for p in LOW]  # fmt: skip
    tokens, _ = _run(engine, max_steps=3)  # the low ones are running, a few tokens in
    assert [r.request_id for r in engine.scheduler.running] == low
    high = [engine.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True, priority=0))
            for p in HIGH]  # fmt: skip
    tokens, order = _run(engine, tokens=tokens)
    assert order[:2] == high and set(order[2:]) == set(low)
    assert engine.stats().num_preemptions == 2  # each low one made room once
    for rid, prompt, n in [*zip(low, LOW, (40, 40)), *zip(high, HIGH, (12, 12))]:
        assert tokens[rid] == hf_greedy(hf, prompt, n), rid


def test_same_priority_is_first_come_first_served(model_dirs):
    """Within a value the earlier arrival runs first, and an equal priority never preempts."""
    _, path = model_dirs("llama")
    engine = engine_for(path, max_batch_size=1, scheduling_policy="priority")
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True, priority=3))
           for p in LOW + HIGH]  # fmt: skip
    _, order = _run(engine)
    assert order == ids
    assert engine.stats().num_preemptions == 0


def test_priority_under_fcfs_is_an_error_naming_the_flag(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path)
    with pytest.raises(RequestError, match="scheduling-policy priority"):
        engine.add_request(LOW[0], SamplingParams(priority=1))
    with pytest.raises(ConfigError, match="scheduling_policy"):
        engine_for(path, scheduling_policy="lifo")
    with pytest.raises(RequestError, match="timeout"):
        SamplingParams(timeout=0)


def test_a_deadline_ends_the_request_with_its_output_and_frees_its_blocks(model_dirs):
    """A running request past its deadline ends at the next step: finish reason "timeout",
    the tokens it had (transformers' prefix), its blocks back in the pool; the others go on."""
    hf, path = model_dirs("llama")
    engine = engine_for(path)
    free = engine.block_manager.num_free_blocks
    slow = engine.add_request(
        LOW[0], SamplingParams(max_new_tokens=200, ignore_eos=True, timeout=60)
    )
    other = engine.add_request(LOW[1], SamplingParams(max_new_tokens=20, ignore_eos=True))
    got = {}
    for _ in range(5):
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.requests[slow].arrival_time -= 61  # its minute is up (no sleep: the clock moved)
    outs = {o.request_id: o for o in engine.step()}
    assert outs[slow].finished and outs[slow].finish_reason == "timeout"
    assert engine.scheduler.stats.num_timeouts == 1
    assert slow not in engine.requests
    rest, _ = _run(engine)
    assert got[slow] == hf_greedy(hf, LOW[0], len(got[slow]))
    assert got[other] + outs[other].new_token_ids + rest.get(other, []) == hf_greedy(hf, LOW[1], 20)
    assert engine.block_manager.num_free_blocks == free


def test_a_waiting_request_times_out_too(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path, max_batch_size=1)
    engine.add_request(LOW[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    queued = engine.add_request(LOW[1], SamplingParams(max_new_tokens=5, timeout=1e-9))
    tokens, order = _run(engine)
    assert order[0] == queued and tokens.get(queued, []) == []
    assert engine.scheduler.stats.num_timeouts == 1
    assert RequestStatus.FINISHED_TIMEOUT.finish_reason == "timeout"


@needs_shared
def test_pipeline_takes_priority_and_timeout():
    """LMDeploy's pipeline: GenerationConfig.priority / .timeout and
    PytorchEngineConfig.scheduling_policy (steadylm's extensions)."""
    from steadylm import GenerationConfig, PytorchEngineConfig, pipeline

    backend = PytorchEngineConfig(scheduling_policy="priority", block_size=16, session_len=256)
    with pipeline(str(STORIES), backend_config=backend) as pipe:
        first = pipe(
            ["Once upon a time"], gen_config=GenerationConfig(max_new_tokens=9, priority=-3)
        )
        late = pipe(
            ["Once upon a time"], gen_config=GenerationConfig(max_new_tokens=9, timeout=1e-9)
        )
    assert (first[0].finish_reason, first[0].generate_token_len) == ("length", 9)
    assert (late[0].finish_reason, late[0].generate_token_len) == ("timeout", 0)
