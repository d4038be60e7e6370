"""Issue 19: one client must never hurt another. Each test here failed on the server before the
fix: surrogates that reset the connection, lax booleans, amplification by prompts x n and
abandoned choices, unbounded bodies, an API-key flag that left every route open."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import STORIES, needs_shared
from tests.entrypoints.test_server import MODEL, inproc_server

pytestmark = [needs_shared, pytest.mark.timeout(180)]
NORMAL = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}


def engine_idle(state, within_s: float) -> float | None:
    """Seconds until the engine has no running or waiting request, or None past the limit.
    Polls the engine's own counters: the abort is applied between two steps."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        s = state.async_engine.stats()
        if s.num_running == 0 and s.num_waiting == 0:
            return time.monotonic() - start
        time.sleep(0.02)
    return None


@pytest.fixture(scope="module")
def served():
    with inproc_server(max_concurrent_requests=200) as (base, state):
        yield base, state


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "stories260K", "prompt": "Once \\ud800 upon", "max_tokens": 4}',
        b'{"model": "stories260K", "prompt": ["ok", "\\udfff"], "max_tokens": 4}',
        b'{"model": "stories260K", "messages": [{"role": "user", "content": "a\\ud83d"}]}',
        b'{"model": "stories260K", "prompt": "a", "stop": ["\\ud800"]}',
    ],
    ids=["prompt", "prompt-list", "chat-content", "stop"],
)
def test_lone_surrogates_are_a_400_and_the_connection_survives(served, raw):
    base, _ = served
    with httpx.Client(base_url=base, timeout=30) as c:
        url = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        r = c.post(url, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "surrogate" in err["message"] and err["type"] == "invalid_request_error"
        assert c.post("/v1/completions", json=NORMAL).status_code == 200  # same connection


@pytest.mark.parametrize(
    "field,value",
    [
        ("stream", "yes"),
        ("stream", 1),
        ("echo", "true"),
        ("ignore_eos", "false"),
        ("max_tokens", "5"),
        ("max_tokens", True),
        ("n", 1.0),
        ("seed", "7"),
        ("temperature", "0.5"),
        ("model", 5),
    ],
)
def test_no_lax_coercion(served, field, value):
    base, _ = served
    r = httpx.post(f"{base}/v1/completions", json={**NORMAL, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_choices_are_bounded_per_request_and_counted_against_concurrency():
    with inproc_server(max_concurrent_requests=6, max_choices_per_request=8) as (base, state):
        r = httpx.post(f"{base}/v1/completions", json={**NORMAL, "prompt": ["a"] * 3, "n": 3})
        assert r.status_code == 400 and "--max-choices-per-request=8" in r.text
        ids = {**NORMAL, "prompt": [[1, 2]] * 10_000}  # rejected before any tokenizing
        assert httpx.post(f"{base}/v1/completions", json=ids).status_code == 400
        r = httpx.post(f"{base}/v1/completions", json={**NORMAL, "n": 7})
        assert r.status_code == 400 and "--max-concurrent-requests=6" in r.text
        with state.async_engine.paused():  # 4 choices admitted and held between steps
            held = httpx.AsyncClient(timeout=60)

            async def hold():
                return await held.post(
                    f"{base}/v1/completions", json={**NORMAL, "prompt": ["a", "b"], "n": 2}
                )

            loop = asyncio.new_event_loop()
            task = loop.create_task(hold())
            deadline = time.monotonic() + 10
            while state.in_flight < 4 and time.monotonic() < deadline:
                loop.run_until_complete(asyncio.sleep(0.01))  # until the server counted them
            assert state.in_flight == 4
            busy = httpx.post(f"{base}/v1/completions", json={**NORMAL, "n": 3})
            assert busy.status_code == 503  # 4 + 3 > 6: choices count, not HTTP requests
            ok_small = loop.create_task(held.post(f"{base}/v1/completions", json=NORMAL))
            loop.run_until_complete(asyncio.sleep(0.05))
        assert loop.run_until_complete(task).status_code == 200
        assert loop.run_until_complete(ok_small).status_code == 200  # 4 + 1 <= 6
        loop.run_until_complete(held.aclose())
        loop.close()
        assert state.in_flight == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_disconnect_stops_all_of_a_requests_work_at_once(served, stream):
    """128 choices that would each run 400 tokens; the client leaves as soon as the work has
    started. Every choice is aborted between two steps (not run to max_tokens)."""
    base, state = served
    body = {
        **NORMAL,
        "prompt": [f"Once upon a time {i}" for i in range(32)],
        "n": 4,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": stream,
    }

    async def leave_early():
        async with httpx.AsyncClient(timeout=60) as ac:
            if stream:
                async with ac.stream("POST", f"{base}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            return  # the first token arrived: hang up
            else:
                task = asyncio.ensure_future(ac.post(f"{base}/v1/completions", json=body))
                while state.async_engine.stats().num_generated_tokens == 0 or (
                    state.async_engine.stats().num_running == 0
                ):
                    await asyncio.sleep(0.01)
                task.cancel()  # closes the connection mid-request
                with pytest.raises(asyncio.CancelledError):
                    await task

    before = state.async_engine.stats().num_generated_tokens
    asyncio.run(leave_early())
    left = time.monotonic()
    waited = engine_idle(state, within_s=10)
    assert waited is not None, "abandoned choices kept running"
    generated = state.async_engine.stats().num_generated_tokens - before
    assert generated < 128 * 400 / 4, generated  # nowhere near running them to the end
    assert time.monotonic() - left < 10
    assert state.in_flight == 0
    assert httpx.post(f"{base}/v1/completions", json=NORMAL).status_code == 200


def test_huge_bodies_get_413_before_they_are_read(served):
    base, _ = served
    big = b'{"model": "stories260K", "prompt": "' + b"a" * (20 * 2**20) + b'"}'
    with httpx.Client(base_url=base, timeout=60) as c:
        r = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

        def chunks():  # no content-length: the limit holds while reading
            for _ in range(20):
                yield b" " * 2**20
            yield b"{}"

        r = httpx.post(f"{base}/v1/completions", content=chunks(), timeout=60)
        assert r.status_code == 413


def test_deep_nesting_and_nan_are_400(served):
    base, _ = served
    for raw in (b"[" * 100_000, b'{"model": "stories260K", "prompt": "a", "temperature": NaN}'):
        r = httpx.post(f"{base}/v1/completions", content=raw)
        assert r.status_code == 400, r.text


@pytest.mark.parametrize("keys", [[], [""], ["  "]], ids=["bare", "empty", "blank"])
def test_api_keys_without_a_key_refuse_to_start(keys):
    """A bare `--api-keys` or `--api-keys "$UNSET"` would serve every route unauthenticated."""
    out = subprocess.run(
        [sys.executable, "-m", "steadylm.entrypoints.cli", "serve", str(STORIES), "--api-keys"]
        + keys,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--api-keys" in out.stderr and "open" in out.stderr
    assert "Traceback" not in out.stderr
