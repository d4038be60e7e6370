"""Paged decode attention at long context, as a share of a plain read of the same KV bytes.

Builds the benchmark model's KV cache shape (12 layers, 4 KV heads of 64, 12 query heads,
64-token blocks in a shuffled block table, fp32 or bf16; `--quant-policy 8 / 4` for an int8 /
int4 cache) for `--batch` sequences at each context, and for `--seconds` alternates: a
torch.sum read of fp32 buffers as large as every layer's K and V (codes and scale/zero
included; best of 3) and the 12 layers' native paged decode attention (best of 3):
`kernels.native_decode_attention` for an unquantized cache, `kernels.native_paged_attention`
for a quantized one (what the engine runs). Prints, per context, the median of attention time
/ read time (1.0 = as fast as reading the bytes) and the attention's ms per step, so the VM's
drifting bandwidth cancels.

    python benchmarks/decode_attention_share.py --seconds 60 [--quant-policy 8] [--batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from steadylm import kernels
from steadylm.attention.torch_ref import quantize_kv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from membw import best_time, print_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 64


def measure(attend, ctx: int, dtype, layers: int, seconds: float, bits: int, batch: int) -> dict:
    nb = -(-ctx // BLOCK)
    shape = (batch * nb, BLOCK, KV_HEADS, HEAD_DIM)

    def cache():  # what one layer's K (or V) holds: plain rows, or codes and scale/zero
        x = torch.randn(shape).to(dtype)
        return (x,) if not bits else quantize_kv(x, bits)

    k = [cache() for _ in range(layers)]
    v = [cache() for _ in range(layers)]
    table = torch.randperm(batch * nb).view(batch, nb)
    lens = torch.full((batch,), ctx)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
    seq = torch.arange(batch)

    # The read: float32 buffers of each layer's K and V bytes (a torch.sum of uint8 codes is
    # bound by its int64 accumulation, not by memory).
    plain = [
        torch.ones(sum(t.numel() * t.element_size() for t in (*kl, *vl)) // 4)
        for kl, vl in zip(k, v)
    ]

    def read():
        for t in plain:
            t.sum()

    def attention():
        for kl, vl in zip(k, v):
            if bits:
                attend(q, kl[0], vl[0], kl[1], vl[1], table, seq, lens, HEAD_DIM**-0.5, 0, bits)
            else:
                attend(q, kl[0], vl[0], table, lens, HEAD_DIM**-0.5, 0)

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
    ap.add_argument("--quant-policy", type=int, default=0, choices=[0, 4, 8])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    bits = args.quant_policy
    native = kernels.native_paged_attention if bits else kernels.native_decode_attention
    attend = native(dtype, torch.device("cpu"))
    if attend is None:
        print(f"no native decode attention here ({kernels.status()})")
        return 1
    torch.manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    seconds = args.seconds / len(contexts)
    out = {
        str(c): measure(attend, c, dtype, args.layers, seconds, bits, args.batch) for c in contexts
    }
    print_json(out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
