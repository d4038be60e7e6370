"""Paged decode attention at long context, as a share of a plain read of the same KV bytes.

Builds the benchmark model's KV cache shape (12 layers, 4 KV heads of 64, 12 query heads,
64-token blocks in a shuffled block table, fp32 or bf16) for one sequence at each context,
and for `--seconds` alternates: a torch.sum read of every layer's K and V blocks (best of 3)
and the 12 layers' native paged decode attention (`kernels.native_decode_attention`, best of
3). Prints, per context, the median of attention time / read time (1.0 = as fast as reading
the bytes) and the attention's ms per step, so the VM's drifting bandwidth cancels.

    python benchmarks/decode_attention_share.py --seconds 60
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from steadylm import kernels

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from membw import best_time, print_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 64


def measure(attend, ctx: int, dtype: torch.dtype, layers: int, seconds: float) -> dict:
    nb = -(-ctx // BLOCK)
    shape = (nb, BLOCK, KV_HEADS, HEAD_DIM)
    k = [torch.randn(shape).to(dtype) for _ in range(layers)]
    v = [torch.randn(shape).to(dtype) for _ in range(layers)]
    table = torch.randperm(nb).view(1, nb)
    lens = torch.tensor([ctx])
    q = torch.randn(1, HEADS, HEAD_DIM).to(dtype)

    def read():
        for kl, vl in zip(k, v):
            kl.sum()
            vl.sum()

    def attention():
        for kl, vl in zip(k, v):
            attend(q, kl, vl, table, lens, HEAD_DIM**-0.5, 0)

    ratios, times = [], []
    t0 = time.time()
    while not ratios or time.time() - t0 < seconds:  # at least one round
        r, a = best_time(read, 3), best_time(attention, 3)
        ratios.append(a / r)
        times.append(a)
    return {
        "attention_over_read": statistics.median(ratios),
        "attention_ms_per_step": 1000 * statistics.median(times),
        "rounds": len(ratios),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--contexts", default="2048,8192,16384")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    attend = kernels.native_decode_attention(dtype, torch.device("cpu"))
    if attend is None:
        print(f"no native decode attention here ({kernels.status()})")
        return 1
    torch.manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    seconds = args.seconds / len(contexts)
    out = {str(c): measure(attend, c, dtype, args.layers, seconds) for c in contexts}
    print_json(out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
