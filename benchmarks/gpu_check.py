"""The one prepared device check: parity, kernels at real shapes, decode speed and memory on a
CUDA GPU, written as JSON and as markdown ready for docs/benchmarks.md (also printed).

    python benchmarks/gpu_check.py --out bench_out/gpu_check [--budget-s 270]
    python benchmarks/gpu_check.py --smoke --device cpu --out /tmp/x  # tiny shapes, any machine

Sections (each records its own error and the rest still run):
  parity       a tiny fp32 Llama, token for token against transformers' greedy generate(), with
               CUDA graphs and with eager_mode=True, and under quant_policy 8 (graphs == eager);
               a ~1B bf16 Llama: matched greedy tokens and the first step's logit difference.
  kernels      Triton attention against the torch reference at 32B-like shapes (40 query heads,
               8 KV heads, head_dim 128; bf16, fp16; quant_policy 0/8/4), both also against an
               fp32 computation over the same (dequantized) cache; then decode timing at 32k.
  bench        the ~1B model: decode step time (all-decode steps only) at batch 1 and 64, with
               CUDA graphs and eager (the same engine with its graphs set aside, which is what
               eager_mode=True builds), as a share of the HBM bound (weights + KV read per step
               over a measured device copy); transformers generate() per token; W1 / W2.
  profile      a batch-1 decode step's kernels: how many, their summed GPU time against the
               step's wall time, the top ones (graphs and eager; CUDA only).
  memory       the memory plan against what capture took and the peak allocation.
  bench_large  a ~7B-shaped random model (no checkpoint: random weights on the device), only
               when the time budget allows.
Optional pieces are skipped, with the reason, when --budget-s would run out. --smoke runs the
same code paths at tiny shapes; on the CPU (Triton's interpreter) the GPU-only parts (graphs,
bf16 kernels, CUDA memory) are marked skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("parity", "kernels", "moe", "bench", "profile", "memory", "bench_large")
BLOCK = 64  # the engine's default KV block size, used by every case here


@dataclass(frozen=True)
class Shapes:
    tiny: dict  # LlamaConfig kwargs: the fp32 parity model
    big: dict  # the ~1B model (parity and bench)
    large: dict  # the ~7B-shaped bench model
    new_tokens: int  # parity: greedy tokens per prompt
    heads: tuple[int, int, int]  # kernels: query heads, KV heads, head_dim
    kv_context: int  # kernels: the accuracy cases' prefix
    chunk: int  # kernels: new tokens of the chunked-prefill case
    timing_context: int
    timing_batches: tuple[int, ...]
    runs: int
    warmup: int
    max_batch: int
    decode_cases: tuple[tuple[int, int], ...]  # (batch, context), most important first
    workloads: dict = field(default_factory=dict)  # name -> (prompts, input_len, output_len)
    hf_contexts: tuple[int, ...] = ()
    copy_bytes: int = 1 << 30


_LLAMA = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
FULL = Shapes(
    tiny=dict(_LLAMA, vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=512, initializer_range=0.2),
    big=dict(_LLAMA, vocab_size=32000, hidden_size=2048, intermediate_size=5632,
             num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             max_position_embeddings=40960, initializer_range=0.02),
    large=dict(_LLAMA, vocab_size=32000, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=40960, initializer_range=0.02),
    new_tokens=32, heads=(40, 8, 128), kv_context=8192, chunk=512, timing_context=32768,
    timing_batches=(1, 8), runs=20, warmup=3, max_batch=64,
    decode_cases=((1, 8192), (1, 32768), (1, 512), (64, 512), (64, 8192)),
    workloads={"W1": (16, 256, 128), "W2": (1, 256, 128)},
    hf_contexts=(512, 8192, 32768),
)  # fmt: skip
SMOKE = Shapes(
    tiny=dict(_LLAMA, vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, initializer_range=0.2),
    big=dict(_LLAMA, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             initializer_range=0.02),
    large=dict(_LLAMA, vocab_size=256, hidden_size=96, intermediate_size=160,
               num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
               max_position_embeddings=512, initializer_range=0.02),
    new_tokens=16, heads=(10, 2, 16), kv_context=32, chunk=8, timing_context=32,
    timing_batches=(1, 2), runs=2, warmup=1, max_batch=4, decode_cases=((1, 64), (4, 64)),
    workloads={"W1": (4, 16, 8), "W2": (1, 16, 8)}, hf_contexts=(64,), copy_bytes=64 << 20,
)  # fmt: skip


class Terminated(BaseException):
    """SIGTERM (the shell step's timeout): record what is done and stop."""


# ---- shared state --------------------------------------------------------------------------
class Context:
    def __init__(self, args: argparse.Namespace) -> None:
        self.smoke = args.smoke
        self.shapes = SMOKE if args.smoke else FULL
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.deadline = time.monotonic() + args.budget_s
        self.t0 = time.monotonic()
        self.tmp = tempfile.TemporaryDirectory(prefix="gpu_check-")
        self.checks: list[dict] = []
        self._big: tuple | None = None
        self.build_memory: dict = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        print(f"[gpu_check {time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return ok

    def big(self):
        """(transformers model, its saved directory, steadylm engine) of the ~1B model, built
        once; the engine is sized for every decode case of the bench section."""
        if self._big is None:
            hf, path = hf_model_dir(self, "big", self.shapes.big, torch.bfloat16)
            sync(self.device)
            before = torch.cuda.memory_allocated() if self.cuda else 0
            engine = make_engine(self, path, self.shapes.decode_cases, dtype="bfloat16")
            if self.cuda:
                sync(self.device)
                self.build_memory = {
                    "allocated_before": before,
                    "allocated_after": torch.cuda.memory_allocated(),
                    "reserved_after": torch.cuda.memory_reserved(),
                    "kv_cache_bytes": engine.kv_cache.num_bytes,
                    "weight_bytes": engine.plan.weight_bytes,
                }
            self._big = (hf, path, engine)
        return self._big

    def release_big(self) -> None:
        self._big = None
        free_memory(self.device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def median_ms(fn, device: torch.device, runs: int, warmup: int) -> float:
    """Median time of fn() in ms: CUDA events on the GPU (each call alone), else wall time."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def graph_ms(fn, runs: int, warmup: int) -> float:
    """Median time of one replay of fn captured in a CUDA graph (no launch cost)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, torch.device("cuda"), runs, warmup)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


# ---- models and engines ----------------------------------------------------------------------
def hf_model_dir(ctx: Context, name: str, kw: dict, dtype: torch.dtype):
    """A random transformers Llama on the device, saved to a temporary directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LlamaForCausalLM(LlamaConfig(**kw)).to(dtype).eval()
    path = os.path.join(ctx.tmp.name, name)
    model.save_pretrained(path)
    ctx.log(f"saved the {name} model ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M)")
    return model, path


def engine_config(ctx: Context, cases, **kw):
    """Blocks for the largest decode case (plus slack for the decoded tokens and the
    watermark), session_len for the longest."""
    from steadylm.config import EngineConfig

    pad = 2 * (ctx.shapes.warmup + ctx.shapes.runs) + 2 * BLOCK
    blocks = max(b * math.ceil((c + pad) / BLOCK) for b, c in cases)
    longest = max(c for _, c in cases) + pad
    kw.setdefault("max_batch_size", ctx.shapes.max_batch)
    return EngineConfig(
        device=ctx.device.type,
        session_len=longest,
        max_prefill_token_num=min(8192, max(512, longest)),
        num_gpu_blocks=int(blocks * 1.03) + 16,
        log_stats_interval_s=1e9,
        **kw,
    )


def make_engine(ctx: Context, path: str, cases, **kw):
    from steadylm.engine.llm_engine import LLMEngine

    return LLMEngine.from_pretrained(path, engine_config(ctx, cases, **kw))


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- 1. parity -------------------------------------------------------------------------------
def section_parity(ctx: Context) -> dict:
    return {"tiny_fp32": attempt(ctx, parity_tiny), "big_bf16": attempt(ctx, parity_big)}


def parity_tiny(ctx: Context) -> dict:
    from steadylm.engine.request import SamplingParams

    sh = ctx.shapes
    hf, path = hf_model_dir(ctx, "tiny", sh.tiny, torch.float32)
    prompts = [random_prompts(1, n, sh.tiny["vocab_size"], n)[0] for n in (5, 9, 17, 30)]
    params = SamplingParams(max_new_tokens=sh.new_tokens, ignore_eos=True)
    expected = [hf_greedy(hf, p, sh.new_tokens) for p in prompts]
    out = {}
    for quant in (0, 8):
        runs = {}
        for mode in ("graphs", "eager") if ctx.cuda else ("eager",):
            cfg = dict(dtype="float32", quant_policy=quant, eager_mode=mode == "eager")
            engine = make_engine(ctx, path, [(4, 64)], max_batch_size=4, **cfg)
            tokens = [r.output_token_ids for r in engine.generate(prompts, params)]
            g = engine.runner.graphs
            runs[mode] = {
                "matched_hf": [common_prefix(t, e) for t, e in zip(tokens, expected)],
                "replays": dict(g.replays) if g is not None else None,
                "tokens": tokens,
            }
            del engine
            free_memory(ctx.device)
        if not ctx.cuda:
            runs["graphs"] = {"skipped": "no CUDA graphs on the CPU"}
        res = {m: {k: v for k, v in r.items() if k != "tokens"} for m, r in runs.items()}
        for mode, r in runs.items():
            if quant == 0 and "tokens" in r:
                ctx.check(f"parity tiny fp32 {mode} == transformers", r["tokens"] == expected)
        if "tokens" in runs["graphs"]:
            same = runs["graphs"]["tokens"] == runs["eager"]["tokens"]
            res["graphs_equal_eager"] = ctx.check(f"parity tiny q{quant} graphs == eager", same)
            used = sum((runs["graphs"]["replays"] or {}).values())
            ctx.check(f"parity tiny q{quant} graphs replayed", used > 0, f"{used} replays")
        out[f"quant_{quant}"] = res
    return out


def parity_big(ctx: Context) -> dict:
    from steadylm.engine.request import SamplingParams

    hf, _, engine = ctx.big()
    n, vocab = ctx.shapes.new_tokens, ctx.shapes.big["vocab_size"]
    prompts = [random_prompts(1, k, vocab, 100 + k)[0] for k in (16, 37, 64, 101)]
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    ours = [r.output_token_ids for r in engine.generate(prompts, params)]
    theirs = [hf_greedy(hf, p, n) for p in prompts]
    with torch.inference_mode():
        mine = engine.score(prompts[0])[-1].float()
        ref = hf(torch.tensor([prompts[0]], device=hf.device)).logits[0, -1].float()
    diff = float((mine - ref).abs().max())
    return {
        "prompts": len(prompts),
        "new_tokens": n,
        "matched_prefix": [common_prefix(a, b) for a, b in zip(ours, theirs)],
        "equal_positions": [sum(x == y for x, y in zip(a, b)) for a, b in zip(ours, theirs)],
        "first_step_max_logit_diff": diff,
        "first_step_rel_logit_diff": diff / float(ref.abs().max()),
        "first_step_top1_equal": int(mine.argmax()) == int(ref.argmax()),
    }


# ---- 2. kernels ------------------------------------------------------------------------------
def layout(seqs, num_blocks: int, seed: int = 0):
    """Random distinct blocks per sequence: (tables (S, W), history slots, new-token slots)."""
    gen = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, hist, new = [], [], []
    for q_len, cached in seqs:
        n = -(-(q_len + cached) // BLOCK)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached + q_len)]
        hist, new = hist + slots[:cached], new + slots[cached:]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return padded, torch.tensor(hist), torch.tensor(new)


def metadata(seqs, tables, slots, device):
    from steadylm.attention.base import AttentionGroup, AttentionMetadata

    q_lens = torch.tensor([q for q, _ in seqs])
    ctx = torch.tensor([c for _, c in seqs]) + q_lens
    group = AttentionGroup(
        0, int(q_lens.sum()), tables.to(device), ctx.to(device), q_lens.to(device),
        int(q_lens.max()), int(ctx.max()), host_context_lens=ctx, host_query_lens=q_lens,
        host_block_tables=tables,
    )  # fmt: skip
    return AttentionMetadata(slots.to(device), [group], BLOCK)


def fill_history(ctx: Context, backends, caches, seqs, tables, hist) -> None:
    """The same random history K/V written through each backend's own store."""
    _, hkv, d = ctx.shapes.heads
    dtype = caches[0].k_scale_zero.dtype if caches[0].quant_policy else caches[0].k.dtype
    kh = torch.randn(len(hist), hkv, d, device=ctx.device, dtype=dtype)
    vh = torch.randn(len(hist), hkv, d, device=ctx.device, dtype=dtype)
    for backend, cache in zip(backends, caches):
        md = metadata(seqs, tables, hist, ctx.device)
        backend.prepare(md, cache)  # the reference zeroes the blocks it gathers whole
        backend.write(cache, 0, kh, vh, md)


def dequantized(cache, which: str, slots: torch.Tensor) -> torch.Tensor:
    """Layer 0's keys or values at flat slots, (N, Hkv, D) in fp32."""
    from steadylm.attention.torch_ref import dequantize_kv

    data = getattr(cache, which)[0].flatten(0, 1)[slots]
    if not cache.quant_policy:
        return data.float()
    sz = getattr(cache, f"{which[0]}_scale_zero")[0].flatten(0, 1)[slots]
    return dequantize_kv(data, sz.float(), cache.quant_policy)


def exact_attention(q, cache, seqs, tables, scale: float) -> torch.Tensor:
    """Causal attention in fp32 over the cache's (dequantized) contents, sequence by sequence."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // cache.k.shape[3]
    start = 0
    for i, (q_len, cached) in enumerate(seqs):
        n = q_len + cached
        pos = torch.arange(n, device=q.device)
        slots = tables[i].to(q.device)[pos // BLOCK] * BLOCK + pos % BLOCK
        k = dequantized(cache, "k", slots).repeat_interleave(group, dim=1)  # (n, H, D)
        v = dequantized(cache, "v", slots).repeat_interleave(group, dim=1)
        qi = q[start : start + q_len].float()  # (q, H, D)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale
        s.masked_fill_(pos[None, None, :] > (cached + pos[:q_len])[None, :, None], float("-inf"))
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        start += q_len
    return out


def accuracy_case(ctx: Context, name: str, seqs, dtype: torch.dtype, quant: int) -> dict:
    from steadylm.attention.torch_ref import TorchAttentionBackend
    from steadylm.attention.triton_attn import TritonAttentionBackend

    h, hkv, d = ctx.shapes.heads
    torch.manual_seed(quant)
    tables, hist, new = layout(seqs, sum(-(-(q + c) // BLOCK) for q, c in seqs) + 4)
    backends = (TorchAttentionBackend(), TritonAttentionBackend())
    num_blocks = int(tables.max()) + 1
    caches = [b.allocate(1, num_blocks, BLOCK, hkv, d, dtype, ctx.device, quant) for b in backends]
    fill_history(ctx, backends, caches, seqs, tables, hist)
    t = sum(q for q, _ in seqs)
    q = torch.randn(t, h, d, device=ctx.device, dtype=dtype)
    k, v = (torch.randn(t, hkv, d, device=ctx.device, dtype=dtype) for _ in range(2))
    outs = []
    for backend, cache in zip(backends, caches):
        md = metadata(seqs, tables, new, ctx.device)
        backend.prepare(md, cache)
        backend.write(cache, 0, k, v, md)
        outs.append(backend.forward(q, cache, 0, md, d**-0.5).float())
    truth = exact_attention(q, caches[0], seqs, tables, d**-0.5)
    peak = float(truth.abs().max())
    slots = torch.cat([hist, new]).to(ctx.device)
    parts = [(c.k, c.v, c.k_scale_zero, c.v_scale_zero) for c in caches]
    store_equal = all(
        torch.equal(a[0].flatten(0, 1)[slots], b[0].flatten(0, 1)[slots])
        for a, b in zip(*parts)
        if a is not None
    )
    res = {
        "case": name, "dtype": str(dtype).replace("torch.", ""), "quant": quant,
        "max_abs_err": float((outs[1] - outs[0]).abs().max()),
        "rel_err": float((outs[1] - outs[0]).abs().max()) / peak,
        "triton_rel_err_vs_fp32": float((outs[1] - truth).abs().max()) / peak,
        "reference_rel_err_vs_fp32": float((outs[0] - truth).abs().max()) / peak,
        "store_bit_exact": store_equal,
    }  # fmt: skip
    floor = 2e-2 if dtype == torch.bfloat16 else 4e-3
    ok = res["triton_rel_err_vs_fp32"] <= max(2 * res["reference_rel_err_vs_fp32"], floor)
    label = f"kernel {name} {res['dtype']} q{quant}"
    ctx.check(label + " accuracy", ok, f"triton {res['triton_rel_err_vs_fp32']:.2e}")
    ctx.check(label + " store bit-exact", store_equal)
    return res


def timing_case(ctx: Context, batch: int, quant: int, dtype: torch.dtype) -> dict:
    """Decode at the timing context: one cache, the Triton forward and the reference forward
    (gather + SDPA) over it; preparation outside the timed calls."""
    from steadylm.attention.torch_ref import TorchAttentionBackend
    from steadylm.attention.triton_attn import TritonAttentionBackend

    h, hkv, d = ctx.shapes.heads
    sh = ctx.shapes
    seqs = ((1, sh.timing_context - 1),) * batch
    tables, hist, new = layout(seqs, batch * -(-sh.timing_context // BLOCK) + 2)
    ref, tri = TorchAttentionBackend(), TritonAttentionBackend()
    num_blocks = int(tables.max()) + 1
    cache = tri.allocate(1, num_blocks, BLOCK, hkv, d, dtype, ctx.device, quant)
    fill_history(ctx, (ref, tri), (cache, cache), seqs, tables, hist)
    q = torch.randn(batch, h, d, device=ctx.device, dtype=dtype)
    md_tri, md_ref = (metadata(seqs, tables, new, ctx.device) for _ in range(2))
    tri.prepare(md_tri, cache)
    tri.write(cache, 0, q[:, :hkv], q[:, :hkv], md_tri)
    ref.prepare(md_ref, cache)
    scale = d**-0.5
    run_tri = lambda: tri.forward(q, cache, 0, md_tri, scale)
    run_ref = lambda: ref.forward(q, cache, 0, md_ref, scale)
    res = {
        "batch": batch, "context": sh.timing_context, "quant": quant,
        "dtype": str(dtype).replace("torch.", ""),
        "triton_ms": median_ms(run_tri, ctx.device, sh.runs, sh.warmup),
        "reference_ms": median_ms(run_ref, ctx.device, sh.runs, sh.warmup),
        "kv_bytes": batch * sh.timing_context * cache.num_bytes // (num_blocks * BLOCK),
    }  # fmt: skip
    res["speedup"] = res["reference_ms"] / res["triton_ms"]
    res["triton_GBps"] = res["kv_bytes"] / res["triton_ms"] / 1e6
    if ctx.cuda:  # the engine replays decode attention inside its CUDA graphs: no launch cost
        res["triton_graph_ms"] = graph_ms(run_tri, sh.runs, sh.warmup)
        res["speedup_graph"] = res["reference_ms"] / res["triton_graph_ms"]
        res["triton_graph_GBps"] = res["kv_bytes"] / res["triton_graph_ms"] / 1e6
    return res


def section_kernels(ctx: Context) -> dict:
    sh = ctx.shapes
    # Triton's interpreter cannot run a bf16 dot; fp32 runs in the kernel tests
    dtypes = (torch.bfloat16, torch.float16) if ctx.cuda else (torch.float16,)
    c = sh.kv_context  # decodes at about c; chunks of new tokens over a prefix of about c
    cases = {
        "decode": tuple((1, c - k) for k in (0, c // 40, c // 4, 1)),
        "chunked_prefill": ((sh.chunk, c), (sh.chunk, c - c // 27)),
    }
    accuracy = []
    for dtype in dtypes:
        for quant in (0, 8, 4):
            for name, seqs in cases.items():
                accuracy.append(attempt(ctx, accuracy_case, name, seqs, dtype, quant))
    ctx.log("kernels: accuracy done")
    timing = []
    for quant in (0, 4):
        for batch in sh.timing_batches:
            timing.append(attempt(ctx, timing_case, batch, quant, dtypes[0]))
            free_memory(ctx.device)
    out = {"accuracy": accuracy, "timing": timing}
    if not ctx.cuda:
        out["bf16"] = "skipped: Triton's interpreter cannot run a bf16 dot (fp16 only)"
    return out


# ---- mixture of experts ----------------------------------------------------------------------
def section_moe(ctx: Context) -> dict:
    return {"parity": attempt(ctx, moe_parity), "kernel": attempt(ctx, moe_kernel)}


def moe_parity(ctx: Context) -> dict:
    """A tiny Qwen3-MoE in fp32 (8 experts, top 2): greedy as transformers with the fused
    kernel, in decode CUDA graphs and eagerly."""
    import transformers

    from steadylm.engine.request import SamplingParams

    tiny = {k: v for k, v in ctx.shapes.tiny.items() if k not in ("bos_token_id", "eos_token_id")}
    cfg = transformers.Qwen3MoeConfig(
        **tiny, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True
    )
    torch.manual_seed(0)
    with torch.device(ctx.device):
        hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.data.normal_(0, 1.0)  # a router that routes
    path = os.path.join(ctx.tmp.name, "tiny-moe")
    hf.save_pretrained(path)
    n = ctx.shapes.new_tokens
    prompts = [random_prompts(1, k, cfg.vocab_size, k)[0] for k in (5, 9, 17)]
    expected = [hf_greedy(hf, p, n) for p in prompts]
    out = {}
    for mode in ("graphs", "eager") if ctx.cuda else ("eager",):
        engine = make_engine(
            ctx, path, [(4, 64)], max_batch_size=4, dtype="float32", eager_mode=mode == "eager"
        )
        blocks = [m for m in engine.runner.model.modules() if type(m).__name__ == "SparseMoeBlock"]
        tokens = [
            r.output_token_ids
            for r in engine.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True))
        ]
        g = engine.runner.graphs
        out[mode] = {
            "fused": all(b.stacked is not None for b in blocks),
            "matched_hf": [common_prefix(t, e) for t, e in zip(tokens, expected)],
            "replays": sum(g.replays.values()) if g is not None else None,
        }
        ctx.check(f"moe tiny {mode} == transformers", tokens == expected)
        if ctx.cuda:
            ctx.check(f"moe tiny {mode}: the fused kernel ran", out[mode]["fused"])
            if mode == "graphs":
                ctx.check("moe tiny: decode graphs replayed", (out[mode]["replays"] or 0) > 0)
        del engine
        free_memory(ctx.device)
    return out


def moe_kernel(ctx: Context) -> dict:
    """The fused kernel against the per-expert reference at Qwen3-30B-A3B's widths (hidden
    2048, 128 experts of 768, top 8): error, time, and the routed weights' read rate."""
    from steadylm.kernels import triton_moe
    from steadylm.layers import moe

    h, i, e, k = (2048, 768, 128, 8) if ctx.cuda else (64, 32, 8, 2)
    dtype = torch.bfloat16 if ctx.cuda else torch.float16
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device=ctx.device, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=ctx.device, generator=gen) / i**0.5).to(dtype)
    rows = []
    for t in (1, 16, 256) if ctx.cuda else (1, 4):
        x = torch.randn(t, h, device=ctx.device, generator=gen).to(dtype)
        logits = torch.randn(t, e, device=ctx.device, generator=gen).to(dtype)
        weights, ids = moe.select_experts(logits, k, renormalize=True)
        got = triton_moe.fused_experts(x, w13, w2, weights, ids)
        ref = moe.stacked_experts_reference(
            x.float(), w13.float(), w2.float(), weights.float(), ids
        )
        err = float((got.float() - ref).abs().max() / ref.abs().max())
        ms = median_ms(
            lambda x=x, w=weights, ids=ids: triton_moe.fused_experts(x, w13, w2, w, ids),
            ctx.device,
            ctx.shapes.runs,
            ctx.shapes.warmup,
        )
        ref_ms = median_ms(
            lambda x=x, w=weights, ids=ids: moe.stacked_experts_reference(x, w13, w2, w, ids),
            ctx.device,
            ctx.shapes.runs,
            ctx.shapes.warmup,
        )
        used = int(ids.unique().numel())
        read = used * 3 * i * h * w13.element_size()
        rows.append(
            {
                "tokens": t,
                "experts_used": used,
                "rel_err": err,
                "fused_ms": ms,
                "reference_ms": ref_ms,
                "weights_GBps": read / ms / 1e6,
            }
        )
        ctx.check(f"moe fused T={t} close to the reference", err < 2e-2, f"{err:.2e}")
    return {"shape": {"hidden": h, "intermediate": i, "experts": e, "top_k": k}, "rows": rows}


# ---- 3. bench --------------------------------------------------------------------------------
def copy_bandwidth(ctx: Context) -> float:
    """Bytes read + written per second by a large device-to-device copy (median)."""
    src = torch.ones(ctx.shapes.copy_bytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), ctx.device, 10, 2)
    return 2 * src.numel() / (ms / 1000)


def weight_read_bytes(engine) -> int:
    """Weights a decode step reads: all of them but the embedding table (one row each),
    unless the LM head shares it."""
    emb = engine.runner.model.model.embed_tokens.weight
    tied = engine.model_config.tie_word_embeddings
    return engine.plan.weight_bytes - (0 if tied else emb.numel() * emb.element_size())


def prefill_until_decoding(ctx: Context, engine, batch: int, reserve: float) -> float | None:
    """Step until one step decodes the whole batch; seconds taken, or None if the budget ran
    out first."""
    t0 = time.perf_counter()
    while True:
        engine.step()
        r = engine.step_log[-1]
        if r.num_seqs == batch and r.num_tokens == batch:
            return time.perf_counter() - t0
        if ctx.left() < reserve:
            return None


def timed_steps(engine, n: int, warmup: int) -> dict:
    """Medians over `n` steps after `warmup`, and the context tokens (KV read) per step."""
    for _ in range(warmup):
        engine.step()
    recs, tokens = [], []
    for _ in range(n):
        tokens.append(sum(r.num_tokens for r in engine.requests.values()))
        engine.step()
        recs.append(engine.step_log[-1])
    decode = [r for r in recs if r.num_tokens == r.num_seqs]
    return {
        "step_ms": 1000 * statistics.median(r.seconds for r in decode),
        "model_ms": 1000 * statistics.median(r.model_seconds for r in decode),
        "steps": len(decode),
        "context_tokens": statistics.mean(tokens),
    }


def decode_case(ctx: Context, engine, batch: int, context: int, bw: float, reserve: float):
    """Decode steps of `batch` sequences at about `context` tokens: graphs, then eager (the
    same engine and KV with the graphs set aside), each a median over all-decode steps, and
    each against the HBM bound of its step: (weights + KV read) / copy bandwidth."""
    from steadylm.engine.request import SamplingParams

    sh = ctx.shapes
    # Requests that finish their prefill first decode while the others prefill: room for that
    prefill_steps = -(-batch * context // engine.plan.max_prefill_token_num)
    new = prefill_steps + 2 * (sh.runs + sh.warmup) + 16
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for p in random_prompts(batch, context - 8, vocab, seed=context + batch):
        engine.add_request(p, params)
    preempt0 = engine.stats().num_preemptions
    runner, graphs = engine.runner, engine.runner.graphs
    res = {"batch": batch, "context": context}
    try:
        res["prefill_s"] = prefill_until_decoding(ctx, engine, batch, reserve)
        if res["prefill_s"] is None:
            return {"skipped": f"time budget ran out in the prefill ({ctx.left():.0f}s left)"}
        if graphs is None:
            res["graphs"] = {"skipped": f"no CUDA graphs here ({ctx.device.type})"}
        else:
            before = sum(graphs.replays.values())
            res["graphs"] = timed_steps(engine, sh.runs, sh.warmup)
            res["graphs"]["replays"] = sum(graphs.replays.values()) - before
        runner.graphs = None
        res["eager"] = timed_steps(engine, sh.runs, sh.warmup)
    finally:
        runner.graphs = graphs
        engine.abort_all()
    res["preemptions"] = engine.stats().num_preemptions - preempt0
    res["weight_bytes"] = weight_read_bytes(engine)
    for mode in ("eager", "graphs"):
        m = res[mode]
        if "step_ms" in m:
            m["kv_bytes"] = int(m["context_tokens"]) * engine.plan.kv_bytes_per_token
            m["bound_ms"] = 1000 * (m["kv_bytes"] + res["weight_bytes"]) / bw
            m["share_of_bound"] = m["bound_ms"] / m["step_ms"]
            res["mean_context"] = m["context_tokens"] / batch
            res["bound_ms"] = m["bound_ms"]  # the graphs' where there are graphs (set last)
    if "step_ms" in res["graphs"]:
        res["graphs_speedup"] = res["eager"]["step_ms"] / res["graphs"]["step_ms"]
    return res


def bench_decode(ctx: Context, engine, bw: float, reserve: float) -> list[dict]:
    """Every decode case whose estimated prefill fits the budget: the estimate scales the
    first case's prefill with batch x context (x context again past it: attention)."""
    out, ref = [], None
    for batch, context in ctx.shapes.decode_cases:
        if ref is not None:
            r = context / ref[1]
            est = ref[0] * batch / ref[2] * max(r, r * r) * 1.5 + 5
            if ctx.left() - reserve < est:
                why = f"time budget: ~{est:.0f}s needed, {ctx.left():.0f}s left"
                out.append({"batch": batch, "context": context, "skipped": why})
                continue
        res = attempt(ctx, decode_case, engine, batch, context, bw, reserve)
        out.append(res)
        if ref is None and "prefill_s" in res:
            ref = (res["prefill_s"], context, batch)
        ctx.log(f"decode batch {batch} context {context}: done")
    return out


def hf_decode_ms(ctx: Context, hf, context: int) -> dict:
    """transformers generate() at batch 1, dynamic KV cache: ms per new token, from the
    difference between 1 and 1 + N new tokens."""
    n = 2 * ctx.shapes.runs
    ids = torch.tensor(
        random_prompts(1, context - 8, hf.config.vocab_size, context), device=hf.device
    )
    kw = dict(
        attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0
    )

    @torch.inference_mode()
    def gen(new: int) -> float:
        sync(ctx.device)
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new, min_new_tokens=new, use_cache=True, **kw)
        sync(ctx.device)
        return time.perf_counter() - t0

    gen(2)
    one, many = gen(1), gen(1 + n)
    return {"context": context, "ms_per_token": 1000 * (many - one) / n, "cache": "dynamic"}


def workloads(ctx: Context, engine) -> dict:
    from steadylm.bench import offline_once

    out = {}
    graphs = engine.runner.graphs
    for name, (n, i, o) in ctx.shapes.workloads.items():
        for mode in ("graphs", "eager"):
            if mode == "graphs" and graphs is None:
                continue
            engine.runner.graphs = graphs if mode == "graphs" else None
            try:
                r = offline_once(engine, n, i, o, seed=1)
            finally:
                engine.runner.graphs = graphs
            keep = ("output_tokens_per_s", "decode_step_ms", "ttft_s", "non_model_overhead")
            out[f"{name} {mode}"] = {"shape": f"{n} x {i} -> {o}", **{k: r[k] for k in keep}}
    return out


def section_bench(ctx: Context) -> dict:
    bw = copy_bandwidth(ctx)
    ctx.log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    hf, _, engine = ctx.big()
    res = {"copy_GBps": bw / 1e9, "model": model_label(engine)}
    res["decode"] = bench_decode(ctx, engine, bw, reserve=40)
    res["transformers_b1"] = [
        attempt(ctx, hf_decode_ms, hf, c) if ctx.left() > 40 else {"context": c, "skipped": "time"}
        for c in ctx.shapes.hf_contexts
    ]
    res["workloads"] = attempt(ctx, workloads, engine)
    return res


def model_label(engine) -> str:
    mc = engine.model_config
    n = sum(p.numel() for p in engine.runner.model.parameters())
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    return (
        f"random Llama {size}, hidden {mc.hidden_size}, {mc.num_layers} layers, "
        f"{mc.num_heads} heads / {mc.num_kv_heads} KV, {str(engine.dtype).replace('torch.', '')}"
    )


def random_engine(ctx: Context, kw: dict):
    """A steadylm engine over random weights made on the device (no checkpoint to write)."""
    from transformers import LlamaConfig

    from steadylm.config import ModelConfig
    from steadylm.engine.llm_engine import LLMEngine
    from steadylm.loader import create_model

    hf_cfg = LlamaConfig(**kw)
    hf_cfg.architectures = ["LlamaForCausalLM"]
    mc = ModelConfig.from_hf(hf_cfg)
    model = create_model(mc, torch.bfloat16, ctx.device)
    gen = torch.Generator(ctx.device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, kw["initializer_range"], generator=gen)
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return LLMEngine.from_model(model, engine_config(ctx, ctx.shapes.decode_cases))


def section_bench_large(ctx: Context) -> dict:
    if ctx.left() < (10 if ctx.smoke else 100):
        return {"skipped": f"time budget: {ctx.left():.0f}s left"}
    ctx.release_big()
    bw = copy_bandwidth(ctx)
    engine = random_engine(ctx, ctx.shapes.large)
    ctx.log("the ~7B engine is built")
    res = {"copy_GBps": bw / 1e9, "model": model_label(engine), "plan": plan_dict(engine)}
    res["decode"] = bench_decode(ctx, engine, bw, reserve=15)
    if ctx.cuda:
        res["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    return res


# ---- profile -----------------------------------------------------------------------------
def section_profile(ctx: Context) -> dict:
    """Where a batch-1 decode step's time goes: the kernels one step launches, their summed GPU
    time against the step's wall time (the rest is launch gaps and host work), the top
    kernels; eager, and under the decode graph where the profiler sees a graph's kernels."""
    if not ctx.cuda:
        return {"skipped": "CUDA only (the profiler's kernel trace)"}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from steadylm.engine.request import SamplingParams

    _, _, engine = ctx.big()
    runner, graphs = engine.runner, engine.runner.graphs
    steps = 5
    prompt = random_prompts(1, 504, engine.model_config.vocab_size, seed=5)[0]
    engine.add_request(prompt, SamplingParams(max_new_tokens=4 * steps + 64, ignore_eos=True))
    res = {"context": 512, "steps": steps}
    try:
        if prefill_until_decoding(ctx, engine, 1, reserve=10) is None:
            return {"skipped": "time budget"}
        for mode in ("graphs", "eager") if graphs is not None else ("eager",):
            runner.graphs = graphs if mode == "graphs" else None
            for _ in range(2):
                engine.step()
            sync(ctx.device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    engine.step()
                sync(ctx.device)
            wall = [r.seconds for r in list(engine.step_log)[-steps:]]
            kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            by: dict[str, list[float]] = {}
            for e in kernels:
                by.setdefault(e.name, []).append(e.time_range.elapsed_us())
            top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:12]
            res[mode] = {
                "kernels_per_step": len(kernels) / steps,
                "kernel_ms_per_step": sum(map(sum, by.values())) / steps / 1000,
                "step_ms": 1000 * statistics.median(wall),
                "top": [
                    {"kernel": name[:70], "per_step": len(t) / steps, "us_per_step": sum(t) / steps}
                    for name, t in top
                ],
            }
    finally:
        runner.graphs = graphs
        engine.abort_all()
    return res


def md_profile(p: dict) -> list[str]:
    if not any(m in p for m in ("graphs", "eager")):
        return ["", f"### Profile: {p.get('skipped') or p.get('error') or 'not run'}"]
    out = ["", f"### Profile: one decode step at batch 1, context {p['context']} (the ~1B model)"]
    for mode in ("graphs", "eager"):
        m = p.get(mode)
        if not m:
            continue
        out.append(
            f"- {mode}: {m['kernels_per_step']:.0f} kernels per step, "
            f"{m['kernel_ms_per_step']:.3f} ms of kernel time in a {m['step_ms']:.3f} ms step "
            "(profiled)"
        )
    m = p.get("eager") or p.get("graphs")
    rows = [[t["kernel"], t["per_step"], t["us_per_step"]] for t in m["top"]]
    return out + table(["kernel (eager)", "per step", "us per step"], rows)


# ---- 4. memory -------------------------------------------------------------------------------
def plan_dict(engine) -> dict:
    keep = ("weight_bytes", "activation_bytes", "kv_cache_bytes", "kv_bytes_per_token",
            "cuda_graph_bytes", "num_blocks", "block_size", "session_len", "max_batch_size",
            "device_total_bytes", "notes")  # fmt: skip
    return {k: v for k, v in engine.plan.to_dict().items() if k in keep}


def section_memory(ctx: Context) -> dict:
    from steadylm.engine.cuda_graph import DecodeGraphs

    _, _, engine = ctx.big()
    res = {"plan": plan_dict(engine)}
    if not ctx.cuda:
        res["graph_capture"] = {"skipped": "CUDA only"}
        return res
    res["engine_build"] = ctx.build_memory
    r = engine.runner
    sync(ctx.device)
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    graphs = DecodeGraphs(
        r.model, r.backend, r.kv_cache, r.block_size, engine.config.max_batch_size,
        engine.plan.session_len, r.device, capture=True,
    )  # fmt: skip
    sync(ctx.device)
    res["graph_capture"] = {
        "planned_bytes": engine.plan.cuda_graph_bytes,
        "reserved_delta": torch.cuda.memory_reserved() - reserved,
        "allocated_delta": torch.cuda.memory_allocated() - allocated,
        "buckets": list(graphs.buckets),
    }
    del graphs
    free_memory(ctx.device)
    res["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    res["device_total_bytes"] = torch.cuda.get_device_properties(ctx.device).total_memory
    return res


# ---- running, targets, report ----------------------------------------------------------------
def attempt(ctx: Context, fn, *args) -> dict:
    """fn's result, or {"error": ...}: one failure must not lose the rest."""
    try:
        return fn(ctx, *args)
    except Exception as exc:
        ctx.log(f"{fn.__name__} failed: {type(exc).__name__}: {exc}")
        tail = traceback.format_exc().strip().splitlines()[-6:]
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": tail}


def errors(obj, path: str = "") -> list[str]:
    """Every "error" entry in a report, with where it is."""
    if isinstance(obj, dict):
        found = [f"{path}: {obj['error']}"] if "error" in obj else []
        return found + [e for k, v in obj.items() for e in errors(v, f"{path}/{k}")]
    if isinstance(obj, list):
        return [e for i, v in enumerate(obj) for e in errors(v, f"{path}[{i}]")]
    return []


def targets(report: dict) -> list[dict]:
    """The issue's speed targets, each row measured: met or not."""
    rows = []
    sections = report["sections"]
    for label in ("bench", "bench_large"):
        cases = [c for c in sections.get(label, {}).get("decode", []) if "eager" in c]
        by = {(c["batch"], c["context"]): c for c in cases}
        for (b, c), case in sorted(by.items()):
            g, one = case["graphs"], by.get((1, c), {})
            if b == 1 and "share_of_bound" in g:
                rows.append(
                    row(f"{label} b1 ctx {c}: share of HBM bound", g["share_of_bound"], 0.8)
                )
            if b == 1 and "graphs_speedup" in case:
                rows.append(row(f"{label} b1 ctx {c}: eager / graphs", case["graphs_speedup"], 1.5))
            if b > 1 and "step_ms" in g and "step_ms" in one.get("graphs", {}):
                ratio = g["step_ms"] / one["graphs"]["step_ms"]
                bound = case["bound_ms"] / one["bound_ms"]
                name = f"{label} b{b} / b1 step ctx {c} (bound ratio {bound:.1f})"
                rows.append(row(name, ratio, 2.0, below=True))
    for t in sections.get("kernels", {}).get("timing", []):
        name = f"attention b{t.get('batch')} ctx {t.get('context')} q{t.get('quant')}: ref /"
        if "speedup" in t:
            rows.append(row(f"{name} triton", t["speedup"], 3.0))
        if "speedup_graph" in t:
            rows.append(row(f"{name} triton in a graph", t["speedup_graph"], 3.0))
    return rows


def row(name: str, value: float, goal: float, below: bool = False) -> dict:
    met = value < goal if below else value >= goal
    return {"target": name, "value": value, "goal": f"{'<' if below else '>='} {goal}", "met": met}


def table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table: columns holding numbers right-aligned."""
    num = [
        any(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) for r in rows)
        for i in range(len(header))
    ]
    cells = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in r] for r in rows]
    out = ["", "| " + " | ".join(header) + " |"]
    out.append("| " + " | ".join("---:" if n else "---" for n in num) + " |")
    return out + ["| " + " | ".join(r) + " |" for r in cells]


def markdown(report: dict) -> str:
    m, s = report["meta"], report["sections"]
    lines = [
        f"## {m['date']}: GPU check on {m['device']}" + (" (--smoke)" if m["smoke"] else ""),
        "",
        f"torch {m['torch']}, triton {m['triton']}, transformers {m['transformers']}, CUDA "
        f"{m['cuda']}; `benchmarks/gpu_check.py` took {m['seconds']:.0f}s.",
    ]
    lines += md_parity(s.get("parity", {})) + md_kernels(s.get("kernels", {}))
    lines += md_moe(s.get("moe", {}))
    for label in ("bench", "bench_large"):
        lines += md_bench(label, s.get(label, {}))
    lines += md_profile(s.get("profile", {}))
    lines += md_memory(s.get("memory", {}))
    lines += ["", "### Targets"]
    ts = report["targets"]
    lines += table(["target", "measured", "goal", "met"], [list(t.values()) for t in ts])
    bad = [c for c in report["checks"] if not c["ok"]]
    n = len(report["checks"])
    lines += ["", f"Correctness checks: {n - len(bad)}/{n} passed."]
    lines += [f"- FAILED {c['name']} {c['detail']}" for c in bad]
    lines += [f"- ERROR {e}" for e in errors(s)]
    return "\n".join(lines) + "\n"


def md_moe(m: dict) -> list[str]:
    out = ["", "### Mixture of experts (the fused kernel)", ""]
    for mode, r in m.get("parity", {}).items():
        if isinstance(r, dict) and "matched_hf" in r:
            out.append(
                f"- tiny Qwen3-MoE fp32, {mode}: tokens matching per prompt {r['matched_hf']}, "
                f"fused kernel {r['fused']}, graph replays {r['replays']}"
            )
    k = m.get("kernel", {})
    if k.get("rows"):
        out += ["", f"Shape {k['shape']}:", ""]
        out += table(
            ["tokens", "experts used", "rel err", "fused ms", "reference ms", "weights GB/s"],
            [
                [r["tokens"], r["experts_used"], f"{r['rel_err']:.1e}", f"{r['fused_ms']:.3f}",
                 f"{r['reference_ms']:.3f}", f"{r['weights_GBps']:.0f}"]
                for r in k["rows"]
            ],
        )  # fmt: skip
    return out


def md_parity(p: dict) -> list[str]:
    out = ["", "### Parity (greedy tokens against transformers)", ""]
    for q, r in p.get("tiny_fp32", {}).items():
        if isinstance(r, dict):
            modes = {
                k: v.get("matched_hf", v.get("skipped"))
                for k, v in r.items()
                if k != "graphs_equal_eager"
            }
            out.append(f"- tiny fp32, {q}: tokens matching per prompt {modes}")
    b = p.get("big_bf16", {})
    if "matched_prefix" in b:
        out.append(
            f"- ~1B bf16: matching greedy prefix {b['matched_prefix']} of {b['new_tokens']}; "
            f"first step: max logit diff {b['first_step_max_logit_diff']:.3g} "
            f"({b['first_step_rel_logit_diff']:.2%} of max |logit|), "
            f"same top-1 {b['first_step_top1_equal']}"
        )
    return out


def md_kernels(k: dict) -> list[str]:
    out = ["", "### Attention kernels: Triton against the torch reference"]
    keys = ["case", "dtype", "quant", "max_abs_err", "rel_err", "triton_rel_err_vs_fp32"]
    keys += ["reference_rel_err_vs_fp32", "store_bit_exact"]
    rows = [[a[key] for key in keys] for a in k.get("accuracy", []) if "case" in a]
    out += table(keys, rows)
    keys = ["batch", "context", "quant", "triton_ms", "triton_graph_ms", "reference_ms"]
    keys += ["speedup", "speedup_graph", "triton_GBps", "triton_graph_GBps"]
    rows = [[t.get(key, "-") for key in keys] for t in k.get("timing", []) if "speedup" in t]
    return out + table(keys, rows)


def md_bench(label: str, b: dict) -> list[str]:
    if "decode" not in b:
        return ["", f"### {label}: {b.get('skipped') or b.get('error') or 'not run'}"]
    out = ["", f"### Decode steps ({label}): {b['model']}; copy {b['copy_GBps']:.0f} GB/s"]
    rows = []
    for c in b["decode"]:
        if "eager" not in c:
            rows.append([c.get("batch"), c.get("context"), c.get("skipped") or c.get("error")])
            rows[-1] += ["-"] * 6
            continue
        g, e = c["graphs"], c["eager"]
        rows.append(
            [c["batch"], round(c["mean_context"]), g.get("step_ms", "-"), e["step_ms"],
             c.get("graphs_speedup", "-"), c["bound_ms"], g.get("share_of_bound", "-"),
             e["share_of_bound"], c["preemptions"]]
        )  # fmt: skip
    header = ["batch", "context", "graphs ms", "eager ms", "eager / graphs", "bound ms"]
    out += table(header + ["share (graphs)", "share (eager)", "preempted"], rows)
    for h in b.get("transformers_b1", []):
        if "ms_per_token" in h:
            out.append(
                f"- transformers generate() batch 1, context {h['context']}: "
                f"{h['ms_per_token']:.2f} ms per token ({h['cache']} cache)"
            )
    for name, w in (b.get("workloads") or {}).items():
        if isinstance(w, dict) and "shape" in w:
            out.append(
                f"- {name} ({w['shape']}): {w['output_tokens_per_s']:.0f} tok/s, decode step "
                f"{w['decode_step_ms']:.2f} ms, TTFT {w['ttft_s'] * 1000:.0f} ms"
            )
    return out


def md_memory(mem: dict) -> list[str]:
    from steadylm.memory import fmt_bytes as b

    p = mem.get("plan", {})
    if not p:
        return []
    out = [
        "",
        "### Memory (the ~1B engine)",
        "",
        f"- plan: weights {b(p['weight_bytes'])}, activations {b(p['activation_bytes'])}, KV "
        f"{b(p['kv_cache_bytes'])}, CUDA graphs {b(p['cuda_graph_bytes'])}",
    ]
    g = mem.get("graph_capture", {})
    if "planned_bytes" in g:
        out.append(
            f"- capturing the decode graphs again: {b(g['reserved_delta'])} reserved, "
            f"{b(g['allocated_delta'])} allocated; the plan says {b(g['planned_bytes'])}"
        )
        used, total = mem["max_memory_allocated"], mem["device_total_bytes"]
        out.append(f"- peak allocated {b(used)} of {b(total)}")
    return out + [f"- {n}" for n in p.get("notes", [])]


def meta(ctx: Context) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": name, "smoke": ctx.smoke, "torch": torch.__version__, "triton": triton_version,
        "transformers": transformers.__version__, "cuda": torch.version.cuda,
        "seconds": time.monotonic() - ctx.t0, "budget_left_s": ctx.left(),
    }  # fmt: skip


def write(ctx: Context, report: dict, out: Path) -> str:
    report["meta"] = meta(ctx)
    report["checks"] = ctx.checks
    report["targets"] = targets(report)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    (out / "gpu_check.md").write_text(text)
    return text


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out/gpu_check")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter)")
    ap.add_argument("--device", default="auto", help="auto (cuda if present), cuda or cpu")
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip optional parts past it")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device != "cuda" and not args.smoke:
        print(
            "gpu_check: the full shapes need a CUDA device; --smoke runs anywhere", file=sys.stderr
        )
        return 2
    if args.device == "cpu":  # before any Triton kernel is defined (Triton reads it then)
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("STEADYLM_CPU_KERNELS", "torch")  # no native build: irrelevant here
    sys.path.insert(0, str(ROOT))  # steadylm from this checkout, installed or not
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args)

    def on_term(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, on_term)
    report: dict = {"sections": {}}
    fns = {
        "parity": section_parity,
        "kernels": section_kernels,
        "moe": section_moe,
        "bench": section_bench,
        "profile": section_profile,
        "memory": section_memory,
        "bench_large": section_bench_large,
    }
    name = SECTIONS[0]
    try:
        for name in SECTIONS:
            ctx.log(f"section {name} ({ctx.left():.0f}s of budget left)")
            t0 = time.monotonic()
            report["sections"][name] = attempt(ctx, fns[name])
            report["sections"][name]["seconds"] = time.monotonic() - t0
            write(ctx, report, out)
    except Terminated:
        report["sections"].setdefault(name, {})["error"] = "terminated (SIGTERM: the time limit)"
        for later in SECTIONS[SECTIONS.index(name) + 1 :]:
            report["sections"][later] = {"skipped": "terminated before it ran"}
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    text = write(ctx, report, out)
    print(text)
    failed = errors(report["sections"]) or [c for c in ctx.checks if not c["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
