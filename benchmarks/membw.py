"""Measured memory bandwidth and the W2 decode bound for a model directory.

Bandwidth: the best of 10 timed full reads (torch.sum) of a 1 GiB fp32 buffer, with the given
torch threads. Bound: a decode step must read every linear weight (and the lm_head) once, so
tokens/s <= bandwidth / weight bytes per step.

    python benchmarks/membw.py --model bench_out/llama-110m
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch


def best_time(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of fn, in seconds (the VM's noise only ever adds)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    buf = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _busy_seconds() -> float | None:
    """CPU seconds every process on the machine has used (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measure(fn):
    """(fn's result, cores that other processes (and the hypervisor's steal) kept busy while
    it ran, or None where /proc/stat is unavailable). A bandwidth read that others shared
    reads low; report.py flags it."""
    busy0, own0, wall0 = _busy_seconds(), time.process_time(), time.perf_counter()
    result = fn()
    busy1, own1, wall1 = _busy_seconds(), time.process_time(), time.perf_counter()
    if busy0 is None or busy1 is None:
        return result, None
    others = (busy1 - busy0) - (own1 - own0)
    return result, max(0.0, others) / (wall1 - wall0)


def print_json(out: dict, path: str | None) -> None:
    """Print a result and, with a path, write it there too (the scripts' --json)."""
    print(json.dumps(out, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)


def step_weight_bytes(model_dir: str) -> int:
    """Bytes a batch-1 decode step reads: every weight matrix except the embedding table (one
    row), and of a mixture of experts' routed experts only the num_experts_per_tok a token
    takes in each sparse layer (the active parameters)."""
    from steadylm import gguf_file
    from steadylm.loader import safetensors_files, tensor_shapes

    gguf_path = gguf_file.find_gguf(model_dir)
    if gguf_path is not None:  # dequantized to fp32 at load; a tied head is the embedding
        tensors = gguf_file.reader(gguf_path).tensors
        tied = all(t.name != "output.weight" for t in tensors)
        return sum(
            4 * int(t.n_elements)
            for t in tensors
            if len(t.shape) == 2 and (tied or t.name != "token_embd.weight")
        )
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    share = cfg.get("num_experts_per_tok", 0) / experts if experts else 1.0
    total = 0.0
    for name, (shape, dtype) in tensor_shapes(safetensors_files(model_dir)).items():
        if "embed_tokens" in name or len(shape) < 2:
            continue
        size = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4}.get(dtype, 4)
        routed = re.search(r"\.experts\.\d+\.", name) is not None
        total += size * shape[0] * shape[1] * (share if routed else 1.0)
    return round(total)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bw, others = measure(read_bandwidth)
    wb = step_weight_bytes(args.model)
    out = {
        "bandwidth_GBps": bw / 1e9,
        "other_cpu_cores": None if others is None else round(others, 3),
        "step_weight_bytes": wb,
        "bound_step_ms": 1000 * wb / bw,
        "bound_tokens_per_s": bw / wb,
    }
    print_json(out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
