"""steadylm against one peer in alternating processes (docs/benchmarks.md's side-by-side).

This VM's memory bandwidth drifts by tens of percent within minutes, and an engine's speed
differs from one process to the next. A ratio is only worth reporting when both engines ran
in the same minutes. So each pair runs `steadylm bench offline` and the peer's script once
each, ours first in odd pairs and the peer first in even ones. The ratio (ours / peer output
tok/s) is taken per pair and per shape. `membw.py` reads the bandwidth (and the other
processes' CPU use) before and after the set. The whole set holds the benchmark lock
(/tmp/steadylm-bench.lock, `--lock`), so no other timed run shares the CPUs.

    python benchmarks/side_by_side.py --workload W1 --dtype bfloat16 --pairs 4 \\
        --peer openvino --peer-python /work/peers/ov/bin/python \\
        --peer-model /work/peers/llama-110m-ov --out /tmp/side_W1_bf16

Every run's JSON and log stay under --out; the summary is printed and written to
--out/summary.json.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from peer_common import WORKLOADS  # noqa: E402

# peer -> (script, the flag that names its model)
PEERS = {
    "openvino": ("peer_openvino.py", "--model"),
    "llamacpp": ("peer_llamacpp.py", "--gguf"),
    "vllm": ("peer_vllm.py", "--model"),
    "transformers": ("peer_transformers.py", "--model"),
    "ctranslate2": ("peer_ctranslate2.py", "--model"),
}


def order(pair: int) -> tuple[str, str]:
    """Who runs first in pair 1, 2, ...: ours in odd pairs, the peer in even ones."""
    return ("ours", "peer") if pair % 2 else ("peer", "ours")


def dtype_args(peer: str, dtype: str) -> list[str]:
    """The peer's flag for the model dtype: OpenVINO's inference precision, or a dtype."""
    if peer == "openvino":
        return ["--precision", "bf16" if dtype == "bfloat16" else "f32"]
    if peer in ("vllm", "transformers"):
        return ["--dtype", dtype]
    return []  # llama.cpp's GGUF and CTranslate2's --compute-type say it themselves


def commands(args: argparse.Namespace, json_path: dict[str, str]) -> dict[str, list[str]]:
    ours = [sys.executable, "-m", "steadylm.entrypoints.cli", "--log-level", "WARNING"]
    ours += ["bench", "offline", "--model", args.model]
    ours += ["--workload", args.workload, "--runs", str(args.runs), "--dtype", args.dtype]
    ours += shlex.split(args.ours_args) + ["--json", json_path["ours"]]
    script, model_flag = PEERS[args.peer]
    peer = [args.peer_python, os.path.join(HERE, script), model_flag, args.peer_model]
    peer += ["--workload", args.workload, "--runs", str(args.runs)]
    peer += dtype_args(args.peer, args.dtype) + shlex.split(args.peer_args)
    peer += ["--json", json_path["peer"]]
    return {"ours": ours, "peer": peer}


def shape_metrics(result_file: str) -> dict[str, dict[str, float]]:
    """{shape: {output tok/s, decode step ms, first token s}} (medians) from a bench JSON."""
    with open(result_file) as f:
        results = json.load(f)["results"]
    out = {}
    for shape, s in results.items():
        out[shape] = {
            "tok_s": s["output_tokens_per_s"]["median"],
            "step_ms": s.get("decode_step_ms", {}).get("median", float("nan")),
            "ttft_s": s["ttft_s"]["median"],
        }
    return out


def summarize(pairs: list[dict[str, dict[str, dict[str, float]]]]) -> dict[str, dict]:
    """Per shape: every pair's ratio (ours / peer output tok/s) in pair order, their median,
    min and max, and both engines' decode steps and first tokens."""
    summary = {}
    for shape in pairs[0]["ours"]:
        ratios = [p["ours"][shape]["tok_s"] / p["peer"][shape]["tok_s"] for p in pairs]
        summary[shape] = {
            "ratios": ratios,
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            **{
                f"{side}_{key}": [p[side][shape][key] for p in pairs]
                for side in ("ours", "peer")
                for key in ("tok_s", "step_ms", "ttft_s")
            },
        }
    return summary


def bandwidth(model: str) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "membw.py"), "--model", model],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    d = json.loads(out)
    return {
        "GBps": round(d["bandwidth_GBps"], 1),
        "bound_tokens_per_s": round(d["bound_tokens_per_s"], 1),  # W2's: membw.py's docstring
        "other_cpu_cores": d["other_cpu_cores"],
    }


def run(cmd: list[str], log: str) -> None:
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"side_by_side: {shlex.join(cmd)} failed (exit {rc}); see {log}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench_out/llama-110m", help="our checkpoint directory")
    ap.add_argument(
        "--workload",
        default="W1",
        choices=list(WORKLOADS),
        help="the workloads steadylm bench offline and the peers share",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="runs per process (medians)")
    ap.add_argument("--peer", default="openvino", choices=sorted(PEERS))
    ap.add_argument("--peer-python", required=True, help="the python of the peer's own venv")
    ap.add_argument("--peer-model", required=True, help="the peer's converted model")
    ap.add_argument(
        "--ours-args",
        default="--max-total-tokens 65536",
        help="more arguments for steadylm bench offline (default: %(default)s)",
    )
    ap.add_argument(
        "--peer-args",
        default="",
        help="more arguments for the peer's script (ctranslate2: --tokenizer DIR)",
    )
    ap.add_argument("--out", required=True, help="a directory for every run's JSON and log")
    ap.add_argument("--lock", default="/tmp/steadylm-bench.lock", help="held for the whole set")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with open(args.lock, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        before = bandwidth(args.model)
        start = time.strftime("%H:%M", time.gmtime())
        print(f"{start} UTC, bandwidth before: {before}", flush=True)
        pairs = []
        for i in range(1, args.pairs + 1):
            paths = {side: os.path.join(args.out, f"{side}_{i}.json") for side in ("ours", "peer")}
            cmds = commands(args, paths)
            for side in order(i):
                run(cmds[side], paths[side][: -len(".json")] + ".log")
            pairs.append({side: shape_metrics(paths[side]) for side in ("ours", "peer")})
            for shape, m in summarize(pairs[-1:]).items():
                print(
                    f"pair {i} {shape}: {m['ours_tok_s'][0]:.1f} vs {m['peer_tok_s'][0]:.1f} "
                    f"{m['median']:.2f}x; step {m['ours_step_ms'][0]:.2f} / "
                    f"{m['peer_step_ms'][0]:.2f} ms; first token {m['ours_ttft_s'][0]:.3f} / "
                    f"{m['peer_ttft_s'][0]:.3f} s",
                    flush=True,
                )
        after = bandwidth(args.model)
    summary = summarize(pairs)
    for shape, m in summary.items():
        print(f"{shape}: median {m['median']:.3f}x ({m['min']:.2f}-{m['max']:.2f}x)")
    print(f"bandwidth after: {after}")
    record = {
        "start_utc": start,
        "workload": args.workload,
        "dtype": args.dtype,
        "peer": args.peer,
        "bandwidth_before": before,
        "bandwidth_after": after,
        "shapes": summary,
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
