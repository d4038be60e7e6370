"""Completions' `echo` with prompt logprobs (computed in the same engine pass as the request's
prefill), and lm-evaluation-harness's `local-completions` model running a loglikelihood task
and a generate_until task against a real `steadylm serve`, data and tokenizer local."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import STORIES, needs_shared
from tests.entrypoints.test_server import MODEL

pytestmark = [needs_shared, pytest.mark.timeout(300)]
TASKS = Path(__file__).resolve().parent / "lm_eval_task"


@functools.cache
def scorer():
    """steadylm's own scoring (what get_ppl uses): logits of every position, paged cache."""
    from steadylm.config import EngineConfig
    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.tokenizer import load_tokenizer

    tok = load_tokenizer(str(STORIES))
    config = EngineConfig(num_gpu_blocks=64, block_size=16)
    return tok, LLMEngine.from_pretrained(str(STORIES), config, tok)


def engine_logprobs(ids: list[int]) -> list[float]:
    """log P(ids[j] | ids[:j]) for j >= 1."""
    _, engine = scorer()
    lp = torch.log_softmax(engine.score(ids).float(), dim=-1)
    return [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]


def test_echo_returns_the_prompt_and_its_logprobs(server):
    tok, _ = scorer()
    ids = tok.encode("Once upon a time there was a little girl")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 2}
    body.update(temperature=0)
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    c = r["choices"][0]
    lp = c["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == n + 3 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and all(lp["top_logprobs"][1:])
    assert lp["token_logprobs"][1:n] == pytest.approx(engine_logprobs(ids), abs=1e-4)
    assert "".join(lp["tokens"]) == c["text"]  # prompt text, then the completion
    assert c["text"].startswith(tok.decode(ids))
    assert lp["text_offset"][n] == len(tok.decode(ids))
    assert r["usage"]["completion_tokens"] == 3 and r["usage"]["prompt_tokens"] == n
    for k in range(1, n):  # the top entries are the best ones, the greedy token among them
        assert max(lp["top_logprobs"][k].values()) >= lp["token_logprobs"][k] - 1e-6
    # echo without logprobs: the text only; streamed: the prompt comes in the first chunk
    plain = httpx.post(
        f"{server}/v1/completions", json={**body, "logprobs": None}, timeout=60
    ).json()
    assert plain["choices"][0]["text"] == c["text"] and plain["choices"][0]["logprobs"] is None
    with httpx.stream(
        "POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(e)["choices"][0] for e in events]
    assert "".join(ch["text"] for ch in chunks) == c["text"]
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None


def run_lm_eval(base: str, tasks: list[str], tmp_path, monkeypatch) -> dict:
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (.ci/run has it)")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # datasets' arrow cache
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{base}/v1/completions",
            "model": MODEL,
            "tokenizer": str(STORIES),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,  # prompts as token ids: lm-eval's ctxlen stays exact
            "add_bos_token": True,  # stories260K's prompts start with BOS
            "num_concurrent": 1,
            "max_retries": 1,
            "max_length": 512,
            "timeout": 60,
        },
        tasks=tasks,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )


def test_lm_eval_loglikelihood_equals_engine_scoring(server, tmp_path, monkeypatch):
    out = run_lm_eval(server, ["steadylm_mc"], tmp_path, monkeypatch)
    assert out["results"]["steadylm_mc"]["acc,none"] == 1.0
    tok, _ = scorer()
    checked = 0
    for sample in out["samples"]["steadylm_mc"]:
        for (context, continuation), (ll, _greedy) in zip(
            sample["arguments"], sample["filtered_resps"]
        ):
            whole = tok.encode(context + continuation)  # as lm-eval splits the pair
            ctx = len(tok.encode(context))
            want = sum(engine_logprobs(whole)[ctx - 1 :])
            assert ll == pytest.approx(want, abs=1e-4), (context, continuation)
            checked += 1
    assert checked == 15


def test_lm_eval_generate_until(server, tmp_path, monkeypatch):
    out = run_lm_eval(server, ["steadylm_gen"], tmp_path, monkeypatch)
    assert out["results"]["steadylm_gen"]["exact_match,none"] == 1.0, out["samples"]


def test_echo_gives_a_text_prompt_back_as_sent_and_forced_tokens_stay_json(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "echo": True}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"].startswith("Once upon a time")
    # a grammar that completes while min_tokens bans EOS: the grammar wins, the request ends,
    # and the forced token's logprob (-inf under the ban) is still a JSON number
    body = {
        "model": MODEL,
        "prompt": "Once",
        "guided_choice": ["yes", "no"],
        "min_new_tokens": 6,
        "logprobs": 1,
        "max_tokens": 20,
    }
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["text"] in ("yes", "no") and c["finish_reason"] == "stop"
    assert all(v >= -9999.0 for v in c["logprobs"]["token_logprobs"])
