"""Write the benchmark model: a random-weight Llama of about 110M parameters (hidden 768,
12 layers, 12 heads, 4 KV heads, intermediate 2048, vocab 32000, 32k positions), as a HF
directory.

    python benchmarks/make_bench_model.py bench_out/llama-110m [--dtype float32]

With ../shared present, the Llama-2 tokenizer (same 32000 vocabulary) is copied in so
`steadylm serve` can load the directory. Random weights are fine for speed: every workload
fixes its output length (EOS ignored). The weights are scaled like a trained model's (std
0.02), deterministically from --seed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch


def build(path: str, seed: int = 0, dtype: str = "float32", **shape) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=32000,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        max_position_embeddings=32768,  # the context workload decodes after 16k tokens
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg = LlamaConfig(**{**kw, **shape})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    # The Llama-2 tokenizer has exactly this 32000-token vocabulary; the server needs one.
    tok = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "tokenizers", "llama2"
    )
    if not os.path.isdir(tok):
        print(
            f"warning: {os.path.normpath(tok)} not found: {path} has no tokenizer, so "
            "`steadylm serve`, `steadylm bench serve` and the peers that need one will fail "
            "on it (copy a Llama-2 tokenizer in, 32000 tokens)",
            file=sys.stderr,
        )
    elif cfg.vocab_size == 32000:
        for f in (
            "tokenizer.json",
            "tokenizer.model",
            "tokenizer_config.json",
            "special_tokens_map.json",
        ):
            shutil.copy(os.path.join(tok, f), os.path.join(path, f))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    build(args.path, args.seed, args.dtype)
    print(args.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
