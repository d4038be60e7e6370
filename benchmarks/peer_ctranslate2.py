"""Peer: CTranslate2 on the same model (converted with its own `ct2-transformers-converter`,
float32) and workloads. Runs in its own venv (see docs/benchmarks.md); it does not import
steadylm.

`Generator.generate_batch` takes all of a workload's prompts at once (CTranslate2 batches them
itself), greedy (`sampling_topk=1`), exactly `output_len` new tokens (`min_length` =
`max_length`, so EOS never ends one early). TTFT is timed on a separate 1-token call of the same
batch, since `generate_batch` returns only when every sequence is done.

    python benchmarks/peer_ctranslate2.py --model /path/llama-110m-ct2 --workload W1
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from peer_common import WORKLOADS, emit, run_workload


def once(gen, vocab, n: int, input_len: int, output_len: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [[vocab[rng.randrange(3, 32000)] for _ in range(input_len)] for _ in range(n)]
    kw = dict(sampling_topk=1, include_prompt_in_result=False, max_batch_size=n)
    t0 = time.perf_counter()
    gen.generate_batch(prompts, max_length=1, min_length=1, **kw)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = gen.generate_batch(prompts, max_length=output_len, min_length=output_len, **kw)
    elapsed = time.perf_counter() - t0
    got = [len(r.sequences_ids[0]) for r in res]
    assert all(g == output_len for g in got), got
    return {
        "elapsed_s": elapsed,
        "output_tokens_per_s": n * output_len / elapsed,
        "total_tokens_per_s": n * (input_len + output_len) / elapsed,
        "ttft_s": ttft,
        "decode_tokens_per_s_per_request": (output_len - 1) / (elapsed - ttft),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a ct2-transformers-converter output dir")
    ap.add_argument("--tokenizer", required=True, help="the HF model dir (token strings)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="W2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compute-type", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import ctranslate2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = tok.convert_ids_to_tokens(list(range(32000)))
    gen = ctranslate2.Generator(
        args.model, device="cpu", compute_type=args.compute_type, intra_threads=args.threads
    )
    rows = run_workload(
        lambda n, i, o, seed: once(gen, vocab, n, i, o, seed), args.workload, args.runs
    )
    emit(f"ctranslate2 {ctranslate2.__version__} {args.compute_type}", rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
