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

from peer_common import WORKLOADS, emit, run_workload, time_batch


def once(gen, vocab, n: int, input_len: int, output_len: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [[vocab[rng.randrange(3, 32000)] for _ in range(input_len)] for _ in range(n)]
    kw = dict(sampling_topk=1, include_prompt_in_result=False, max_batch_size=n)

    def generate(new_tokens: int) -> list[int]:
        res = gen.generate_batch(prompts, max_length=new_tokens, min_length=new_tokens, **kw)
        return [len(r.sequences_ids[0]) for r in res]

    return time_batch(generate, n, input_len, output_len)


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
