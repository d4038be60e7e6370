"""Peer: llama.cpp through llama-cpp-python, on the same model (converted to GGUF f32) and
workloads. Runs in its own venv (see docs/benchmarks.md for the exact setup); it does not import
steadylm.

llama-cpp-python's `Llama` runs one sequence at a time, so W1's 16 requests run one after
another: that is the throughput a llama-cpp-python user gets. Greedy, EOS never consulted
(`generate` yields tokens until we stop it).

    python benchmarks/peer_llamacpp.py --gguf /path/llama-110m-f32.gguf --workload W2
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from peer_common import WORKLOADS, emit, run_workload


def one_sequence(llm, prompt: list[int], output_len: int) -> tuple[float, float]:
    llm.reset()
    t0 = time.perf_counter()
    first = None
    for i, _tok in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
        if first is None:
            first = time.perf_counter() - t0
        if i + 1 == output_len:
            break
    return first, time.perf_counter() - t0


def once(llm, n: int, input_len: int, output_len: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(input_len)] for _ in range(n)]
    t0 = time.perf_counter()
    times = [one_sequence(llm, p, output_len) for p in prompts]
    elapsed = time.perf_counter() - t0
    ttft = statistics.median(t for t, _ in times)
    decode = statistics.median((output_len - 1) / (e - t) for t, e in times)
    return {
        "elapsed_s": elapsed,
        "output_tokens_per_s": n * output_len / elapsed,
        "total_tokens_per_s": n * (input_len + output_len) / elapsed,
        "ttft_s": ttft,
        "decode_tokens_per_s_per_request": decode,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="W2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--n-ctx", type=int, default=None, help="default: the workload's longest prompt + output"
    )
    args = ap.parse_args(argv)
    import llama_cpp

    n_ctx = args.n_ctx or max(i + o for _, i, o in WORKLOADS[args.workload])
    llm = llama_cpp.Llama(
        model_path=args.gguf,
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    rows = run_workload(lambda n, i, o, seed: once(llm, n, i, o, seed), args.workload, args.runs)
    emit(f"llama-cpp-python {llama_cpp.__version__}", rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
