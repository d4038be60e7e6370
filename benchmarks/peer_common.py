"""What the peer scripts share: the workloads, 3-run summaries and the JSON they write. Plain
Python, so it runs in each peer's own venv (the scripts do not import steadylm)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

# The same shapes as steadylm.bench.WORKLOADS (tests/test_bench.py checks they agree).
WORKLOADS = {
    "W1": [(16, 256, 128)],
    "W2": [(1, 256, 128)],
    "sweep": [(n, 256, 128) for n in (1, 4, 16, 64)],
    # how cost grows with context: single-stream decode after a prompt of 256 ... 16k tokens,
    # one 4k-token prefill (time to first token), and W1 with 4k-token prompts
    "context": [(1, c, 64) for c in (256, 2048, 8192, 16384)],
    "prefill4k": [(1, 4096, 1)],
    "W1-4k": [(16, 4096, 128)],
}


def time_batch(
    generate: Callable[[int], list[int]], n: int, input_len: int, output_len: int
) -> dict[str, float]:
    """generate(new_tokens) runs the whole batch once and returns each sequence's number of new
    tokens. Batch APIs return only at the end, so TTFT is a 1-token run of the same batch."""
    t0 = time.perf_counter()
    generate(1)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = generate(output_len)
    elapsed = time.perf_counter() - t0
    if got != [output_len] * n:
        raise RuntimeError(f"expected {n} x {output_len} new tokens, got {got}")
    return {
        "elapsed_s": elapsed,
        "output_tokens_per_s": n * output_len / elapsed,
        "total_tokens_per_s": n * (input_len + output_len) / elapsed,
        "ttft_s": ttft,
        "decode_tokens_per_s_per_request": (output_len - 1) / max(elapsed - ttft, 1e-9),
    }


def time_steps(
    step: Callable[[], list[tuple[int, int, bool]]],
    has_work: Callable[[], bool],
    n: int,
    input_len: int,
    output_len: int,
    t0: float,
) -> dict[str, float]:
    """Drive an engine's own step loop after its n requests were added at time t0. step() runs
    one engine step and returns (request index, new tokens, finished) per request it touched.
    TTFT (from submission), decode tok/s per request ((output - 1) / (finish - first token))
    and the median all-decode step are then measured as `steadylm bench offline` measures
    them, not inferred from a separate 1-token run."""
    got, first, done, steps = [0] * n, [None] * n, [None] * n, []
    while has_work():
        s0 = time.perf_counter()
        events = step()
        now = time.perf_counter()
        steps.append((s0 - t0, now - s0))
        for i, new, finished in events:
            got[i] += new
            if first[i] is None and got[i]:
                first[i] = now - t0
            if finished and done[i] is None:
                done[i] = now - t0
    elapsed = time.perf_counter() - t0
    if got != [output_len] * n or None in done:
        raise RuntimeError(f"expected {n} x {output_len} new tokens, got {got}")
    # all-decode steps: after every request's first token, before any finished
    decode = [d for start, d in steps if max(first) <= start and start + d < min(done)]
    return {
        "elapsed_s": elapsed,
        "output_tokens_per_s": n * output_len / elapsed,
        "total_tokens_per_s": n * (input_len + output_len) / elapsed,
        "ttft_s": statistics.median(first),
        "decode_tokens_per_s_per_request": statistics.median(
            (output_len - 1) / (e - f) for f, e in zip(first, done, strict=True)
        ),
        "decode_step_ms": 1000 * statistics.median(decode) if decode else float("nan"),
    }


def run_workload(
    once: Callable[..., dict[str, float]], workload: str, runs: int
) -> dict[str, dict[str, dict[str, float]]]:
    """once(n, input_len, output_len, seed) -> metrics; a 4-token warm-up (a prompt of at most
    256 tokens: a 16k one would cost minutes and warm nothing more), then `runs` runs of each
    shape, summarised as median / min / max per metric."""
    rows = {}
    for n, i, o in WORKLOADS[workload]:
        once(1, min(i, 256), 4, seed=999)  # warm-up
        results = [once(n, i, o, seed=r) for r in range(runs)]
        rows[f"{n} x {i} -> {o}"] = {
            k: {
                "median": statistics.median(r[k] for r in results),
                "min": min(r[k] for r in results),
                "max": max(r[k] for r in results),
            }
            for k in results[0]
        }
    return rows


def emit(engine: str, rows: dict, json_path: str | None) -> None:
    out = {"engine": engine, "results": rows}
    print(json.dumps(out, indent=2))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
