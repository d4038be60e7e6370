"""Peer: Hugging Face transformers `generate()` on the same model and workloads.

Padded static batch (all prompts have the same length, so no padding is needed), use_cache,
greedy, exactly output_len new tokens (min_new_tokens = max_new_tokens), fp32, same torch
threads. TTFT is the time of a generate() with max_new_tokens=1 on the same batch.

    python benchmarks/peer_transformers.py --model bench_out/llama-110m --workload W1
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from peer_common import time_batch

from steadylm.bench import WORKLOADS, print_table, random_prompts, summarize


def once(model, n: int, input_len: int, output_len: int, seed: int) -> dict[str, float]:
    ids = torch.tensor(random_prompts(n, input_len, model.config.vocab_size, seed))
    mask = torch.ones_like(ids)
    kw = dict(
        attention_mask=mask, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None
    )

    @torch.inference_mode()
    def generate(new_tokens: int) -> list[int]:
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        return [out.shape[1] - input_len] * n

    return time_batch(generate, n, input_len, output_len)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    rows = []
    for n, i, o in WORKLOADS[args.workload]:
        once(model, min(n, 2), i, 4, seed=999)  # warm-up
        rows.append(
            (f"{n} x {i} -> {o}", summarize([once(model, n, i, o, r) for r in range(args.runs)]))
        )
    import transformers

    print_table(
        f"transformers {transformers.__version__} generate() {args.dtype} ({args.model})", rows
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"engine": f"transformers-{transformers.__version__}", "results": dict(rows)},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
