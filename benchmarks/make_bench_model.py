"""Write a benchmark model as a HF directory: by default a random-weight Llama of about 110M
parameters (hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate 2048, vocab 32000, 32k
positions); `--shape` picks a real model's widths instead (`SHAPES`, a few with fewer layers,
said in the name).

    python benchmarks/make_bench_model.py bench_out/llama-110m [--dtype float32]
    python benchmarks/make_bench_model.py bench_out/qwen3-30b-a3b-4l --shape qwen3-30b-a3b-4l

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

# name -> (transformers config class, model class, overrides of the 110M Llama's fields)
SHAPES = {
    "llama-110m": ("LlamaConfig", "LlamaForCausalLM", {}),
    # Qwen2.5-1.5B's widths, all 28 layers (tied head, qkv bias)
    "qwen2.5-1.5b": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            hidden_size=1536,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            intermediate_size=8960,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
    ),
    # Llama-3.1-8B's widths, 8 of its 32 layers
    "llama3.1-8b-8l": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=4096,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
        ),
    ),
    # Qwen3-30B-A3B's widths (128 experts of 768, top 8, q/k norm), 4 of its 48 layers
    "qwen3-30b-a3b-4l": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=2048,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            vocab_size=151936,
        ),
    ),
}


def build(path: str, seed: int = 0, dtype: str = "float32", shape_name="llama-110m", **shape):
    import transformers

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
    cfg_name, model_name, preset = SHAPES[shape_name]
    cfg = getattr(transformers, cfg_name)(**{**kw, **preset, **shape})
    torch.manual_seed(seed)
    with torch.device("meta"):  # initialised below, in the target dtype (no fp32 copy first)
        model = getattr(transformers, model_name)(cfg)
    model = model.to_empty(device="cpu").to(getattr(torch, dtype)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # as a trained model's scale: std 0.02
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0, 0.02)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    # A tokenizer of the same vocabulary (the server and the peers need one): Llama-2's
    # 32000 tokens, or Qwen2.5's (151,665 tokens in Qwen's 151,936-row embedding).
    name = {32000: "llama2", 151936: "qwen2.5"}.get(cfg.vocab_size)
    shared = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared")
    tok = os.path.join(shared, "tokenizers", name or "none")
    if name is None or not os.path.isdir(tok):
        print(
            f"warning: no tokenizer of {cfg.vocab_size} tokens ({os.path.normpath(tok)}): "
            f"{path} has none, so `steadylm serve`, `steadylm bench serve` and the peers "
            "that need one will fail on it",
            file=sys.stderr,
        )
    else:
        for f in os.listdir(tok):
            if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy(os.path.join(tok, f), os.path.join(path, f))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-110m")
    args = ap.parse_args(argv)
    build(args.path, args.seed, args.dtype, args.shape)
    print(args.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
