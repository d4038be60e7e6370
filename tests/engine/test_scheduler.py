"""The scheduler never stalls: admission, chunking, preemption by recompute, clear errors."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from steadylm.engine.request import SamplingParams
from steadylm.errors import RequestError
from tests.conftest import STORIES, engine_for, needs_shared, run_to_end

SEED_SAMPLING = dict(top_p=0.8, top_k=40, temperature=0.8)


def solo(path, prompt, params, **kw):
    return engine_for(path, **kw).generate([prompt], params)[0].output_token_ids


@needs_shared
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sampling", [True, False], ids=["sampled", "greedy"])
def test_seed_scenario_two_long_generations_fill_the_pool(sampling):
    """LMDeploy's failure: two long answers fill the KV cache. Here both finish."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    prompt = tok.encode("Once upon a time, there was a little girl named Lily.")
    kw = dict(block_size=8, num_gpu_blocks=24)  # 192 tokens for two 30000-token asks
    params = [
        SamplingParams(
            max_new_tokens=30000, seed=s, ignore_eos=True, **(SEED_SAMPLING if sampling else {})
        )
        for s in (1, 2)
    ]
    engine = engine_for(str(STORIES), **kw)
    assert engine.session_len == 192  # clamped to the pool
    reqs = [engine.requests[engine.add_request(prompt, p)] for p in params]
    run_to_end(engine)
    assert engine.stats().num_preemptions > 0
    for r in reqs:
        assert r.finish_reason == "length" and r.num_tokens == 192
    assert engine.block_manager.num_used_blocks == 0
    if not sampling:
        alone = solo(str(STORIES), prompt, params[0], **kw)
        assert [r.output_token_ids for r in reqs] == [alone, alone]
    else:  # a seeded request gives the same tokens whatever preemption did to it
        assert reqs[0].output_token_ids == solo(str(STORIES), prompt, params[0], **kw)


@needs_shared
def test_seed_scenario_with_eos_finishes_with_right_reasons():
    engine = engine_for(str(STORIES), block_size=8, num_gpu_blocks=24)
    params = SamplingParams(max_new_tokens=30000, seed=7, **SEED_SAMPLING)
    reqs = engine.generate([[1, 403, 407, 261, 378]] * 2, params)
    for r in reqs:
        assert r.finish_reason in ("stop", "length")
        assert r.finish_reason == "length" or r.output_token_ids[-1] in (1, 2)


def test_session_len_clamped_to_capacity_with_one_log_line(model_dirs, caplog):
    _, path = model_dirs("llama")
    with caplog.at_level(logging.WARNING, logger="steadylm"):
        engine = engine_for(path, session_len=1000, num_gpu_blocks=10, block_size=4)
    assert engine.session_len == 40
    lines = [r.getMessage() for r in caplog.records if "session_len" in r.getMessage()]
    assert len(lines) == 1 and "1,000" in lines[0] and "40" in lines[0]
    assert "gpu_memory_utilization" in lines[0]


def test_sequence_grows_to_exactly_the_pool(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path, num_gpu_blocks=8, block_size=4)
    req = engine.generate([[5] * 5], SamplingParams(max_new_tokens=10_000, ignore_eos=True))[0]
    assert req.num_tokens == 32 and req.finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("block_size,num_blocks", [(1, 40), (128, 2)])
def test_extreme_block_sizes_match_solo(model_dirs, block_size, num_blocks):
    _, path = model_dirs("qwen2")
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ps = [[7, 8, 9, 10, 11], [20, 21, 22]]
    expected = [solo(path, p, params) for p in ps]
    engine = engine_for(path, num_gpu_blocks=num_blocks, block_size=block_size)
    reqs = [engine.requests[engine.add_request(p, params)] for p in ps]
    run_to_end(engine)
    assert [r.output_token_ids for r in reqs] == [
        e[: r.num_output_tokens] for r, e in zip(reqs, expected)
    ]
    if block_size == 1:
        assert engine.stats().num_preemptions > 0


def test_prompt_at_session_len_is_rejected_naming_both_numbers(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path, session_len=16)
    with pytest.raises(RequestError, match=r"16 tokens.*session_len=16"):
        engine.add_request(list(range(3, 19)), SamplingParams())
    rid = engine.add_request(list(range(3, 18)), SamplingParams(max_new_tokens=100))
    req = engine.requests[rid]
    run_to_end(engine)
    assert req.num_output_tokens == 1 and req.finish_reason == "length"


def test_prompt_longer_than_kv_capacity_is_rejected(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path, num_gpu_blocks=2, block_size=4, session_len=8)
    with pytest.raises(RequestError, match="session_len=8"):
        engine.add_request(list(range(3, 12)), SamplingParams())


def test_empty_and_out_of_vocab_prompts_are_clear_errors(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(RequestError, match=r"\[0, 97\)"):
        engine.add_request([1, 500], SamplingParams())
    with pytest.raises(RequestError, match="tokenizer"):
        engine.add_request("text without a tokenizer", SamplingParams())


def test_token_budget_chunks_long_prompts_and_is_shared(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path, max_prefill_token_num=8)
    engine.add_request([4] * 30, SamplingParams(max_new_tokens=4))
    engine.add_request([5] * 3, SamplingParams(max_new_tokens=4))
    totals = []
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        totals.append(out.num_tokens)
        assert out.num_tokens <= 8
        engine.scheduler.update(out, engine.execute(out))
    assert totals[:4] == [8, 8, 8, 8]


def test_waiting_reasons_are_reported(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path, max_batch_size=1)
    engine.add_request([4, 5], SamplingParams(max_new_tokens=3))
    rid = engine.add_request([4, 6], SamplingParams(max_new_tokens=3))
    engine.step()
    assert engine.requests[rid].wait_reason == "max_batch_size"
    run_to_end(engine)


def test_empty_step_is_legal(model_dirs):
    _, path = model_dirs("llama")
    engine = engine_for(path)
    assert engine.step() == []
    assert engine.stats().num_steps == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "caching,quant",
    [(False, 0), (True, 0), (True, 8), (True, 4)],
    ids=["plain", "prefix", "prefix+int8", "prefix+int4"],
)
def test_randomized_arrivals_aborts_and_preemptions(model_dirs, caching, quant):
    """Thousands of steps on a tight pool: integrity after every step, every request ends,
    greedy outputs equal solo runs, no block leaks. Prompts share prefixes, so with prefix
    caching on, hits, shared blocks and evictions all happen under preemption."""
    _, path = model_dirs("llama")
    rng = random.Random(1234)
    engine = engine_for(
        path,
        num_gpu_blocks=24,
        block_size=4,
        max_prefill_token_num=12,
        max_batch_size=6,
        enable_prefix_caching=caching,
        quant_policy=quant,
    )
    prefixes = [[rng.randrange(3, 97) for _ in range(24)] for _ in range(4)]
    pending = []
    for _ in range(150):
        head = rng.choice(prefixes)[: rng.randrange(0, 24)]
        prompt = head + [rng.randrange(3, 97) for _ in range(rng.randrange(1, 16))]
        params = SamplingParams(max_new_tokens=rng.randrange(1, 50), ignore_eos=True)
        pending.append((rng.randrange(0, 3000), prompt, params))
    pending.sort(key=lambda x: x[0])
    live, done, aborted, step = {}, {}, set(), 0
    tokens: dict[str, list[int]] = {}
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            rid = engine.add_request(prompt, params)
            live[rid] = (prompt, params)
        if live and rng.random() < 0.01:
            rid = rng.choice(sorted(live))
            if engine.abort(rid):
                aborted.add(rid)
                live.pop(rid)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = out
        engine.block_manager.check_integrity()
        step += 1
        assert step < 20_000
    assert step > 2500  # thousands of steps
    assert engine.stats().num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0 and not engine.block_manager.req_blocks
    finished = {rid: v for rid, v in live.items() if rid not in aborted}
    assert set(finished) <= set(done)
    assert all(done[r].finish_reason == "length" for r in finished)
    # Compare a sample of requests with solo runs (greedy must be unaffected by batching).
    for rid in sorted(finished)[:: max(1, len(finished) // 20)]:
        prompt, params = finished[rid]
        assert tokens[rid] == solo(path, prompt, params, quant_policy=quant)
    if caching:
        assert engine.block_manager.hit_rate > 0.05


@pytest.mark.timeout(120)
@pytest.mark.parametrize("quant", [0, 8, 4], ids=["fp", "int8", "int4"])
def test_output_is_independent_of_chunks_batching_preemption_and_cache_hits(model_dirs, quant):
    """A request's greedy tokens equal those of a solo unchunked run, whatever chunk size,
    batch, preemption (recompute) and prefix-cache hits it met. With a quantized cache one ulp
    in a recomputed K can move an int4 code, so there every token's K/V and attention must be
    computed the same way in a prefill chunk as in a decode step: the logprobs are compared
    bit for bit too (the native kernels' promise; the unquantized path runs SDPA for prefill,
    whose rows differ from decode's in the last ulps)."""
    from steadylm import kernels

    if quant and kernels.native_paged_attention(torch.float32, torch.device("cpu")) is None:
        pytest.skip(f"bit-exact batch invariance is the native kernels' ({kernels.status()})")
    _, path = model_dirs("qwen2")  # untied lm_head (oneDNN, row-invariant), qkv biases
    rng = random.Random(7)
    shared = [rng.randrange(3, 97) for _ in range(16)]
    prompts = [
        shared[: rng.randrange(8, 17)] + [rng.randrange(3, 97) for _ in range(n)]
        for n in (3, 9, 14)
    ]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=2 if quant else None)

    def run(engine, ps):
        return [(r.output_token_ids, r.output_logprobs) for r in engine.generate(ps, params)]

    alone = [run(engine_for(path, quant_policy=quant), [p])[0] for p in prompts]
    for chunk in (5, 16):
        engine = engine_for(
            path,
            quant_policy=quant,
            enable_prefix_caching=True,
            max_prefill_token_num=chunk,
            num_gpu_blocks=14,
            block_size=4,
        )
        for _ in range(2):  # the second round starts from the first round's cached blocks
            assert run(engine, prompts) == alone, f"max_prefill_token_num={chunk}"
        assert engine.stats().num_preemptions > 0
        assert engine.block_manager.hit_rate > 0.2
