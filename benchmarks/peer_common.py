"""What the peer scripts share: the workloads, 3-run summaries and the JSON they write. Plain
Python, so it runs in each peer's own venv (the scripts do not import steadylm)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

WORKLOADS = {
    "W1": [(16, 256, 128)],
    "W2": [(1, 256, 128)],
    "sweep": [(n, 256, 128) for n in (1, 4, 16, 64)],
}


def run_workload(
    once: Callable[..., dict[str, float]], workload: str, runs: int
) -> dict[str, dict[str, dict[str, float]]]:
    """once(n, input_len, output_len, seed) -> metrics; a 4-token warm-up, then `runs` runs of
    each shape, summarised as median / min / max per metric."""
    rows = {}
    for n, i, o in WORKLOADS[workload]:
        once(1, i, 4, seed=999)  # warm-up
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
