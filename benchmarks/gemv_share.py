"""The linears of one decode step, back to back, as a share of a plain read of memory.

Builds the benchmark model's 49 weight matrices (12 layers of qkv 1280x768, o 768x768,
gate_up 4096x768, down 768x2048, and the 32000x768 lm_head), packs each for oneDNN as the
engine does, and for `--seconds` alternates: a torch.sum read of a 1 GiB buffer (best of 3),
the 49 matmuls at batch `--rows` (1 by default) through steadylm's packed GEMV, and the same
through oneDNN's matmul (best of 5 each). Prints the median of each path's GB/s divided by the
read's, so the VM's drifting bandwidth cancels, and each path's median milliseconds (at
batches above 4 the linears are compute-bound and the milliseconds are the comparison).

    python benchmarks/gemv_share.py --seconds 60
    python benchmarks/gemv_share.py --seconds 60 --rows 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from steadylm.kernels import packed_linear_max_rows
from steadylm.layers.linear import OneDNNDenseKernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from membw import best_time, print_json  # noqa: E402

LAYER = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]
LM_HEAD = (32000, 768)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rows", type=int, default=1, help="batch rows of every matmul")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shapes = LAYER * args.layers + [LM_HEAD]
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernels = [OneDNNDenseKernel(torch.randn(n, k).to(dtype), None) for n, k in shapes]
    if any(k.gemv_address is None for k in kernels):
        print("the packed GEMV does not read this CPU's oneDNN layout: nothing to compare")
        return 1
    gemv_rows = packed_linear_max_rows(kernels[0].gemv_address, kernels[0].in_features)
    if not 1 <= args.rows <= gemv_rows:  # fp32 above: the blocked GEMM, not the GEMV
        print(f"--rows must be 1 to {gemv_rows} (the GEMV's rows on this CPU)")
        return 1
    xs = [torch.randn(args.rows, k.in_features).to(dtype) for k in kernels]
    nbytes = sum(n * k for n, k in shapes) * kernels[0].weight.element_size()
    buf = torch.ones(1 << 28)

    def step():
        for k, x in zip(kernels, xs):
            k.apply(x)

    rows = kernels[0].gemv_max_rows

    def set_gemv(on: bool):
        for k in kernels:
            k.gemv_max_rows = rows if on else 0

    shares: dict[str, list[float]] = {"gemv": [], "onednn": []}
    ms: dict[str, list[float]] = {"gemv": [], "onednn": []}
    t0 = time.time()
    while not shares["gemv"] or time.time() - t0 < args.seconds:  # at least one round
        read = (1 << 30) / best_time(buf.sum, 3)
        for name in shares:
            set_gemv(name == "gemv")
            seconds = best_time(step, 5)
            shares[name].append(nbytes / seconds / read)
            ms[name].append(seconds * 1e3)
    out = {name: statistics.median(v) for name, v in shares.items()}
    out.update({f"{name}_ms": statistics.median(v) for name, v in ms.items()})
    out["rows"] = args.rows
    out["rounds"] = len(shares["gemv"])
    print_json(out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
