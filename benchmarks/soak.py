"""Soak: a steady, bounded, mixed load on `steadylm serve` for N minutes, with the server's RSS.

Starts `steadylm serve MODEL` on a free loopback port, then `--concurrency` clients each send
one request after another until the time is up: completions and chat, streaming and not, n=2,
logprobs, stop strings, seeded sampling, clients that disconnect mid-stream or time out before
a non-streaming answer (the server aborts those), and a /metrics scrape now and then. Every
`--sample-s` seconds it reads the server's VmRSS from /proc/PID/status. At the end it stops the
server (SIGTERM) and reports the RSS at the end of warm-up (the first `--warmup-frac` of the run
is discarded), at the end, the least-squares slope in MB/min over the samples after warm-up,
and the request counts and errors. Stops by itself.

    python benchmarks/soak.py --minutes 30 --out soak.json
    python benchmarks/soak.py --minutes 2 --server-args "--num-gpu-blocks 512"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "stories260K"
WORDS = (
    "once upon a time there was a little girl named lily she loved to play outside in the sun "
    "one day her mom said the park is big and the dog ran fast because he was happy and tired"
).split()
KINDS = (
    "completion",
    "completion_stream",
    "chat",
    "chat_stream",
    "stream_disconnect",
    "timeout_disconnect",
    "metrics",
)
WEIGHTS = (5, 5, 4, 4, 2, 1, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (y - my) for t, y in points) / var


def start_server(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "steadylm.entrypoints.cli",
        "--log-level",
        "WARNING",
        "serve",
        model,
        "--server-name",
        "127.0.0.1",
        "--server-port",
        str(port),
        "--block-size",
        "16",
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


async def wait_healthy(client: httpx.AsyncClient, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-4000:]}")
        try:
            if (await client.get("/health", timeout=1.0)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)  # polling a starting server: it has no other ready signal
    raise TimeoutError("server did not become healthy")


def prompt_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))


def body_for(kind: str, rng: random.Random, model: str) -> tuple[str, dict]:
    chat = kind.startswith("chat")
    body: dict = {
        "model": model,
        "max_tokens": rng.randint(4, 64),
        "temperature": rng.choice((0.0, 0.7, 1.0)),
        "stream": kind.endswith("stream") or kind == "stream_disconnect",
    }
    if rng.random() < 0.3:
        body["n"] = 2
    if rng.random() < 0.3:
        body["stop"] = [rng.choice((" the", ".", " and"))]
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.3:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt_text(rng)}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt_text(rng)
    return "/v1/completions", body


class Load:
    def __init__(self, client: httpx.AsyncClient, model: str, deadline: float) -> None:
        self.client, self.model, self.deadline = client, model, deadline
        self.ok: Counter = Counter()
        self.errors: Counter = Counter()
        self.last_errors: list[str] = []

    def _error(self, kind: str, what: str) -> None:
        self.errors[kind] += 1
        self.last_errors = (self.last_errors + [f"{kind}: {what}"])[-10:]

    async def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.deadline:
            kind = rng.choices(KINDS, WEIGHTS)[0]
            try:
                await self.one(kind, rng)
            except (httpx.HTTPError, ValueError) as exc:
                self._error(kind, f"{type(exc).__name__}: {exc}")

    async def one(self, kind: str, rng: random.Random) -> None:
        if kind == "metrics":
            r = await self.client.get("/metrics")
            return self._count(kind, r.status_code == 200, r.text[:200])
        path, body = body_for(kind, rng, self.model)
        if kind == "timeout_disconnect":  # the client gives up; the server must abort it
            try:
                await self.client.post(path, json=body, timeout=0.02)
            except httpx.TimeoutException:
                pass
            return self._count(kind, True, "")
        if not body["stream"]:
            r = await self.client.post(path, json=body)
            ok = r.status_code == 200 and len(r.json()["choices"]) == body.get("n", 1)
            return self._count(kind, ok, r.text[:200])
        limit = 3 if kind == "stream_disconnect" else None
        await self.stream(kind, path, body, limit)

    async def stream(self, kind: str, path: str, body: dict, limit: int | None) -> None:
        events, done = 0, False
        async with self.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return self._count(kind, False, (await r.aread()).decode()[:200])
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                if '"error"' in line:
                    return self._count(kind, False, line[:200])
                events += 1
                if limit is not None and events >= limit:
                    return self._count(kind, True, "")  # leave early: closes the connection
        self._count(kind, done, "stream ended without [DONE]")

    def _count(self, kind: str, ok: bool, what: str) -> None:
        if ok:
            self.ok[kind] += 1
        else:
            self._error(kind, what)


async def sample_rss(pid: int, every: float, until: float, t0: float, out: list) -> None:
    while True:
        out.append((time.monotonic() - t0, rss_kb(pid) / 1024))
        if time.monotonic() >= until:
            return
        await asyncio.sleep(every)  # a sampling period, not a wait for an event


async def run(args: argparse.Namespace) -> dict:
    port = free_port()
    extra = shlex.split(args.server_args)
    proc = start_server(args.model, port, extra)
    name = os.path.basename(os.path.normpath(args.model))
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=120.0, limits=limits) as client:
            await wait_healthy(client, proc, 300.0)
            t0 = time.monotonic()
            deadline = t0 + args.minutes * 60
            load = Load(client, name, deadline)
            samples: list[tuple[float, float]] = []
            sampler = asyncio.create_task(
                sample_rss(proc.pid, args.sample_s, deadline, t0, samples)
            )
            await asyncio.gather(*(load.worker(args.seed + i) for i in range(args.concurrency)))
            await sampler
            samples.append((time.monotonic() - t0, rss_kb(proc.pid) / 1024))
            metrics = (await client.get("/metrics")).text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return report(args, extra, samples, load, metrics, proc.returncode)


def report(args, extra, samples, load: Load, metrics: str, returncode) -> dict:
    cut = samples[-1][0] * args.warmup_frac
    after = [(t, y) for t, y in samples if t >= cut]
    gen = [ln for ln in metrics.splitlines() if ln.startswith("steadylm_generation_tokens_total")]
    return {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "server_args": ["--block-size", "16", *extra],
        "warmup_frac": args.warmup_frac,
        "rss_mb_start": round(samples[0][1], 1),
        "rss_mb_warmup_end": round(after[0][1], 1),
        "rss_mb_end": round(samples[-1][1], 1),
        "rss_mb_max": round(max(y for _, y in samples), 1),
        "slope_mb_per_min": round(slope_per_min(after) or 0.0, 3),
        "num_samples": len(samples),
        "requests_ok": dict(load.ok),
        "requests_ok_total": sum(load.ok.values()),
        "errors": dict(load.errors),
        "errors_total": sum(load.errors.values()),
        "last_errors": load.last_errors,
        "generation_tokens": float(gen[0].split()[1]) if gen else None,
        "server_exit_code": returncode,
        "rss_samples": [(round(t, 1), round(y, 1)) for t, y in samples],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--warmup-frac", type=float, default=0.2, help="share of the run discarded")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="extra `steadylm serve` flags, one string")
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=2))
    if args.out:  # with every (seconds, MB) sample
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 1 if result["errors_total"] else 0


if __name__ == "__main__":
    sys.exit(main())
