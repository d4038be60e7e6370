"""Peer: OpenVINO GenAI's ContinuousBatchingPipeline (paged attention, continuous batching) on
the same model (exported with `optimum-cli export openvino --weight-format fp32`) and workloads.
Runs in its own venv (see docs/benchmarks.md); it does not import steadylm.

All of a workload's requests go to one `generate` call as token ids, greedy, exactly
`output_len` new tokens (`ignore_eos`, `min_new_tokens` = `max_new_tokens`). OpenVINO's CPU
plugin runs bf16 by default on CPUs with AVX512-BF16 or AMX; `--precision f32` (the default
here) asks for fp32, the same dtype as steadylm's default, via INFERENCE_PRECISION_HINT. TTFT is
timed on a separate 1-token call of the same batch.

    python benchmarks/peer_openvino.py --model /path/llama-110m-ov --workload W1
"""

from __future__ import annotations

import argparse
import random
import sys

from peer_common import WORKLOADS, emit, run_workload, time_batch


def once(pipe, n: int, input_len: int, output_len: int, seed: int) -> dict[str, float]:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    rng = random.Random(seed)
    prompts = [
        ov.Tensor(np.array([[rng.randrange(3, 32000) for _ in range(input_len)]], dtype=np.int64))
        for _ in range(n)
    ]

    def config(new_tokens: int):
        c = ov_genai.GenerationConfig()
        c.max_new_tokens = c.min_new_tokens = new_tokens
        c.ignore_eos = True
        c.do_sample = False
        return c

    def generate(new_tokens: int) -> list[int]:
        res = pipe.generate(prompts, [config(new_tokens)] * n)
        return [len(r.m_generation_ids[0]) for r in res]

    return time_batch(generate, n, input_len, output_len)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an optimum-cli export openvino output dir")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="W2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--cache-gb", type=float, default=4.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import openvino_genai as ov_genai

    sched = ov_genai.SchedulerConfig()
    sched.cache_size = int(args.cache_gb)  # GB of KV cache
    sched.max_num_batched_tokens = 4096
    sched.max_num_seqs = 256
    sched.enable_prefix_caching = False
    props = {"INFERENCE_PRECISION_HINT": args.precision, "INFERENCE_NUM_THREADS": args.threads}
    pipe = ov_genai.ContinuousBatchingPipeline(args.model, sched, "CPU", props)
    rows = run_workload(lambda n, i, o, seed: once(pipe, n, i, o, seed), args.workload, args.runs)
    emit(f"openvino-genai {ov_genai.get_version()} {args.precision}", rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
