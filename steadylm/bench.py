"""`steadylm bench`: offline throughput and serving benchmarks, with vLLM's metric definitions.

offline  N requests with fixed input/output lengths (random token ids, EOS ignored), all
         submitted at once to an in-process engine.
serve    against a running `steadylm serve`: streaming /v1/completions at a concurrency or a
         Poisson request rate. TTFT; TPOT = (latency - TTFT) / (output tokens - 1); ITL (gaps
         between streamed chunks); end-to-end latency; output and total tokens/s; preemptions
         (from /metrics).
Each run prints a table and can write JSON; medians and spreads over --runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any

from steadylm.errors import ConfigError

WORKLOADS = {  # name -> list of (num_prompts, input_len, output_len)
    "W1": [(16, 256, 128)],
    "W2": [(1, 256, 128)],
    "sweep": [(n, 256, 128) for n in (1, 4, 16, 64)],
    # how cost grows with context: single-stream decode after a prompt of 256 ... 16k tokens,
    # one 4k-token prefill (time to first token), and W1 with 4k-token prompts
    "context": [(1, c, 64) for c in (256, 2048, 8192, 16384)],
    "prefill4k": [(1, 4096, 1)],
    "W1-4k": [(16, 4096, 128)],
}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def offline_once(
    engine, num_prompts: int, input_len: int, output_len: int, seed: int = 0
) -> dict[str, float]:
    from steadylm import parallel
    from steadylm.engine.request import SamplingParams

    prompts = random_prompts(num_prompts, input_len, engine.model_config.vocab_size, seed)
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    preempt0 = engine.stats().num_preemptions
    engine.step_log.clear()
    comm0 = parallel.comm_seconds()
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    comm = {k: v - comm0.get(k, 0.0) for k, v in parallel.comm_seconds().items()}
    steps = max(1, len(engine.step_log))
    decode = [r for r in engine.step_log if r.num_tokens == r.num_seqs and r.num_seqs]
    step_s = sum(r.seconds for r in decode)
    ttft = [r.first_token_time - r.arrival_time for r in reqs]
    dec_tps = [
        (r.num_output_tokens - 1) / (r.finish_time - r.first_token_time)
        for r in reqs
        if r.num_output_tokens > 1 and r.finish_time > r.first_token_time
    ]
    return {
        "elapsed_s": elapsed,
        "output_tokens_per_s": num_prompts * output_len / elapsed,
        "total_tokens_per_s": num_prompts * (input_len + output_len) / elapsed,
        "ttft_s": statistics.median(ttft),
        "decode_tokens_per_s_per_request": statistics.median(dec_tps) if dec_tps else 0.0,
        "decode_step_ms": 1000 * statistics.median([r.seconds for r in decode]) if decode else 0,
        "non_model_overhead": 1 - sum(r.model_seconds for r in decode) / step_s if step_s else 0,
        "preemptions": engine.stats().num_preemptions - preempt0,
        # tp > 1, rank 0: ms per step inside the model's all-reduces, and in the broadcast of
        # the step's call to the workers (0 at tp=1)
        "allreduce_ms_per_step": 1000 * comm.get("all_reduce", 0.0) / steps,
        "broadcast_ms_per_step": 1000 * comm.get("broadcast", 0.0) / steps,
    }


def summarize(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {}
    for key in runs[0]:
        vals = [r[key] for r in runs]
        out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def print_table(title: str, rows: list[tuple[str, dict]]) -> None:
    print(f"\n{title}")
    keys = list(rows[0][1])
    print("| workload | " + " | ".join(keys) + " |")
    print("| --- |" + " ---: |" * len(keys))
    for name, summary in rows:
        cells = []
        for k in keys:
            s = summary[k]
            cells.append(f"{s['median']:.4g} ({s['min']:.4g}-{s['max']:.4g})")
        print(f"| {name} | " + " | ".join(cells) + " |")


def run_offline(args) -> dict:
    import torch

    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.entrypoints.cli import engine_config_from_args

    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = _shapes(args)
    engine = LLMEngine.from_pretrained(args.model, engine_config_from_args(args))
    results = []
    try:
        for n, i, o in shapes:
            # warm-up; prompts of at most 256 tokens (a 16k one costs minutes, warms nothing more)
            offline_once(engine, min(n, 2), min(i, 256), min(o, 8), seed=999)
            runs = [offline_once(engine, n, i, o, seed=r) for r in range(args.runs)]
            results.append((f"{n} x {i} -> {o}", summarize(runs)))
        spec = engine.stats().spec_decode
    finally:
        engine.shutdown()
    print_table(
        f"steadylm offline ({args.model}, torch threads {torch.get_num_threads()})", results
    )
    out = {"engine": "steadylm", "mode": "offline", "results": dict(results)}
    if spec is not None:  # over the whole run, warm-ups included
        out["spec_decode"] = {
            "acceptance_rate": spec.acceptance_rate,
            "mean_acceptance_length": spec.mean_acceptance_length,
            "num_drafts": spec.num_drafts,
            "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
        }
        print(
            f"speculative decoding: acceptance {100 * spec.acceptance_rate:.1f}%, mean accepted "
            f"length {spec.mean_acceptance_length:.2f} over {spec.num_drafts} drafts"
        )
    return out


LENGTH_DEFAULTS = {"num_prompts": 16, "input_len": 256, "output_len": 128}


def _shapes(args) -> list[tuple[int, int, int]]:
    """The workload's (prompts, input, output) shapes; a named workload fixes all three, so
    setting one as well is an error, not a flag silently ignored."""
    given = [k for k in LENGTH_DEFAULTS if getattr(args, k) is not None]
    if args.workload:
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ConfigError(
                f"--workload {args.workload} fixes the prompt count and lengths "
                f"({', '.join(f'{n} x {i} -> {o}' for n, i, o in WORKLOADS[args.workload])}); "
                f"drop {flags} or --workload",
                param="workload",
            )
        return WORKLOADS[args.workload]
    n, i, o = (getattr(args, k) or d for k, d in LENGTH_DEFAULTS.items())
    return [(n, i, o)]


async def _one_request(client, url: str, body: dict) -> dict[str, Any]:
    t0 = time.perf_counter()
    first, last, gaps, n_out = None, None, [], 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:300]
            return {"error": f"HTTP {resp.status_code}: {detail}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n_out = chunk["usage"]["completion_tokens"]
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "latency": end - t0, "itl": gaps, "output_tokens": n_out}


async def _serve_once(args, prompts: list[list[int]]) -> dict[str, float]:
    import httpx

    url = args.base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(args.concurrency or len(prompts))
    rng = random.Random(args.seed)

    async def fire(client, ids, delay):
        await asyncio.sleep(delay)  # the arrival schedule of the workload, not a sync
        async with sem:
            body = {
                "model": args.served_model_name,
                "prompt": ids,
                "max_tokens": args.output_len,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            return await _one_request(client, url, body)

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if args.request_rate:
            t += rng.expovariate(args.request_rate)
    preempt0 = _preemptions(args.base_url)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=None) as client:
        res = await asyncio.gather(*(fire(client, p, d) for p, d in zip(prompts, delays)))
    elapsed = time.perf_counter() - t0
    ok = [r for r in res if "error" not in r]
    errors = [r["error"] for r in res if "error" in r]
    if not ok:  # nothing to time: the figures would be medians of nothing
        return {"completed": 0, "failed": len(res), "first_error": errors[0]}
    out_tokens = sum(r["output_tokens"] for r in ok)
    tpot = [
        (r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1
    ]
    itl = [g for r in ok for g in r["itl"]]
    return {
        "completed": len(ok),
        "failed": len(res) - len(ok),
        "elapsed_s": elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + len(ok) * args.input_len) / elapsed,
        "ttft_ms_median": 1000 * statistics.median(r["ttft"] for r in ok),
        "tpot_ms_median": 1000 * statistics.median(tpot) if tpot else 0.0,
        "itl_ms_median": 1000 * statistics.median(itl) if itl else 0.0,
        "e2e_ms_median": 1000 * statistics.median(r["latency"] for r in ok),
        "preemptions": _preemptions(args.base_url) - preempt0,
        **({"first_error": errors[0]} if errors else {}),
    }


def _preemptions(base_url: str) -> float:
    import httpx

    text = httpx.get(base_url.rstrip("/") + "/metrics").text
    for line in text.splitlines():
        if line.startswith("steadylm_num_preemptions "):
            return float(line.split()[1])
    return 0.0


def run_serve(args) -> dict:
    import logging

    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    models = httpx.get(args.base_url.rstrip("/") + "/v1/models").json()["data"]
    args.served_model_name = models[0]["id"]
    # The server's vocabulary (steadylm's /v1/models says it; other servers: --vocab-size),
    # so every prompt token is one the model has.
    vocab = args.vocab_size or models[0].get("vocab_size")
    if not vocab:
        raise ConfigError(
            f"{args.base_url}/v1/models does not give the vocabulary size: pass --vocab-size",
            param="vocab_size",
        )
    runs = []
    for r in range(args.runs):
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=r)
        runs.append(asyncio.run(_serve_once(args, prompts)))
    name = (
        f"{args.num_prompts} x {args.input_len} -> {args.output_len}, concurrency "
        f"{args.concurrency or 'all'}, rate {args.request_rate or 'inf'}"
    )
    failed = [run for run in runs if run["failed"]]
    for run in failed:
        print(
            f"{run['failed']} of {run['failed'] + run['completed']} requests failed; the first: "
            f"{run['first_error']}",
            file=sys.stderr,
        )
    timed = [
        {k: v for k, v in run.items() if k != "first_error"} for run in runs if run["completed"]
    ]
    summary = summarize(timed) if timed else {}
    if timed:
        print_table(f"steadylm serving ({args.base_url})", [(name, summary)])
    return {
        "engine": "steadylm",
        "mode": "serve",
        "results": {name: summary},
        "failed_requests": sum(run["failed"] for run in runs),
    }


def add_parser(sub, add_engine_flags) -> None:
    p = sub.add_parser("bench", help="offline throughput or serving benchmark")
    bsub = p.add_subparsers(dest="bench_mode", required=True)
    off = bsub.add_parser("offline", help="in-process throughput, fixed lengths, EOS ignored")
    off.add_argument("--model", required=True)
    off.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default=None,
        help="W1 (16x256->128), W2 (1x256->128), sweep (concurrency 1/4/16/64), context "
        "(1 stream decoding after 256 / 2k / 8k / 16k prompt tokens), prefill4k (one 4k-token "
        "prompt), W1-4k (16x4096->128)",
    )
    off.add_argument("--threads", type=int, default=None, help="torch threads")
    srv = bsub.add_parser("serve", help="against a running steadylm serve")
    srv.add_argument("--base-url", default="http://127.0.0.1:23333")
    srv.add_argument("--concurrency", type=int, default=None)
    srv.add_argument("--request-rate", type=float, default=None, help="requests/s (Poisson)")
    srv.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="prompt token ids are drawn below this (default: the server's vocabulary)",
    )
    srv.add_argument("--seed", type=int, default=0)
    for q in (off, srv):
        for key, default in LENGTH_DEFAULTS.items():
            q.add_argument(
                "--" + key.replace("_", "-"),
                type=int,
                default=None,
                help=f"default {default}; a named --workload sets its own",
            )
        q.add_argument("--runs", type=int, default=3)
        q.add_argument("--json", default=None, help="write the results here")
    add_engine_flags(off)


def run(args: argparse.Namespace) -> int:
    if args.bench_mode == "serve":
        for key, default in LENGTH_DEFAULTS.items():  # no named workloads when serving
            setattr(args, key, getattr(args, key) or default)
    result = run_offline(args) if args.bench_mode == "offline" else run_serve(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if result.get("failed_requests") else 0
