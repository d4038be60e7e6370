"""`steadylm plan`: the memory plan for any model on any GPU, with no GPU and no weights."""

from __future__ import annotations

import argparse
import json
import os
import re

import torch

from steadylm import catalog
from steadylm.config import EngineConfig, ModelConfig
from steadylm.errors import ConfigError
from steadylm.memory import (
    DTYPE_BYTES,
    DeviceMemory,
    GiB,
    MemoryPlan,
    awq_layout,
    fmt_bytes,
    parameter_counts,
    plan_memory,
    tp_shape,
    weight_bytes_from_config,
)

# What a CUDA context and the allocator take before the engine loads anything; measured free
# memory replaces this assumption at real startup.
CUDA_CONTEXT_BYTES = 512 << 20


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="print the memory plan for a model on a GPU (no GPU or weights needed)",
        description="MODEL is a model directory, a .gguf file, a config.json, or a catalog name: "
        + ", ".join(catalog.model_names()),
    )
    p.add_argument("model", help="model directory, .gguf file, config.json path, or catalog name")
    p.add_argument(
        "--gpu",
        default=None,
        help="GPU by name (" + ", ".join(catalog.GPUS) + ") or 'cpu' for this machine",
    )
    p.add_argument("--gpu-memory", default=None, help="device memory instead, e.g. 24GiB or 80GB")
    p.add_argument(
        "--dtype",
        default="auto",
        help="weights/activations dtype (auto: the checkpoint's, fp16 for AWQ)",
    )
    p.add_argument("--quant-policy", type=int, default=0, choices=[0, 4, 8])
    p.add_argument("--session-len", type=int, default=None)
    p.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="also answer: the largest session_len for this many requests",
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--max-prefill-token-num", type=int, default=4096)
    p.add_argument("--cache-max-entry-count", type=float, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--num-gpu-blocks", type=int, default=0)
    p.add_argument(
        "--eager-mode",
        action="store_true",
        help="plan without decode CUDA graphs (their memory goes to the KV cache)",
    )
    from steadylm.entrypoints.cli import SPEC_FLAGS

    g = p.add_argument_group("speculative decoding")
    for flag, kw in SPEC_FLAGS:
        g.add_argument(flag, **kw)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*(GiB|GB|MiB|MB|TiB|TB)?\s*", text, re.I)
    if not m:
        raise ConfigError(
            f"--gpu-memory {text!r}: write a size such as 24GiB or 80GB", param="gpu_memory"
        )
    units = {"gib": GiB, "gb": 10**9, "mib": 1 << 20, "mb": 10**6, "tib": 1 << 40, "tb": 10**12}
    return int(float(m.group(1)) * units[(m.group(2) or "GiB").lower()])


def resolve_model(arg: str) -> tuple[ModelConfig, str | None]:
    """-> (config, model dir with weights or None)."""
    if os.path.isdir(arg) or arg.endswith(".gguf"):
        return ModelConfig.from_path(arg), arg
    if os.path.isfile(arg):
        return ModelConfig.from_path(arg), None
    path = catalog.model_config_path(arg)
    if path is None:
        raise ConfigError(
            f"{arg!r} is not a directory, a config.json, or a catalog name "
            f"({', '.join(catalog.model_names())})",
            param="model",
        )
    return ModelConfig.from_path(path), None


def resolve_device(args) -> DeviceMemory:
    if args.gpu_memory:
        total = parse_size(args.gpu_memory)
        return DeviceMemory(f"{args.gpu_memory} device", total, total - CUDA_CONTEXT_BYTES)
    if args.gpu in (None, "cpu"):
        from steadylm.platform import device_memory

        return device_memory(torch.device("cpu"))
    gpu = catalog.GPUS.get(args.gpu.lower())
    if gpu is None:
        raise ConfigError(
            f"unknown GPU {args.gpu!r}; known: {', '.join(catalog.GPUS)}, or pass --gpu-memory",
            param="gpu",
        )
    return DeviceMemory(gpu.name, gpu.total_bytes, gpu.total_bytes - CUDA_CONTEXT_BYTES)


def plan_dtype(args, mc: ModelConfig) -> str:
    if args.dtype != "auto":
        return {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(
            args.dtype, args.dtype
        )
    if mc.quantization:
        return "float16"
    return mc.torch_dtype if mc.torch_dtype in DTYPE_BYTES else "bfloat16"


def make(args) -> tuple[MemoryPlan, ModelConfig]:
    from steadylm.entrypoints.cli import speculative_from_args

    mc, model_dir = resolve_model(args.model)
    device = resolve_device(args)
    dtype = plan_dtype(args, mc)
    if dtype not in DTYPE_BYTES:
        raise ConfigError(
            f"--dtype {args.dtype!r}: use float16, bfloat16 or float32", param="dtype"
        )
    ec = EngineConfig(
        session_len=args.session_len,
        max_batch_size=args.max_batch_size,
        max_prefill_token_num=args.max_prefill_token_num,
        block_size=args.block_size,
        quant_policy=args.quant_policy,
        num_gpu_blocks=args.num_gpu_blocks,
        max_total_tokens=args.max_total_tokens,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cache_max_entry_count=args.cache_max_entry_count,
        eager_mode=args.eager_mode,
        speculative_config=speculative_from_args(args),
    )
    weights = None
    if mc.quantization or args.tp > 1:
        # AWQ: the layout steadylm holds on that device (memory.linear_bytes); tp > 1: one
        # rank's shards, which the architecture gives exactly (a file total cannot say what
        # each rank holds)
        layout = awq_layout("cpu" if args.gpu in (None, "cpu") and not args.gpu_memory else "cuda")
        weights = weight_bytes_from_config(mc, DTYPE_BYTES[dtype], args.tp, layout=layout)
    elif model_dir is not None:
        from steadylm.loader import checkpoint_weight_bytes

        try:
            weights = checkpoint_weight_bytes(model_dir, _torch_dtype(dtype))
        except Exception:  # a config-only directory: count from the architecture
            weights = None
    plan = plan_memory(
        mc,
        ec.replace(tp=1),
        device,
        DTYPE_BYTES[dtype],
        weight_bytes=weights,
        is_cpu=device.name == "cpu",
        tp=args.tp,
    )
    return plan, mc


def _rank_shape(mc: ModelConfig, tp: int) -> str:
    if tp == 1:
        return ""
    heads, kv_heads, inter, vocab = tp_shape(mc, tp)
    return (
        f" (per rank: {heads} heads, {kv_heads} KV heads, intermediate {inter:,}, "
        f"{vocab:,} vocab rows)"
    )


def _torch_dtype(name: str) -> torch.dtype:
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def run(args: argparse.Namespace) -> int:
    plan, mc = make(args)
    n = max(1, args.concurrency)
    total, active = parameter_counts(mc)
    answer = {
        "tokens_that_fit": plan.total_tokens,
        "concurrency": n,
        "max_session_len_for_concurrency": plan.max_session_len_for(n),
        "parameters": total,
        "active_parameters": active,
    }
    if args.json:
        print(json.dumps({"model": args.model, **plan.to_dict(), **answer}, indent=2))
        return 0
    quant = " AWQ int4" if mc.quantization else ""
    print(
        f"{args.model}: {mc.architecture}{quant}, {mc.num_layers} layers, "
        f"{mc.num_kv_heads} KV heads x head_dim {mc.head_dim}, tp={args.tp}"
        + _rank_shape(mc, args.tp)
    )
    if mc.is_moe:
        shared = ", a shared expert" if mc.shared_expert_intermediate_size else ""
        print(
            f"  mixture of experts: {len(mc.moe_layers)} of {mc.num_layers} layers sparse, "
            f"{mc.num_experts} experts of {mc.moe_intermediate_size:,}, "
            f"{mc.num_experts_per_tok} per token{shared}; {total / 1e9:.2f}B parameters, "
            f"{active / 1e9:.2f}B active per token (all experts' weights are held)"
        )
    else:
        print(f"  {total / 1e9:.2f}B parameters")
    gguf_note = _gguf_note(args.model, plan)
    if gguf_note:
        print(gguf_note)
    print(plan.table())
    print(
        f"  {n} concurrent request(s) fit at session_len <= "
        f"{answer['max_session_len_for_concurrency']:,}"
    )
    print(f"  ({fmt_bytes(plan.kv_cache_bytes)} of KV = {plan.total_tokens:,} tokens)")
    return 0


def _gguf_note(model: str, plan: MemoryPlan) -> str | None:
    """For a GGUF file: its size and tensor types beside the dequantized bytes held."""
    from steadylm import gguf_file

    if not os.path.exists(model):
        return None
    path = gguf_file.find_gguf(model)
    if path is None:
        return None
    types: dict[str, int] = {}
    for t in gguf_file.reader(path).tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(types.items(), key=lambda kv: -kv[1]))
    return (
        f"GGUF file: {fmt_bytes(gguf_file.file_bytes(path))} ({kinds} tensors), dequantized "
        f"at load: the weights below are what is held"
    )
