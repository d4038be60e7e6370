"""The memory model shared by `steadylm plan` and the engine: weights, activations, KV bytes per
token, and the KV pool that one budget knob buys.

Budget knobs, in one precedence (setting two is an error naming both):
  num_gpu_blocks > max_total_tokens > kv_cache_bytes   -- absolute sizes of the KV pool
  gpu_memory_utilization  -- vLLM: share of the device's *total* memory for weights +
                             activations + KV together; KV gets what is left
  cache_max_entry_count   -- LMDeploy: share of the memory *free after the weights*, minus the
                             activation reserve; the default (0.8) when nothing is set on CUDA
On CPU the device memory is the machine's available RAM, and with no knob set the KV pool is
4 GiB (as vLLM's CPU backend defaults), bounded by what cache_max_entry_count=0.8 would give.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from steadylm.config import EngineConfig, ModelConfig
from steadylm.errors import ConfigError, OutOfMemoryPlanError

GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 4 * GiB
LMDEPLOY_DEFAULT_RATIO = 0.8
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_ABSOLUTE_KNOBS = ("num_gpu_blocks", "max_total_tokens", "kv_cache_bytes")
_SHARE_KNOBS = ("gpu_memory_utilization", "cache_max_entry_count")


def kv_bytes_per_token(cfg: ModelConfig, quant_policy: int, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes of K and V for one token over all layers. Quantized policies store, per token and
    head, head_dim codes (8 bits, or 4 bits packed two per byte) plus a scale and a zero point in
    the model dtype: so int4 at head_dim 128 in fp16 is 64 + 4 = 68 bytes vs 256 (3.76x)."""
    heads = math.ceil(cfg.num_kv_heads / tp)
    if quant_policy == 0:
        per_head = cfg.head_dim * dtype_bytes
    elif quant_policy == 8:
        per_head = cfg.head_dim + 2 * dtype_bytes
    else:
        per_head = cfg.head_dim // 2 + 2 * dtype_bytes
    return cfg.num_layers * 2 * heads * per_head


def linear_bytes(
    n_in: int, n_out: int, dtype_bytes: int, awq_group: int | None, layout: str = "checkpoint"
) -> int:
    """Weight bytes of one linear layer (no bias).

    AWQ "checkpoint" layout (AutoAWQ GEMM): qweight int32 (in, out/8), qzeros int32
    (in/g, out/8), scales fp16 (in/g, out). "runtime": what steadylm holds after repacking for
    torch's int4 kernel, the 4-bit codes (in * out / 2 bytes) plus bf16 scale and zero per group
    and output (in/g, out, 2); layers whose shape the kernel cannot take (out % 16) keep the
    checkpoint layout and use the reference kernel."""
    if awq_group is None:
        return n_in * n_out * dtype_bytes
    groups = math.ceil(n_in / awq_group)
    if layout == "runtime" and n_out % 16 == 0 and awq_group in (32, 64, 128, 256):
        return n_in * n_out // 2 + groups * n_out * 2 * 2
    return n_in * n_out // 2 + groups * n_out // 2 + groups * n_out * 2


def weight_bytes_from_config(
    cfg: ModelConfig, dtype_bytes: int, tp: int = 1, layout: str = "checkpoint"
) -> int:
    """Per-device weight bytes, counted from the architecture alone (no files read)."""
    awq = awq_group_size(cfg)
    c, i = cfg.hidden_size, cfg.intermediate_size
    lb = lambda n_in, n_out: linear_bytes(n_in, n_out, dtype_bytes, awq, layout)  # noqa: E731
    per_layer = (
        lb(c, cfg.q_size + 2 * cfg.kv_size)  # merged qkv_proj
        + lb(cfg.q_size, c)
        + lb(c, 2 * i)  # merged gate_up_proj
        + lb(i, c)
        + 2 * c * dtype_bytes
    )
    if cfg.architecture.startswith("Qwen2") or cfg.attention_bias:
        per_layer += (cfg.q_size + 2 * cfg.kv_size) * dtype_bytes
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim * dtype_bytes
    embed = cfg.vocab_size * c * dtype_bytes
    head = 0 if cfg.tie_word_embeddings else embed
    return (cfg.num_layers * per_layer + embed + head + c * dtype_bytes) // tp


def awq_group_size(cfg: ModelConfig) -> int | None:
    q = cfg.quantization or {}
    if str(q.get("quant_method", "")).lower() == "awq":
        return int(q.get("group_size", 128))
    return None


def activation_bytes(
    cfg: ModelConfig, num_tokens: int, max_batch_size: int, max_context: int, dtype_bytes: int
) -> int:
    """Peak transient memory of one step of `num_tokens` tokens with the reference backend.

    Counted: the residual stream and norm outputs, the fused qkv output and attention output,
    the fused gate/up output and its activation (or, when larger, the attention workspace: K and
    V gathered for at most `workspace_tokens` padded context tokens, plus the boolean mask), and
    fp32 logits with the sampler's copies for the rows that sample: at most one row per
    sequence, never one per prompt token.
    """
    from steadylm.attention.torch_ref import workspace_tokens

    t, c = num_tokens, cfg.hidden_size
    stream = 4 * t * c * dtype_bytes
    qkv = t * (cfg.q_size + 2 * cfg.kv_size) * dtype_bytes + t * cfg.q_size * dtype_bytes
    mlp = 3 * t * cfg.intermediate_size * dtype_bytes
    attn = 2 * workspace_tokens(max_context) * cfg.kv_size * dtype_bytes + t * max_context
    rows = min(max_batch_size, t)
    logits = 4 * rows * cfg.vocab_size * 4
    return stream + qkv + max(mlp, attn) + logits


MIN_BLOCKS = 16  # as LMDeploy: below this, max_prefill_token_num is halved
MIN_PREFILL = 64


@dataclass(frozen=True)
class DeviceMemory:
    name: str
    total_bytes: int
    free_bytes: int


@dataclass
class MemoryPlan:
    device: str
    device_total_bytes: int
    device_free_bytes: int
    budget_source: str
    weight_bytes: int
    activation_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    max_prefill_token_num: int
    session_len: int
    max_batch_size: int
    quant_policy: int
    notes: list[str] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def concurrency_at_session_len(self) -> int:
        return self.num_blocks // math.ceil(self.session_len / self.block_size)

    def max_session_len_for(self, concurrency: int) -> int:
        return (self.num_blocks // max(1, concurrency)) * self.block_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            total_tokens=self.total_tokens,
            concurrency_at_session_len=self.concurrency_at_session_len,
            max_session_len=self.max_session_len_for(1),
        )
        return d

    def table(self) -> str:
        rows = [
            (
                "device",
                f"{self.device} ({fmt_bytes(self.device_total_bytes)} total, "
                f"{fmt_bytes(self.device_free_bytes)} free)",
            ),
            ("budget from", self.budget_source),
            ("weights", fmt_bytes(self.weight_bytes)),
            (
                "activation reserve",
                f"{fmt_bytes(self.activation_bytes)} "
                f"(max_prefill_token_num={self.max_prefill_token_num})",
            ),
            ("KV cache", fmt_bytes(self.kv_cache_bytes)),
            (
                "KV bytes per token",
                f"{self.kv_bytes_per_token:,} (quant_policy={self.quant_policy})",
            ),
            ("KV blocks", f"{self.num_blocks:,} x {self.block_size} tokens"),
            ("KV capacity", f"{self.total_tokens:,} tokens"),
            ("session_len", f"{self.session_len:,}"),
            ("concurrent requests at session_len", f"{self.concurrency_at_session_len:,}"),
            ("largest session_len (1 request)", f"{self.max_session_len_for(1):,}"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"  {k.ljust(width)}  {v}" for k, v in rows]
        return "\n".join(["memory plan:", *lines, *[f"  note: {n}" for n in self.notes]])


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def check_knobs(ec: EngineConfig) -> str | None:
    """Return the one budget knob set, or None; two set is a ConfigError naming both."""
    chosen = [k for k in _ABSOLUTE_KNOBS + _SHARE_KNOBS if getattr(ec, k)]
    if len(chosen) > 1:
        raise ConfigError(
            f"{chosen[0]} and {chosen[1]} both size the KV cache; set only one "
            f"(drop {chosen[1]}, or drop {chosen[0]} to use {chosen[1]})",
            param=chosen[1],
        )
    return chosen[0] if chosen else None


def plan_memory(
    mc: ModelConfig,
    ec: EngineConfig,
    device: DeviceMemory,
    dtype_bytes: int,
    weight_bytes: int | None = None,
    is_cpu: bool = False,
    tp: int | None = None,
) -> MemoryPlan:
    """Decide the KV pool for `ec` on `device` (per device, for `tp` devices; the planner may
    ask about tp > 1 though the engine runs tp=1). Deterministic: the engine allocates exactly
    `num_blocks` of the returned plan."""
    knob = check_knobs(ec)
    tp = tp or ec.tp
    weights = (
        weight_bytes if weight_bytes is not None else weight_bytes_from_config(mc, dtype_bytes, tp)
    )
    per_token = kv_bytes_per_token(mc, ec.quant_policy, dtype_bytes, tp)
    block_bytes = per_token * ec.block_size
    session_len = ec.session_len or mc.max_position_embeddings
    notes: list[str] = list(ec.plan_notes)
    n = ec.max_prefill_token_num
    while True:
        act = activation_bytes(mc, n, ec.max_batch_size, session_len, dtype_bytes)
        kv_bytes, source = _kv_budget(ec, knob, device, weights, act, block_bytes, is_cpu)
        num_blocks = max(0, int(kv_bytes // block_bytes))
        used = weights + act + num_blocks * block_bytes
        limit = _usable_bytes(ec, knob, device)
        enough = num_blocks >= MIN_BLOCKS or knob in _ABSOLUTE_KNOBS
        if (enough and used <= limit) or n <= MIN_PREFILL:
            break
        notes.append(
            f"max_prefill_token_num {n} -> {n // 2}: one step of {n} tokens needs "
            f"{fmt_bytes(act)} of activations, leaving {num_blocks} KV blocks in "
            f"{fmt_bytes(limit)} after {fmt_bytes(weights)} of weights. Raise "
            "gpu_memory_utilization / cache_max_entry_count or lower session_len to keep it."
        )
        n //= 2
    if num_blocks < 1 or used > limit:
        raise OutOfMemoryPlanError(
            f"does not fit: weights {fmt_bytes(weights)} + activations {fmt_bytes(act)} "
            f"(max_prefill_token_num={n}) + KV {fmt_bytes(num_blocks * block_bytes)} "
            f"({num_blocks} blocks of {fmt_bytes(block_bytes)}; {source}) vs "
            f"{fmt_bytes(limit)} usable on {device.name}. Use a smaller dtype or AWQ weights, "
            "quant_policy=8 or 4, a smaller session_len, or a larger device."
        )
    capacity = num_blocks * ec.block_size
    if session_len > capacity:
        notes.append(
            f"session_len {session_len:,} > KV capacity {capacity:,} tokens: lowered to "
            f"{capacity:,}. To raise it, raise gpu_memory_utilization / cache_max_entry_count / "
            "kv_cache_bytes, or use quant_policy=8 or 4."
        )
        session_len = capacity
    return MemoryPlan(
        device=device.name,
        device_total_bytes=device.total_bytes,
        device_free_bytes=device.free_bytes,
        budget_source=source,
        weight_bytes=weights,
        activation_bytes=act,
        kv_cache_bytes=num_blocks * block_bytes,
        kv_bytes_per_token=per_token,
        block_size=ec.block_size,
        num_blocks=num_blocks,
        max_prefill_token_num=n,
        session_len=session_len,
        max_batch_size=ec.max_batch_size,
        quant_policy=ec.quant_policy,
        notes=notes,
    )


def _kv_budget(ec, knob, device: DeviceMemory, weights, act, block_bytes, is_cpu):
    if knob == "num_gpu_blocks":
        return ec.num_gpu_blocks * block_bytes, f"num_gpu_blocks={ec.num_gpu_blocks}"
    if knob == "max_total_tokens":
        blocks = math.ceil(ec.max_total_tokens / ec.block_size)
        return blocks * block_bytes, f"max_total_tokens={ec.max_total_tokens}"
    if knob == "kv_cache_bytes":
        return ec.kv_cache_bytes, f"kv_cache_bytes={ec.kv_cache_bytes}"
    if knob == "gpu_memory_utilization":
        u = ec.gpu_memory_utilization
        kv = int(device.total_bytes * u) - weights - act
        return kv, (
            f"gpu_memory_utilization={u}: {u} x {fmt_bytes(device.total_bytes)} "
            "- weights - activations"
        )
    ratio = ec.cache_max_entry_count or LMDEPLOY_DEFAULT_RATIO
    kv = int((device.free_bytes - weights - act) * ratio)
    src = (
        f"cache_max_entry_count={ratio}: {ratio} x ({fmt_bytes(device.free_bytes)} free "
        "- weights - activations)"
    )
    if knob is None and is_cpu and kv > CPU_DEFAULT_KV_BYTES:
        return (
            CPU_DEFAULT_KV_BYTES,
            "CPU default: 4 GiB (set kv_cache_bytes or cache_max_entry_count to change)",
        )
    return kv, src


def _usable_bytes(ec: EngineConfig, knob: str | None, device: DeviceMemory) -> int:
    if knob == "gpu_memory_utilization":
        return int(device.total_bytes * ec.gpu_memory_utilization)
    return device.free_bytes
