"""Faults inside a step. A step that raises is retried one request at a time: a request that
fails alone finishes with the error and nobody else is harmed; only faults that leave nothing
able to run (not even a one-token probe) count against the engine's health."""

from __future__ import annotations

import random

import pytest

from steadylm.engine.request import SamplingParams
from tests.conftest import engine_for, run_to_end

GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)
POISON_TOKEN = 96  # a prompt holding it fails inside the model forward
POISON_TOP_K = 13  # a request with this top_k fails inside the sampler


class FaultyForward:
    """Raise on the given forward calls (1-based), or on every call from `always_from` on."""

    def __init__(self, model, fail_on=(), always_from=None):
        self.forward, self.fail_on, self.calls = model.forward, set(fail_on), 0
        self.always_from = always_from

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls in self.fail_on or (self.always_from and self.calls >= self.always_from):
            raise RuntimeError(f"injected fault at forward {self.calls}")
        return self.forward(*args, **kwargs)


def poison_forward(engine) -> None:
    """The forward raises whenever a request whose prompt holds the poison token is in the
    step (generated tokens may be anything, so only prompts carry the poison)."""
    runner = engine.runner
    inner, model = runner.run, runner.model
    forward = model.forward

    def run(scheduled):
        reqs = [runner.requests[rid] for rid, _ in scheduled]
        bad = any(POISON_TOKEN in r.all_token_ids[: r.num_prompt_tokens] for r in reqs)

        def checked(*args, **kwargs):
            if bad:
                raise ValueError("poisoned token in the batch")
            return forward(*args, **kwargs)

        model.forward = checked
        try:
            return inner(scheduled)
        finally:
            model.forward = forward

    runner.run = run


def poison_sampler(engine) -> None:
    sampler = engine.runner.sampler
    inner = sampler._sample_step

    def step(logits, requests):
        if any(r.params.top_k == POISON_TOP_K for r in requests):
            raise OverflowError("poisoned sampling value")
        return inner(logits, requests)

    sampler._sample_step = step


def run_all(engine, prompts, params):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results, tokens = {}, {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                results[out.request_id] = out
        engine.block_manager.check_integrity()
    return [(results[i], tokens[i]) for i in ids]


def test_a_transient_step_fault_is_retried_and_harms_nobody(model_dirs):
    _, path = model_dirs("llama")
    prompts = [[5, 6, 7 + i] for i in range(3)]
    clean = run_all(engine_for(path), prompts, [GREEDY] * 3)
    engine = engine_for(path)
    engine.runner.model.forward = FaultyForward(engine.runner.model, fail_on={3})
    got = run_all(engine, prompts, [GREEDY] * 3)
    assert [t for _, t in got] == [t for _, t in clean]
    assert all(out.finish_reason == "length" for out, _ in got)
    assert engine.healthy and engine.consecutive_faults == 0
    assert engine.block_manager.num_used_blocks == 0


def test_a_request_that_fails_alone_fails_alone(model_dirs):
    """Issue 19.2: one request whose value breaks the sampler, batched with six innocent
    ones: the six finish with a clean run's tokens; the bad one gets the error; health stays
    up even after many such requests, alone or batched."""
    _, path = model_dirs("llama")
    prompts = [[5, 6, 7 + i] for i in range(7)]
    bad = SamplingParams(max_new_tokens=8, top_k=POISON_TOP_K, temperature=0.7, seed=1)
    params = [GREEDY] * 3 + [bad] + [GREEDY] * 3
    clean = run_all(engine_for(path), prompts[:3] + prompts[4:], [GREEDY] * 6)
    engine = engine_for(path)
    poison_sampler(engine)
    got = run_all(engine, prompts, params)
    assert [t for _, t in got[:3] + got[4:]] == [t for _, t in clean]
    out, tokens = got[3]
    assert out.finish_reason == "error" and "poisoned sampling value" in out.error
    assert "request failed in the engine" in out.error and tokens == []
    for _ in range(4):  # alone, again and again: still the request's fault, not the engine's
        ((out, _),) = run_all(engine, [[5, 6]], [bad])
        assert out.finish_reason == "error"
    assert engine.healthy and engine.last_error is None
    assert engine.num_request_faults == 5
    assert engine.block_manager.num_used_blocks == 0


def test_a_persistent_fault_marks_the_engine_unhealthy(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path)
    engine.runner.model.forward = FaultyForward(engine.runner.model, always_from=1)
    for _ in range(3):
        (req,) = engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))
        assert req.finish_reason == "error" and "engine fault" in req.error
    assert not engine.healthy
    assert "injected fault" in engine.stats().last_error
    assert engine.fault_counts == {"RuntimeError": 3}
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("fail_step", [1, 2])
def test_fault_during_chunked_prefill_leaves_no_blocks(model_dirs, fail_step):
    _, path = model_dirs("qwen2")
    engine = engine_for(path, max_prefill_token_num=4)
    faulty = FaultyForward(engine.runner.model, fail_on={fail_step, fail_step + 1, fail_step + 2})
    engine.runner.model.forward = faulty
    (req,) = engine.generate([list(range(3, 20))], SamplingParams(max_new_tokens=4))
    assert req.finish_reason == "error"
    assert engine.block_manager.num_used_blocks == 0
    run_to_end(engine)


@pytest.mark.timeout(240)
def test_randomized_poisoned_requests_never_change_innocent_outputs(model_dirs):
    """Random arrivals on a tight pool (preemption, chunked prefill, prefix caching) where a
    fifth of the requests carry a value that fails inside the step, in the forward or in the
    sampler: every innocent request ends with the tokens of a clean run without the poisoned
    ones, every poisoned one ends with an error, and the engine stays healthy."""
    _, path = model_dirs("llama")
    rng = random.Random(19)
    kw = dict(
        num_gpu_blocks=24,
        block_size=4,
        max_prefill_token_num=12,
        max_batch_size=6,
        enable_prefix_caching=True,
    )
    jobs = []
    prefixes = [[rng.randrange(3, 90) for _ in range(12)] for _ in range(3)]
    for i in range(60):
        head = rng.choice(prefixes)[: rng.randrange(0, 12)]
        prompt = head + [rng.randrange(3, 90) for _ in range(rng.randrange(2, 10))]
        seeded = dict(temperature=0.8, top_p=0.9, seed=i) if rng.random() < 0.3 else {}
        kind = rng.choices(["ok", "forward", "sampler"], [8, 1, 1])[0]
        if kind == "forward":
            prompt[rng.randrange(len(prompt))] = POISON_TOKEN
        if kind == "sampler":
            seeded = dict(temperature=0.8, top_k=POISON_TOP_K, seed=i)
        params = SamplingParams(max_new_tokens=rng.randrange(1, 40), ignore_eos=True, **seeded)
        jobs.append((rng.randrange(0, 150), kind, prompt, params))
    jobs.sort(key=lambda j: j[0])

    def run(with_poison: bool):
        engine = engine_for(path, **kw)
        poison_forward(engine)
        poison_sampler(engine)
        pending = [j for j in jobs if with_poison or j[1] == "ok"]
        ids, tokens, finals, step = {}, {}, {}, 0
        while pending or engine.has_unfinished():
            while pending and pending[0][0] <= step:
                _, kind, prompt, params = pending.pop(0)
                rid = engine.add_request(prompt, params)
                ids[rid] = (kind, tuple(prompt), params.seed)
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    finals[out.request_id] = out
            engine.block_manager.check_integrity()
            assert engine.healthy
            step += 1
        assert engine.block_manager.num_used_blocks == 0
        return engine, {ids[r]: (finals[r], tokens.get(r, [])) for r in ids}

    engine, poisoned = run(True)
    _, clean = run(False)
    assert engine.stats().num_preemptions > 0 and engine.num_request_faults >= 8
    assert engine.block_manager.hit_tokens > 0
    assert engine.last_error is None
    for key, (out, tokens) in poisoned.items():
        if key[0] == "ok":
            assert out.finish_reason == "length" and tokens == clean[key][1], key
        else:
            assert out.finish_reason == "error" and "request failed" in out.error, key
