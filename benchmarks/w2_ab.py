"""W2 decode with the packed GEMV on and off, paired in one engine, bracketed by reads.

Loads the model once and for `--seconds` alternates W2 runs (1 x 256 -> 128, greedy, EOS
ignored) with every dense layer's GEMV on (`gemv_address` kept) and off (oneDNN's matmul for
every batch), each run between two `membw.read_bandwidth` readings. Prints, per mode, the
median decode tok/s and the median share of the bound (weight bytes per step over the larger
of the two readings), so the two modes see the same drift.

    python benchmarks/w2_ab.py --model bench_out/llama-110m --seconds 120
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from membw import print_json, read_bandwidth, step_weight_bytes  # noqa: E402


def main(argv=None) -> int:
    from steadylm.bench import offline_once
    from steadylm.config import EngineConfig
    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.layers.linear import OneDNNDenseKernel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_pretrained(args.model, EngineConfig(max_total_tokens=65536))
    dense = [
        m.kernel
        for m in engine.runner.model.modules()
        if isinstance(getattr(m, "kernel", None), OneDNNDenseKernel)
    ]
    gemv_rows = [k.gemv_max_rows for k in dense]
    weight_bytes = step_weight_bytes(args.model)
    offline_once(engine, 1, 256, 8, seed=999)  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {"gemv": [], "onednn": []}
    t0 = time.time()
    while not runs["onednn"] or time.time() - t0 < args.seconds:
        for mode, got in runs.items():
            for k, r in zip(dense, gemv_rows):
                k.gemv_max_rows = r if mode == "gemv" else 0
            before = read_bandwidth(repeats=5)
            tps = offline_once(engine, 1, 256, 128)["decode_tokens_per_s_per_request"]
            after = read_bandwidth(repeats=5)
            got.append((tps, tps / (max(before, after) / weight_bytes)))
    out = {
        mode: {
            "pairs": len(v),
            "decode_tokens_per_s": statistics.median(t for t, _ in v),
            "share_of_bound": statistics.median(s for _, s in v),
        }
        for mode, v in runs.items()
    }
    out["paired_speedup"] = statistics.median(
        g[0] / o[0] for g, o in zip(runs["gemv"], runs["onednn"])
    )
    print_json(out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
