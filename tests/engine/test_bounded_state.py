"""Nothing the engine keeps per request or per step grows with the number served: after
thousands of steps and hundreds of finished, aborted and preempted requests, the step log is a
fixed window and every per-request map is empty again (the soak in benchmarks/soak.py checks
the same from outside, as RSS)."""

from __future__ import annotations

import random

from steadylm.engine import llm_engine
from steadylm.engine.async_engine import AsyncEngine
from steadylm.engine.request import SamplingParams
from tests.conftest import engine_for


def mixed_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=rng.randint(1, 12),
        temperature=rng.choice((0.0, 0.8)),
        seed=rng.choice((None, rng.randrange(1 << 20))),
        logprobs=rng.choice((None, 0, 2)),
        ignore_eos=True,
    )


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 90) for _ in range(rng.randint(1, 40))]


def assert_no_request_state(engine) -> None:
    assert engine.requests == {}
    assert engine._reported == {}
    spec = engine.speculator
    assert spec is None or (spec.pace == {} and spec.proposer.indexes == {})
    assert engine.block_manager.req_blocks == {}
    assert engine.block_manager.req_hashes == {}
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert len(engine.block_manager.cached) <= engine.block_manager.num_blocks
    engine.block_manager.check_integrity()


def test_step_log_is_a_fixed_window(model_dirs, monkeypatch):
    assert llm_engine.STEP_LOG_LEN <= 4096  # was 100,000 records (86 MB)
    monkeypatch.setattr(llm_engine, "STEP_LOG_LEN", 32)
    _, path = model_dirs("llama")
    engine = engine_for(path)
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    engine.generate([[5, 6, 7]] * 2, params)
    assert engine.scheduler.stats.num_steps >= 100
    assert len(engine.step_log) == 32
    assert engine.step_log[-1].num_seqs == 2  # the window holds the latest steps


def test_per_request_maps_empty_after_many_requests(model_dirs):
    """Finished, aborted (waiting and running) and preempted requests all leave no trace."""
    _, path = model_dirs("llama")
    # A small pool and prefix caching: preemptions and cached blocks happen along the way.
    engine = engine_for(path, num_gpu_blocks=24, enable_prefix_caching=True, max_batch_size=6)
    rng = random.Random(0)
    for i in range(400):
        rid = engine.add_request(prompt(rng), mixed_params(rng))
        if i % 7 == 0:
            engine.abort(rid)  # still waiting
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if i % 11 == 0 and engine.requests:
            engine.abort(rng.choice(sorted(engine.requests)))  # usually running
        if i % 50 == 0:
            assert len(engine.requests) < 60
    while engine.has_unfinished():
        engine.step()
    engine.step()  # an empty step: state released one step late is released now
    assert engine.scheduler.stats.num_preemptions > 0
    assert_no_request_state(engine)


def test_async_engine_forgets_streams_of_finished_and_aborted_requests(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path)
    aengine = AsyncEngine(engine)
    rng = random.Random(1)
    try:
        streams = []
        for i in range(60):
            stream = aengine.add_request(prompt(rng), mixed_params(rng))
            if i % 5 == 0:
                aengine.abort_nowait(stream.request_id)
            streams.append(stream)
        for stream in streams:
            outs = list(stream)  # every stream ends, aborted ones included
            assert outs and outs[-1].finished
        with aengine.paused():
            engine.step()  # an empty step: state released one step late is released now
            assert aengine._streams == {}
            assert_no_request_state(engine)
    finally:
        aengine.shutdown()
