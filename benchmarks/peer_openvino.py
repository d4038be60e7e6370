"""Peer: OpenVINO GenAI's ContinuousBatchingPipeline (paged attention, continuous batching) on
the same model (exported with `optimum-cli export openvino --weight-format fp32`) and workloads.
Runs in its own venv (see docs/benchmarks.md); it does not import steadylm.

All of a workload's requests are added at once as token ids, greedy, exactly
`output_len` new tokens (`ignore_eos`, `min_new_tokens` = `max_new_tokens`). OpenVINO's CPU
plugin runs bf16 by default on CPUs with AVX512-BF16 or AMX; `--precision f32` (the default
here) asks for fp32, the same dtype as steadylm's default, via INFERENCE_PRECISION_HINT. The
requests go through the pipeline's step loop (add_request / step / read), so TTFT (from
submission), decode tok/s per request and the all-decode step time are measured per request and
per step, as `steadylm bench offline` measures them.

OpenVINO's CPU plugin keeps the KV cache in u8 by default (KV_CACHE_PRECISION, whatever the
inference precision), so at long context it reads a quarter of the bytes of an fp32 cache:
`--kv-cache-precision f32` (or bf16, u8, u4) sets it, and the engine name in the output says
which was used. Compare it with steadylm's `--quant-policy 8` (int8 KV) or its fp32 cache.

    python benchmarks/peer_openvino.py --model /path/llama-110m-ov --workload W1
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from peer_common import WORKLOADS, emit, run_workload, time_steps


def once(pipe, n: int, input_len: int, output_len: int, seed: int) -> dict[str, float]:
    """The batch through the pipeline's own step loop (add_request, step, each handle read
    after each step), so TTFT and decode are measured per request as steadylm measures them."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    rng = random.Random(seed)
    prompts = [
        ov.Tensor(np.array([[rng.randrange(3, 32000) for _ in range(input_len)]], dtype=np.int64))
        for _ in range(n)
    ]
    c = ov_genai.GenerationConfig()
    c.max_new_tokens = c.min_new_tokens = output_len
    c.ignore_eos = True
    c.do_sample = False
    t0 = time.perf_counter()
    handles = [pipe.add_request(seed * 100_000 + i, p, c) for i, p in enumerate(prompts)]
    finished = ov_genai.GenerationStatus.FINISHED

    def step() -> list[tuple[int, int, bool]]:
        pipe.step()
        events = []
        for i, h in enumerate(handles):
            new = sum(len(o.generated_ids) for o in h.read().values()) if h.can_read() else 0
            events.append((i, new, h.get_status() == finished))
        return events

    return time_steps(step, pipe.has_non_finished_requests, n, input_len, output_len, t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an optimum-cli export openvino output dir")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="W2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--cache-gb", type=float, default=4.0)
    ap.add_argument(
        "--kv-cache-precision",
        choices=["f32", "bf16", "u8", "u4"],
        default=None,
        help="KV_CACHE_PRECISION (default: the CPU plugin's own, u8 on x86)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import openvino_genai as ov_genai

    sched = ov_genai.SchedulerConfig()
    sched.cache_size = int(args.cache_gb)  # GB of KV cache
    sched.max_num_batched_tokens = 4096
    sched.max_num_seqs = 256
    sched.enable_prefix_caching = False
    props = {"INFERENCE_PRECISION_HINT": args.precision, "INFERENCE_NUM_THREADS": args.threads}
    if args.kv_cache_precision:
        props["KV_CACHE_PRECISION"] = args.kv_cache_precision
    import openvino as ov

    default_kv = ov.Core().get_property("CPU", "KV_CACHE_PRECISION").get_type_name()
    kv = args.kv_cache_precision or default_kv
    pipe = ov_genai.ContinuousBatchingPipeline(args.model, sched, "CPU", props)
    rows = run_workload(lambda n, i, o, seed: once(pipe, n, i, o, seed), args.workload, args.runs)
    emit(f"openvino-genai {ov_genai.get_version()} {args.precision} kv {kv}", rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
