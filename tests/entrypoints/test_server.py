"""End to end: a real `steadylm serve` process on a free loopback port, driven by the official
`openai` client and raw HTTP. Load with disconnects, a bad-input table, faults, SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import STORIES, needs_shared

pytestmark = [needs_shared, pytest.mark.timeout(300)]
MODEL = "stories260K"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            # Polling a socket for readiness: a server start has no other signal to wait on.
            time.sleep(0.2)
    raise TimeoutError("server did not become healthy")


def start_server(
    *extra: str, launcher: tuple[str, ...] = (), timeout: float = 60.0
) -> tuple[subprocess.Popen, str]:
    """`steadylm serve` on stories260K at a free port; `launcher`: python arguments before
    `-m steadylm.entrypoints.cli` (e.g. `-m torch.distributed.run ...`)."""
    port = free_port()
    cmd = [
        sys.executable,
        *launcher,
        "-m",
        "steadylm.entrypoints.cli",
        "--log-level",
        "WARNING",
        "serve",
        str(STORIES),
        "--server-port",
        str(port),
        "--block-size",
        "16",
        "--num-gpu-blocks",
        "512",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, proc, timeout)
    return proc, base


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def kv_used(base: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return float(re.search(r"^steadylm_kv_blocks_used (\S+)$", text, re.M).group(1))


def test_models_and_health(client, server):
    import openai

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("org/other-model")
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Once upon a time"}],
        max_tokens=12,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0


def test_completion_greedy_matches_pipeline(client):
    from steadylm import GenerationConfig, PytorchEngineConfig, pipeline

    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0
    )
    with pipeline(
        str(STORIES), backend_config=PytorchEngineConfig(num_gpu_blocks=64, block_size=16)
    ) as pipe:
        ref = pipe("Once upon a time", gen_config=GenerationConfig(max_new_tokens=30))
    assert r.choices[0].text == ref.text


def test_streaming_equals_non_streaming_with_usage(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Lily and Tom"}],
        max_tokens=40,
        temperature=0.9,
        seed=123,
    )
    whole = client.chat.completions.create(**kw)
    text, last, usage = "", None, None
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            last = chunk.choices[0].finish_reason or last
        if chunk.usage:
            usage = chunk.usage
    assert text == whole.choices[0].message.content
    assert last == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_seed_reproducible_and_n_choices(client):
    kw = dict(model=MODEL, prompt="The dog", max_tokens=25, temperature=1.0, seed=7)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    multi = client.completions.create(n=3, **kw)
    assert [c.index for c in multi.choices] == [0, 1, 2]
    assert multi.choices[0].text == a  # choice 0 uses the seed itself
    assert len({c.text for c in multi.choices}) > 1


def test_stop_sequences(client):
    base = (
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0
        )
        .choices[0]
        .text
    )
    stop = base[12:18]
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.index(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=40,
            temperature=0,
            stop=[stop],
            stream=True,
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Once"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(c.logprob <= 0 for c in content)
    assert all(len(c.top_logprobs) == 2 for c in content)
    # greedy: the chosen token is the most likely one, so it heads its top_logprobs
    assert all(c.top_logprobs[0].token == c.token for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


BAD = [  # (description, method, path, body or raw bytes, expected status, message fragment)
    ("malformed json", "raw", "/v1/completions", b'{"model": "x",', 400, "JSON"),
    ("invalid utf-8", "raw", "/v1/completions", b'{"model": "\xff\xfe", "prompt": "a"}', 400, ""),
    ("body not an object", "json", "/v1/completions", [1, 2, 3], 400, ""),
    ("empty body", "raw", "/v1/completions", b"", 400, ""),
    ("missing model", "json", "/v1/completions", {"prompt": "a"}, 400, "model"),
    ("missing prompt", "json", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("unknown model", "json", "/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404, "gpt-9"),
    ("empty prompt", "json", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
    ("empty prompt list", "json", "/v1/completions", {"model": MODEL, "prompt": []}, 400, ""),
    ("prompt wrong type", "json", "/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    (
        "token id out of vocab",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 99999]},
        400,
        "[0, 512)",
    ),
    ("negative token id", "json", "/v1/completions", {"model": MODEL, "prompt": [1, -5]}, 400, ""),
    (
        "prompt too long",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": [5] * 600},
        400,
        "session_len=512",
    ),
    (
        "max_tokens zero",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "max_tokens": 0},
        400,
        "max_tokens",
    ),
    (
        "max_tokens string",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "max_tokens": "ten"},
        400,
        "max_tokens",
    ),
    (
        "temperature negative",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "temperature": -1},
        400,
        "temperature",
    ),
    (
        "temperature huge",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "temperature": 1e308},
        400,
        "temperature",
    ),
    (
        "top_p zero",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "top_p": 0},
        400,
        "top_p",
    ),
    (
        "top_p above one",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "top_p": 1.5},
        400,
        "top_p",
    ),
    ("n zero", "json", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 0}, 400, "n"),
    ("n huge", "json", "/v1/completions", {"model": MODEL, "prompt": "a", "n": 10**9}, 400, "n"),
    (
        "seed too large",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "seed": 2**70},
        400,
        "seed",
    ),
    (
        "logprobs too many",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "logprobs": 50},
        400,
        "logprobs",
    ),
    (
        "stop wrong type",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "stop": 5},
        400,
        "stop",
    ),
    (
        "suffix unsupported",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "suffix": "b"},
        400,
        "suffix",
    ),
    (
        "presence penalty out of range",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "presence_penalty": 2.5},
        400,
        "presence_penalty",
    ),
    (
        "min_p above one",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "min_p": 3},
        400,
        "min_p",
    ),
    (
        "repetition_penalty zero",
        "json",
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    (
        "chat no messages",
        "json",
        "/v1/chat/completions",
        {"model": MODEL, "messages": []},
        400,
        "messages",
    ),
    (
        "chat bad role",
        "json",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "role",
    ),
    (
        "chat content wrong type",
        "json",
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": 42}]},
        400,
        "content",
    ),
    (
        "chat messages not a list",
        "json",
        "/v1/chat/completions",
        {"model": MODEL, "messages": "hi"},
        400,
        "messages",
    ),
    (
        "chat top_logprobs too many",
        "json",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 99,
        },
        400,
        "top_logprobs",
    ),
    ("unknown route", "json", "/v1/embeddings", {"model": MODEL, "input": "a"}, 404, ""),
    ("wrong method", "get", "/v1/completions", None, 405, ""),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_table(server, case):
    _, method, path, body, status, fragment = case
    url = server + path
    if method == "raw":
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    elif method == "get":
        r = httpx.get(url)
    else:
        r = httpx.post(url, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"] or fragment == (err["param"] or "")
    ok = httpx.post(
        f"{server}/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
    )
    assert ok.status_code == 200  # still serving after each bad request


def test_unknown_fields_are_ignored(server):
    r = httpx.post(
        f"{server}/v1/completions",
        json={"model": MODEL, "prompt": "a", "max_tokens": 2, "frobnicate": [1, 2]},
    )
    assert r.status_code == 200


def test_load_64_streams_with_random_disconnects(server):
    """64 concurrent streaming clients; every fourth hangs up early. The rest complete, the
    server stays healthy, and KV blocks in use return to zero."""
    import random

    rng = random.Random(0)
    plan = [(i, rng.randrange(1, 15) if i % 4 == 0 else None) for i in range(64)]

    async def one(ac: httpx.AsyncClient, i: int, cut: int | None):
        body = {
            "model": MODEL,
            "prompt": f"Once upon a time {i}",
            "max_tokens": 48,
            "temperature": 0.8,
            "seed": i,
            "ignore_eos": True,
            "stream": True,
        }
        chunks, done = 0, False
        async with ac.stream("POST", f"{server}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                chunks += 1
                if cut is not None and chunks >= cut:
                    return "cut", chunk
                last = chunk
        assert done
        return "done", last

    async def main():
        async with httpx.AsyncClient(timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i, cut) for i, cut in plan))

    results = asyncio.run(main())
    finished = [c for kind, c in results if kind == "done"]
    assert len(finished) == 48
    assert all(c["choices"][0]["finish_reason"] == "length" for c in finished)
    assert httpx.get(f"{server}/health").status_code == 200
    deadline = time.monotonic() + 10
    while kv_used(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)  # aborted requests free their blocks within one engine step
    assert kv_used(server) == 0


def aborted(base: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    m = re.search(r'^steadylm_requests_total\{finish_reason="abort"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_disconnect_aborts_and_frees_blocks(server):
    before = aborted(server)
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 480,
        "n": 16,
        "temperature": 0.7,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server}/v1/completions", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break  # hang up after the first chunk
    deadline = time.monotonic() + 10
    while (aborted(server) < before + 16 or kv_used(server) != 0) and time.monotonic() < deadline:
        time.sleep(0.05)  # the abort lands within one engine step
    assert aborted(server) == before + 16
    assert kv_used(server) == 0


def test_api_keys():
    proc, base = start_server("--api-keys", "k1", "k2")
    try:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
        bad = httpx.post(
            f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
        )
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        auth = {"Authorization": "Bearer k2"}
        assert httpx.post(f"{base}/v1/completions", json=body, headers=auth).status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200  # health needs no key
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@contextlib.contextmanager
def inproc_server(
    engine_kw: dict | None = None, model_dir: str = str(STORIES), name: str = MODEL, **state_kw
):
    """A real uvicorn on a real socket, in this process, so a test can reach the engine."""
    import uvicorn

    from steadylm.config import EngineConfig
    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.entrypoints.server.app import ServerState, build_app
    from steadylm.tokenizer import load_tokenizer

    config = EngineConfig(**{"num_gpu_blocks": 64, "block_size": 16, **(engine_kw or {})})
    tokenizer = load_tokenizer(model_dir)
    engine = LLMEngine.from_pretrained(model_dir, config, tokenizer)
    state = ServerState(engine, tokenizer, name, **state_kw)
    port = free_port()
    srv = uvicorn.Server(
        uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base)
        yield base, state
    finally:
        srv.should_exit = True
        thread.join(10)
        state.async_engine.shutdown()


def test_bounded_queue_answers_503_with_retry_after():
    with inproc_server(max_concurrent_requests=1) as (base, state):
        body = {"model": MODEL, "prompt": "a", "max_tokens": 4}
        result = {}
        with state.async_engine.paused():  # the engine is busy: request 1 waits to be admitted
            t = threading.Thread(
                target=lambda: result.update(
                    r=httpx.post(f"{base}/v1/completions", json=body, timeout=30)
                )
            )
            t.start()
            deadline = time.monotonic() + 10
            while state.in_flight == 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # until the server has counted request 1
            busy = httpx.post(f"{base}/v1/completions", json=body)
        t.join(30)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert "max-concurrent-requests=1" in busy.json()["error"]["message"]
        assert result["r"].status_code == 200  # the admitted one completes
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 200


def test_sigterm_finishes_running_requests_and_exits_zero():
    proc, base = start_server()
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 120,
        "ignore_eos": True,
        "temperature": 0,
    }
    result = {}

    def call():
        result["r"] = httpx.post(f"{base}/v1/completions", json=body, timeout=60)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 10
    while kv_used(base) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)  # wait until the request is running
    proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert proc.wait(timeout=60) == 0
    assert result["r"].status_code == 200
    assert result["r"].json()["choices"][0]["finish_reason"] == "length"


def test_engine_fault_reaches_the_client_and_server_keeps_serving():
    """A fault that persists through the per-request retry and the probe reaches the client
    as a 500 (or an error event in a stream); the server keeps serving."""
    from tests.engine.test_faults import FaultyForward

    with inproc_server() as (base, state):
        model = state.engine.runner.model
        model.forward = FaultyForward(model, {3, 4, 5})  # the step, the retry, the probe
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 10}
        r = httpx.post(f"{base}/v1/completions", json=body)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "internal_server_error"
        ok = httpx.post(f"{base}/v1/completions", json=body)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        c = model.forward.calls
        model.forward.fail_on = {c + 2, c + 3, c + 4}
        stream = httpx.post(f"{base}/v1/completions", json={**body, "stream": True}).text
        assert "injected fault" in stream and stream.rstrip().endswith("data: [DONE]")
        assert httpx.get(f"{base}/health").status_code == 200


def test_one_poisoned_request_fails_alone_and_health_holds():
    """Issue 19.2 over HTTP: requests whose values fail inside the engine's step, sent among
    six innocent ones, fail alone (500); the innocent ones get 200 with the tokens a clean
    server gives; /health stays 200 however many arrive."""
    from tests.engine.test_faults import POISON_TOP_K, poison_sampler

    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
    bad = {**body, "top_k": POISON_TOP_K, "temperature": 0.7, "seed": 3}
    with inproc_server() as (base, state):
        clean = httpx.post(f"{base}/v1/completions", json={**body, "temperature": 0}).json()
        poison_sampler(state.engine)

        async def main():
            async with httpx.AsyncClient(timeout=60) as ac:
                calls = [
                    ac.post(
                        f"{base}/v1/completions",
                        json=bad if i % 3 == 1 else {**body, "temperature": 0},
                    )
                    for i in range(9)
                ]
                return await asyncio.gather(*calls)

        results = asyncio.run(main())
        for i, r in enumerate(results):
            if i % 3 == 1:
                assert r.status_code == 500, r.text
                assert "request failed in the engine" in r.json()["error"]["message"]
            else:
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == clean["choices"][0]["text"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 200
        metrics = httpx.get(f"{base}/metrics").text
        assert "steadylm_request_faults 3.0" in metrics


def test_health_never_shows_the_fault_text_and_metrics_count_it():
    """Issue 19.7: /health is unauthenticated, so the cause stays in the log and /metrics."""
    from tests.engine.test_faults import FaultyForward

    with inproc_server() as (base, state):
        model = state.engine.runner.model
        model.forward = FaultyForward(model, always_from=1)
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 4}
        for _ in range(3):
            assert httpx.post(f"{base}/v1/completions", json=body).status_code == 500
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json() == {"status": "unhealthy"}
        metrics = httpx.get(f"{base}/metrics").text
        assert 'steadylm_engine_faults{type="RuntimeError"} 3.0' in metrics
        assert "steadylm_engine_healthy 0.0" in metrics


def test_cli_help_lists_engine_flags():
    out = subprocess.run(
        [sys.executable, "-m", "steadylm.entrypoints.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--server-port",
        "--session-len",
        "--quant-policy",
        "--enable-prefix-caching",
        "--gpu-memory-utilization",
        "--cache-max-entry-count",
        "--api-keys",
        "--max-concurrent-requests",
        "--tp",
        "--dtype",
    ):
        assert flag in out


def _families(base: str) -> dict:
    """/metrics parsed by prometheus-client's own parser: {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_under_vllm_names_count_each_request(client, server):
    """The default `--metrics-names both`: vLLM's series (labelled model_name / engine) beside
    ours, each moved by exactly one request's figures; parsed as a scraper parses them."""
    lab = (("engine", "0"), ("model_name", MODEL))
    before = _families(server)
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0
    )
    after = _families(server)

    def moved(name, extra=()):
        key = (name, tuple(sorted(lab + tuple(extra))))
        return after[key] - before.get(key, 0)

    assert r.choices[0].finish_reason == "length"
    assert moved("vllm:generation_tokens_total") == 7
    assert moved("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("vllm:request_success_total", [("finished_reason", "length")]) == 1
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert moved(f"vllm:{hist}_seconds_count") == 1, hist
    assert moved("vllm:inter_token_latency_seconds_count") == 6  # one per step after the first
    assert moved("vllm:request_generation_tokens_sum") == 7
    assert moved("vllm:request_params_max_tokens_sum") == 7
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert (f"vllm:{gauge}", lab) in after, gauge
    assert 0 <= after[("vllm:kv_cache_usage_perc", lab)] <= 1
    assert ("vllm:num_preemptions_total", lab) in after
    assert ("vllm:prefix_cache_queries_total", lab) in after
    assert ("steadylm_generation_tokens_total", ()) in after  # ours too


def test_metrics_names_and_the_default_deadline():
    """`--metrics-names vllm` serves vLLM's series only; `--request-timeout-s` is the deadline
    of a request that gives none (a billionth of a second: it ends before its first token)."""
    import signal

    from openai import OpenAI

    proc, base = start_server("--metrics-names", "vllm", "--request-timeout-s", "1e-9")
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30)
        names = {name for name, _ in _families(base)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert r.choices[0].finish_reason == "timeout" and r.choices[0].text == ""
    assert "vllm:num_requests_running" in names
    assert not [n for n in names if n.startswith("steadylm_")]


def test_priority_and_timeout_fields(client):
    """vLLM's `priority` needs --scheduling-policy priority (a 400 naming it, as vLLM); our
    `timeout` ends a request with its output so far."""
    import openai

    with pytest.raises(openai.BadRequestError, match="scheduling-policy priority"):
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=5, extra_body={"priority": 1}
        )
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=30, extra_body={"timeout": 1e-9}
    )
    assert r.choices[0].finish_reason == "timeout" and r.usage.completion_tokens == 0
    for bad in (0, -1, "5", True):
        with pytest.raises(openai.BadRequestError, match="timeout"):
            client.completions.create(
                model=MODEL, prompt="x", max_tokens=2, extra_body={"timeout": bad}
            )
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"  # the server is fine after all that
