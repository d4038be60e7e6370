"""KV cache quantization quality: logit error against quant_policy 0 and perplexity on
held-out text, through the real paged path (`LLMEngine.score`).

Models: stories260K (head_dim 8; held-out children's stories written for this benchmark, not
from its training set) and a random-weight Llama with head_dim 128 (text: the fp32 model's own
samples). Variant "k8v4" measures a candidate fix: keys quantized to 8 bits, values to 4.

    python benchmarks/kv_quant_quality.py --out bench_out/kv_quant.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from steadylm.attention.torch_ref import TorchAttentionBackend, dequantize_kv, quantize_kv
from steadylm.config import EngineConfig
from steadylm.engine.llm_engine import LLMEngine

HERE = os.path.dirname(os.path.abspath(__file__))
STORIES = os.path.join(HERE, "..", "..", "shared", "models", "stories260K")


class K8V4Backend(TorchAttentionBackend):
    """quant_policy 8 storage, with V rounded through 4 bits first: the numerics of K8/V4."""

    def write(self, cache, layer, k, v, md):
        codes, sz = quantize_kv(v, 4)
        super().write(cache, layer, k, dequantize_kv(codes, sz, 4).to(v.dtype), md)


def engine(model_dir_or_model, policy: str, **kw) -> LLMEngine:
    qp = {"fp": 0, "int8": 8, "int4": 4, "k8v4": 8}[policy]
    cfg = EngineConfig(
        num_gpu_blocks=kw.pop("blocks", 256),
        block_size=16,
        quant_policy=qp,
        max_prefill_token_num=kw.pop("chunk", 64),
        **kw,
    )
    if isinstance(model_dir_or_model, str):
        e = LLMEngine.from_pretrained(model_dir_or_model, cfg)
    else:
        e = LLMEngine.from_model(model_dir_or_model, cfg)
    if policy == "k8v4":
        e.runner.backend = K8V4Backend()
    return e


def compare(make, texts: list[list[int]]) -> dict:
    ref = make("fp")
    ref_logits = [ref.score(t) for t in texts]
    out = {}
    for policy in ("fp", "int8", "int4", "k8v4"):
        e = make(policy)
        nll, n, max_err, rel, agree, kl = 0.0, 0, 0.0, 0.0, 0, 0.0
        for t, rl in zip(texts, ref_logits):
            lg = e.score(t)
            tgt = torch.tensor(t[1:])
            nll += float(torch.nn.functional.cross_entropy(lg[:-1], tgt, reduction="sum"))
            n += len(t) - 1
            max_err = max(max_err, float((lg - rl).abs().max()))
            rel += float((lg - rl).norm() / rl.norm()) * len(t)
            agree += int((lg.argmax(-1) == rl.argmax(-1)).sum())
            kl += float(
                torch.nn.functional.kl_div(
                    lg.log_softmax(-1), rl.log_softmax(-1), log_target=True, reduction="sum"
                )
            )
        tokens = sum(len(t) for t in texts)
        out[policy] = {
            "ppl": math.exp(nll / n),
            "max_abs_logit_err": max_err,
            "rel_logit_err": rel / tokens,
            "top1_agreement": agree / tokens,
            "kl_per_token": kl / tokens,
            "kv_bytes_per_token": e.plan.kv_bytes_per_token,
        }
    base = out["fp"]["ppl"]
    for v in out.values():
        v["ppl_change_pct"] = 100 * (v["ppl"] / base - 1)
    return out


def stories_texts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    with open(os.path.join(HERE, "data", "heldout_stories.txt")) as f:
        stories = [s.strip() for s in f.read().split("\n\n") if s.strip()]
    return [tok.encode(s) for s in stories]


def random_hd128(seed: int = 0):
    from transformers import LlamaConfig

    from steadylm.demo import build_random_model

    cfg = LlamaConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
        tie_word_embeddings=True,
    )
    model = build_random_model(cfg, seed=seed)
    with torch.no_grad():  # larger weights than 0.02 so the model has a real distribution
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(3.0)
    return model


def sampled_texts(model, n: int = 6, length: int = 400) -> list[list[int]]:
    from steadylm.engine.request import SamplingParams

    e = LLMEngine.from_model(model, EngineConfig(num_gpu_blocks=512, block_size=16))
    reqs = e.generate(
        [[i + 2] for i in range(n)],
        [
            SamplingParams(max_new_tokens=length, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(n)
        ],
    )
    return [r.all_token_ids for r in reqs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    result = {}
    if os.path.isdir(STORIES):
        result["stories260K (head_dim 8)"] = compare(lambda p: engine(STORIES, p), stories_texts())
    model = random_hd128()
    texts = sampled_texts(model)
    result["random Llama (head_dim 128)"] = compare(lambda p: engine(model, p, blocks=512), texts)
    for name, rows in result.items():
        print(f"\n{name}")
        print(
            "| policy | KV B/token | ppl | ppl change | max |logit err| | rel logit err | "
            "top-1 agree | KL/token |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for p, r in rows.items():
            print(
                f"| {p} | {r['kv_bytes_per_token']} | {r['ppl']:.4f} | "
                f"{r['ppl_change_pct']:+.2f}% | {r['max_abs_logit_err']:.4f} | "
                f"{r['rel_logit_err']:.4f} | {100 * r['top1_agreement']:.1f}% | "
                f"{r['kl_per_token']:.5f} |"
            )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
