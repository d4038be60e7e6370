"""The step contract (issue 16): the runner sees the scheduler only through plain data that
pickles small, new requests are sent whole once and then only as differences, and the runner's
module imports neither `Request` nor `BlockManager`."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import torch

from steadylm.engine.request import SamplingParams
from steadylm.engine.step import CachedRequestData, NewRequestData, StepContract
from tests.conftest import engine_for

RUNNER = Path(__file__).resolve().parents[2] / "steadylm" / "engine" / "model_runner.py"


def test_the_runner_module_imports_neither_request_nor_block_manager():
    tree = ast.parse(RUNNER.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported |= {(node.module, a.name) for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {(a.name, None) for a in node.names}
    modules = {m for m, _ in imported}
    names = {n for _, n in imported}
    assert "Request" not in names and "BlockManager" not in names
    assert "steadylm.engine.block_manager" not in modules
    assert "steadylm.engine.scheduler" not in modules


def test_contracts_carry_differences_and_round_trip_through_pickle(model_dirs):
    """Drive a real engine and capture every contract: each pickles and unpickles equal, a
    request appears as new once (again only after a preemption), and a decode step carries
    one new token and at most one new block per request."""
    _, path = model_dirs("llama")
    engine = engine_for(path, num_gpu_blocks=12, block_size=4, max_prefill_token_num=8)
    seen: list[StepContract] = []
    execute = engine.runner.execute

    def capture(contract):
        seen.append(contract)
        return execute(contract)

    engine.runner.execute = capture
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ids = [engine.add_request([5 + i] * 9, params) for i in range(3)]
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_preemptions > 0
    news = {rid: 0 for rid in ids}
    preempted = {rid: 0 for rid in ids}
    for c in seen:
        blob = pickle.dumps(c)
        assert pickle.loads(blob) == c
        assert len(blob) < 2000
        for r in c.new:
            assert isinstance(r, NewRequestData)
            news[r.request_id] += 1
        for rid in c.preempted_ids:
            preempted[rid] += 1
        for r in c.cached:
            assert isinstance(r, CachedRequestData)
            if r.num_new_tokens == 1:
                assert len(r.new_token_ids) <= 1 and len(r.new_block_ids) <= 1
    assert all(news[rid] == 1 + preempted[rid] for rid in ids)
    assert sum(preempted.values()) > 0
    finished = {rid for c in seen for rid in c.finished_ids}
    assert finished <= set(ids)
    assert engine.runner.requests == {}  # every request's runner state was released


def test_decode_step_inputs_are_the_general_paths(model_dirs):
    """A decode-only step's inputs come from `_prepare_decode` (Python lists, fewer torch
    ops); they must equal what the general `_prepare_mixed` builds for the same rows: ids,
    positions, slots, block tables (ragged, padded with 0), context and query lengths."""
    from steadylm.engine.model_runner import _Row

    _, path = model_dirs("llama")
    engine = engine_for(path, block_size=4)
    lengths = [3, 9, 4, 14]  # ends inside, at and past block edges
    for n in lengths:
        engine.add_request(list(range(5, 5 + n)), SamplingParams(max_new_tokens=8, ignore_eos=True))
    for _ in range(3):  # the prompts, then decodes
        engine.step()
    runner = engine.runner
    order = [_Row(req, 1) for req in runner.requests.values()]
    assert len({len(r.req.block_ids) for r in order}) > 1  # ragged tables
    fast, general = runner._prepare_decode([r.req for r in order]), runner._prepare_mixed(order)
    for a, b in zip(fast[:2], general[:2]):
        assert torch.equal(a, b)
    md_a, md_b = fast[2], general[2]
    assert torch.equal(md_a.slot_mapping, md_b.slot_mapping)
    assert (md_a.block_size, md_a.sliding_window) == (md_b.block_size, md_b.sliding_window)
    (ga,), (gb,) = md_a.groups, md_b.groups
    for name in ("block_tables", "context_lens", "query_lens"):
        assert torch.equal(getattr(ga, name), getattr(gb, name)), name
        assert torch.equal(ga.host(name), gb.host(name)), name
    assert (ga.token_start, ga.token_end, ga.max_query_len, ga.max_context_len) == (
        gb.token_start,
        gb.token_end,
        gb.max_query_len,
        gb.max_context_len,
    )
