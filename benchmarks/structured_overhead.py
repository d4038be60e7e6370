"""What structured output adds to a decode step at batch 16, with the bitmask work measured.

    python benchmarks/structured_overhead.py --model bench_out/qwen2.5-0.5b-random --runs 3

Builds (once, at --model) a random-weight model of Qwen2.5-0.5B's shape (its 151,936-token
vocabulary is what makes the bitmask cost real) with the Qwen2.5 tokenizer from ../shared, then
runs 16 requests to steady decode twice per run: unconstrained, and each held to a JSON schema
(xgrammar). It reports the median decode-step time at batch 16 of each, the engine's bitmask
fill time per step, the sampler's masking time (timed alone on the same shapes), and their sum
as a share of the plain step (the step-time difference alone drifts with the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "shared")
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["title", "year", "tags", "summary"],
}


TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def build(path: str, dtype: str, tiny: bool = False) -> str:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    with open(os.path.join(SHARED, "model_configs", "Qwen2.5-0.5B-Instruct.json")) as f:
        cfg = Qwen2Config(**{**json.load(f), **(TINY if tiny else {})})
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(os.path.join(SHARED, "tokenizers", "qwen2.5")).save_pretrained(
        path
    )
    return path


def run_once(engine, tok, constrained: bool, steps: int) -> dict:
    from steadylm.engine.request import SamplingParams
    from steadylm.engine.structured import StructuredOutputs

    so = StructuredOutputs("json", json.dumps(SCHEMA)) if constrained else None
    prompt = tok.encode("Describe a film as JSON with a title, year, tags and a summary.")
    for i in range(16):
        params = SamplingParams(
            max_new_tokens=steps,
            temperature=1.0,
            seed=i,
            ignore_eos=True,
            structured_outputs=so,
        )
        engine.add_request(prompt, params)
    engine.step_log.clear()
    fill0 = engine.bitmask_seconds
    while engine.has_unfinished():
        engine.step()
    decode = [r for r in engine.step_log if r.num_seqs == 16 and r.num_tokens == 16]
    return {
        "steps": len(decode),
        "step_ms": 1e3 * statistics.median(r.seconds for r in decode),
        "fill_ms": 1e3 * (engine.bitmask_seconds - fill0) / max(1, len(engine.step_log)),
    }


def mask_ms(vocab: int, repeats: int = 20) -> float:
    """The sampler's masking of 16 rows (xgrammar's CPU kernel), timed alone."""
    from steadylm.engine.structured import apply_token_bitmask

    logits = torch.randn(16, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (16, (vocab + 31) // 32), dtype=torch.int32)
    apply_token_bitmask(logits, bitmask, list(range(16)))
    t0 = time.perf_counter()
    for _ in range(repeats):
        apply_token_bitmask(logits, bitmask, list(range(16)))
    return 1e3 * (time.perf_counter() - t0) / repeats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench_out/qwen2.5-0.5b-random")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=48, help="new tokens per request")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    ap.add_argument(
        "--tiny", action="store_true", help="2 small layers, the real vocabulary (the tests)"
    )
    args = ap.parse_args(argv)
    if not os.path.isdir(os.path.join(SHARED, "tokenizers", "qwen2.5")):
        print("needs ../shared/tokenizers/qwen2.5", file=sys.stderr)
        return 2
    from steadylm.config import EngineConfig
    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.tokenizer import load_tokenizer

    build(args.model, args.dtype, args.tiny)
    tok = load_tokenizer(args.model)
    engine = LLMEngine.from_pretrained(
        args.model, EngineConfig(num_gpu_blocks=256, block_size=16, dtype=args.dtype), tok
    )
    run_once(engine, tok, True, 4)  # warm up: kernels, xgrammar's tokenizer info, the grammar
    rows = {"plain": [], "json_schema": []}
    for _ in range(args.runs):
        rows["plain"].append(run_once(engine, tok, False, args.steps))
        rows["json_schema"].append(run_once(engine, tok, True, args.steps))
    plain = statistics.median(r["step_ms"] for r in rows["plain"])
    structured = statistics.median(r["step_ms"] for r in rows["json_schema"])
    fill = statistics.median(r["fill_ms"] for r in rows["json_schema"])
    apply = mask_ms(engine.model_config.vocab_size)
    result = {
        "model": f"Qwen2.5-0.5B {'vocab, tiny layers' if args.tiny else 'shape'}, random "
        f"{args.dtype} weights, vocab 151936",
        "threads": torch.get_num_threads(),
        "plain_step_ms": round(plain, 2),
        "json_schema_step_ms": round(structured, 2),
        "overhead_pct": round(100 * (structured - plain) / plain, 1),
        "bitmask_fill_ms_per_step": round(fill, 3),
        "bitmask_apply_ms_per_step": round(apply, 3),
        "bitmask_share_pct": round(100 * (fill + apply) / plain, 2),
        "runs": rows,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
