"""Compile every Triton kernel specialisation steadylm launches for an NVIDIA GPU, without one.

Run as `python -m tests.triton_ptx [SM]` (tests/attention/test_triton_compile.py does, in a
subprocess: TRITON_INTERPRET must be unset when the kernels are defined). A stand-in driver
reports a CUDA target, and every launch becomes a compile-only warm-up through Triton's real
CUDA backend (LLVM, PTX, ptxas): type errors, dot shapes and other rules that the interpreter
never checks fail here. It also reads the store kernel's PTX: quantization must divide with IEEE
rounding (div.rn.f32), as torch does, or the codes would not match the reference.
Prints one line per failure and a JSON summary last.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said (no warning)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

SM = int(sys.argv[1]) if len(sys.argv) > 1 else 90


class _StandInDriver:
    def get_current_target(self):
        return GPUTarget("cuda", SM, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


driver.set_active(_StandInDriver())
_run = JITFunction.run
COMPILED: dict[str, list] = {}


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    COMPILED.setdefault(self.__name__, []).append(kernel)
    return kernel


JITFunction.run = _compile_only

from steadylm.attention import triton_attn as ta  # noqa: E402
from steadylm.attention.base import (  # noqa: E402
    AttentionGroup,
    AttentionMetadata,
)
from steadylm.kernels import triton_awq, triton_moe, triton_ops  # noqa: E402


def attention(dtype, quant, heads, kv_heads, head_dim, q_lens, ctx, window=None, segments=None):
    backend = ta.TritonAttentionBackend(max_context=4096, max_segments=segments)
    cache = backend.allocate(1, 64, 16, kv_heads, head_dim, dtype, torch.device("cpu"), quant)
    tables = torch.zeros(len(q_lens), max(-(-c // 16) for c in ctx), dtype=torch.long)
    t = sum(q_lens)
    g = AttentionGroup(0, t, tables, torch.tensor(ctx), torch.tensor(q_lens), max(q_lens), max(ctx))
    md = AttentionMetadata(torch.zeros(t, dtype=torch.long), [g], 16, window)
    backend.prepare(md, cache)
    k = torch.zeros(t, kv_heads, head_dim, dtype=dtype)
    backend.write(cache, 0, k, k, md)
    backend.forward(torch.zeros(t, heads, head_dim, dtype=dtype), cache, 0, md, 0.1)


def awq(dtype, m, k, n, group, split):
    triton_awq.awq_gemm(
        torch.zeros(m, k, dtype=dtype),
        torch.zeros(k, n // 8, dtype=torch.int32),
        torch.zeros(k // group, n // 8, dtype=torch.int32),
        torch.zeros(k // group, n, dtype=torch.float16),
        group,
        split_k=split,
    )


def fused_moe(dtype, tokens, hidden, intermediate, experts, top_k):
    ids = torch.arange(tokens * top_k).view(tokens, top_k) % experts
    triton_moe.fused_experts(
        torch.zeros(tokens, hidden, dtype=dtype),
        torch.zeros(experts, 2 * intermediate, hidden, dtype=dtype),
        torch.zeros(experts, hidden, intermediate, dtype=dtype),
        torch.zeros(tokens, top_k, dtype=dtype),
        ids,
    )


def fused_moe_awq(dtype, tokens, hidden, intermediate, experts, top_k, group):
    ids = torch.arange(tokens * top_k).view(tokens, top_k) % experts

    def stack(k, n):
        return (
            torch.zeros(experts, k, n // 8, dtype=torch.int32),
            torch.zeros(experts, k // group, n // 8, dtype=torch.int32),
            torch.zeros(experts, k // group, n, dtype=torch.float16),
            group,
        )

    triton_moe.fused_experts(
        torch.zeros(tokens, hidden, dtype=dtype),
        stack(hidden, 2 * intermediate),
        stack(intermediate, hidden),
        torch.zeros(tokens, top_k, dtype=dtype),
        ids,
    )


def small_ops(dtype, tokens, hidden, heads, head_dim):
    x = torch.zeros(tokens, hidden, dtype=dtype)
    triton_ops.rms_norm(x, torch.zeros(hidden, dtype=dtype), 1e-6)
    triton_ops.rms_norm(x, torch.zeros(hidden, dtype=dtype), 1e-6, torch.zeros_like(x))
    triton_ops.silu_and_mul(torch.zeros(tokens, 2 * 5 * hidden, dtype=dtype))
    qkv = torch.zeros(tokens, heads + 2, head_dim, dtype=dtype)
    triton_ops.rms_norm(qkv[:, :heads], torch.zeros(head_dim, dtype=dtype), 1e-6)  # q norm
    cos = torch.zeros(tokens, 1, head_dim, dtype=dtype)
    triton_ops.rotary_(qkv[:, : heads + 1], cos, cos)


def cases():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for quant in (0, 8, 4):
            yield (
                attention,
                (dtype, quant, 40, 8, 128, [1, 1, 1], [10, 2000, 4000]),
                {"segments": 32},
            )
            yield attention, (dtype, quant, 28, 4, 128, [5, 1, 70], [5, 100, 90]), {}
        yield attention, (dtype, 4, 8, 4, 8, [3, 1], [3, 40]), {"window": 4}  # stories260K
        yield attention, (dtype, 0, 12, 2, 80, [1, 7], [9, 70]), {"window": 16}
        for m in (1, 64, 300):
            yield awq, (dtype, m, 4096, 1024, 128, None), {}
        yield awq, (dtype, 1, 512, 256, 32, 4), {}
        for tokens in (1, 300):  # Qwen3-30B-A3B (decode, prefill) and Mixtral-8x7B
            yield fused_moe, (dtype, tokens, 2048, 768, 128, 8), {}
        yield fused_moe, (dtype, 2, 4096, 14336, 8, 2), {}
        for tokens in (1, 300):  # Qwen3-30B-A3B-AWQ
            yield fused_moe_awq, (dtype, tokens, 2048, 768, 128, 8, 128), {}
        yield small_ops, (dtype, 1, 5120, 40, 128), {}  # a 32B model's shapes
        yield small_ops, (dtype, 3, 896, 14, 64), {}  # Qwen2.5-0.5B
        yield small_ops, (dtype, 2, 8192, 64, 80), {}


def main() -> int:
    failures = []
    count = 0
    for fn, args, kwargs in cases():
        count += 1
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # every failure is reported, then the next case runs
            last = traceback.format_exception_only(exc)[-1].strip()
            failures.append(f"{fn.__name__}{args[:3]} {kwargs}: {last[:600]}")
            print("FAIL", failures[-1], flush=True)
    store_divisions = set()
    for kernel in COMPILED.get("_store_kv_kernel", []):
        ptx = kernel.asm["ptx"]
        store_divisions |= {
            op for op in ("div.rn.f32", "div.full.f32", "div.approx.f32") if op in ptx
        }
    print(
        json.dumps(
            {
                "sm": SM,
                "cases": count,
                "failures": failures,
                "kernels": {name: len(v) for name, v in COMPILED.items()},
                "store_divisions": sorted(store_divisions),
            }
        )
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
