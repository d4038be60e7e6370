"""Quantize a dense HF Llama/Qwen2 directory to an AutoAWQ-format checkpoint (GEMM packing,
4 bits, zero point, round-to-nearest per group: no activation-aware search, which changes the
values but not the format or the speed).

    python benchmarks/make_awq_model.py bench_out/llama-110m bench_out/llama-110m-awq
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from safetensors.torch import load_file, save_file

from steadylm.layers.awq import quantize_rtn

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args(argv)
    os.makedirs(args.dst, exist_ok=True)
    tensors = load_file(os.path.join(args.src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            base = name[: -len(".weight")]
            qw, qz, sc = quantize_rtn(t, args.group_size)
            out[f"{base}.qweight"], out[f"{base}.qzeros"], out[f"{base}.scales"] = qw, qz, sc
        else:
            out[name] = t.half()
    save_file(out, os.path.join(args.dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.src, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "float16"
    cfg["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": args.group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    with open(os.path.join(args.dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for extra in (
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if os.path.exists(os.path.join(args.src, extra)):
            shutil.copy(os.path.join(args.src, extra), os.path.join(args.dst, extra))
    print(args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
