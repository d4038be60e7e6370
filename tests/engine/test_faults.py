"""A forward that raises on step k: every request of that step gets the error, at once, and
the engine serves the next request."""

from __future__ import annotations

import pytest

from steadylm.engine.request import SamplingParams
from tests.conftest import engine_for, run_to_end


class FaultyForward:
    def __init__(self, model, fail_on: set[int]):
        self.forward, self.fail_on, self.calls = model.forward, fail_on, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError(f"injected fault at forward {self.calls}")
        return self.forward(*args, **kwargs)


def test_fault_reaches_every_request_of_the_step_and_engine_recovers(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path)
    engine.runner.model.forward = FaultyForward(engine.runner.model, {3})
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7 + i], params) for i in range(3)]
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        engine.block_manager.check_integrity()
    assert set(results) == set(ids)
    for out in results.values():
        assert out.finish_reason == "error"
        assert "injected fault at forward 3" in out.error
    assert engine.block_manager.num_used_blocks == 0
    assert engine.healthy and "injected fault" in engine.last_error
    # The next request is served normally.
    req = engine.generate([[5, 6, 9]], params)[0]
    assert req.finish_reason == "length" and req.num_output_tokens == 8


def test_repeated_faults_mark_engine_unhealthy_with_cause(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path)
    engine.runner.model.forward = FaultyForward(engine.runner.model, {1, 2, 3})
    for _ in range(3):
        engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))
    assert not engine.healthy
    assert "injected fault at forward 3" in engine.stats().last_error


@pytest.mark.parametrize("fail_step", [1, 2])
def test_fault_during_chunked_prefill_leaves_no_blocks(model_dirs, fail_step):
    _, path = model_dirs("qwen2")
    engine = engine_for(path, max_prefill_token_num=4)
    engine.runner.model.forward = FaultyForward(engine.runner.model, {fail_step})
    engine.add_request(list(range(3, 20)), SamplingParams(max_new_tokens=4))
    run_to_end(engine)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.timeout(60)
def test_engine_loop_death_wakes_every_waiting_caller(model_dirs):
    """A bug outside the model (here: step() itself raising) kills the loop: every open
    stream gets an error result at once, and later calls raise EngineDeadError."""
    import threading

    from steadylm.engine.async_engine import AsyncEngine
    from steadylm.errors import EngineDeadError

    _, path = model_dirs("llama")
    engine = engine_for(path)
    gate = threading.Event()

    def broken_step():
        gate.wait(10)  # both requests are queued before the loop breaks
        raise RuntimeError("scheduler bug")

    engine.step = broken_step
    ae = AsyncEngine(engine)
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    streams = [ae.add_request([5, 6, 7 + i], params) for i in range(2)]
    gate.set()
    finals = [list(s)[-1] for s in streams]  # returns only once the loop delivered
    assert all(f.finished and f.finish_reason == "error" for f in finals)
    assert all("scheduler bug" in f.error for f in finals)
    assert not ae.healthy and "scheduler bug" in ae.dead_error
    with pytest.raises(EngineDeadError, match="scheduler bug"):
        ae.add_request([5], params)
    assert engine.block_manager.num_used_blocks == 0
