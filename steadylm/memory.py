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

Tensor parallelism: every byte figure is per rank, counted from the shards `tp_shape` gives (the
engine builds its layers from the same function), so each rank allocates exactly what the plan
says. Attention heads, KV heads (or one replicated KV head per rank when tp is a multiple of
them), the MLP's intermediate dim and the vocabulary rows are split; norms, the residual stream
and o_proj's bias are whole on every rank. Activations are rank 0's, the largest: it also holds
the gathered logits. On CPU the ranks of one machine share its RAM, so each plans against its
share, and the 4 GiB default is per rank.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from steadylm.config import EngineConfig, ModelConfig
from steadylm.errors import ConfigError, OutOfMemoryPlanError

GiB = 1 << 30
CPU_DEFAULT_KV_BYTES = 4 * GiB
LMDEPLOY_DEFAULT_RATIO = 0.8
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_ABSOLUTE_KNOBS = ("num_gpu_blocks", "max_total_tokens", "kv_cache_bytes")
_SHARE_KNOBS = ("gpu_memory_utilization", "cache_max_entry_count")


class TPShape(NamedTuple):
    """The per-rank sizes of a model split over tp ranks."""

    local_heads: int
    local_kv_heads: int  # 1 when tp is a multiple of the KV heads: each rank holds a copy
    local_intermediate: int
    local_vocab: int  # ceil(vocab / tp): the last rank's rows are zero-padded


def tp_shape(cfg: ModelConfig, tp: int) -> TPShape:
    """-> (local_heads, local_kv_heads, local_intermediate, local_vocab) of one rank, or a
    ConfigError naming the split that is impossible and the tp values that work."""
    problem = _split_problem(cfg, tp)
    if problem is not None:
        fits = [str(n) for n in range(1, 65) if _split_problem(cfg, n) is None]
        raise ConfigError(
            f"tp={tp}: {problem}; tp values that split this model: {', '.join(fits)}",
            param="tp",
        )
    kv = cfg.num_kv_heads // tp if cfg.num_kv_heads % tp == 0 else 1
    return TPShape(
        cfg.num_heads // tp, kv, cfg.intermediate_size // tp, math.ceil(cfg.vocab_size / tp)
    )


def _split_problem(cfg: ModelConfig, tp: int) -> str | None:
    if tp < 1:
        return "the tensor-parallel degree must be at least 1"
    if cfg.num_heads % tp:
        return f"{cfg.num_heads} attention heads do not split evenly over {tp} ranks"
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        return (
            f"{cfg.num_kv_heads} KV heads neither split evenly over {tp} ranks nor divide "
            f"{tp} (to hold one replicated KV head per rank)"
        )
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(cfg, name) % tp:
            return f"{name} {getattr(cfg, name)} does not split evenly over {tp} ranks"
    group = awq_group_size(cfg)
    if group is None or tp == 1:
        return None
    inputs = [("o_proj", cfg.q_size), ("down_proj", cfg.intermediate_size)]
    if cfg.is_moe:
        inputs.append(("an expert's down_proj", cfg.moe_intermediate_size))
    if cfg.shared_expert_intermediate_size:
        inputs.append(("shared_expert.down_proj", cfg.shared_expert_intermediate_size))
    for name, k in inputs:
        if (k // tp) % group:
            return (
                f"{name} splits its {k} inputs into {k // tp} per rank: the split cuts an AWQ "
                f"group of {group}"
            )
    return None


def kv_bytes_per_token(cfg: ModelConfig, quant_policy: int, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes of K and V for one token over all layers, on one of `tp` ranks. Quantized policies
    store, per token and head, head_dim codes (8 bits, or 4 bits packed two per byte) plus a
    scale and a zero point in the model dtype: so int4 at head_dim 128 in fp16 is 64 + 4 = 68
    bytes vs 256 (3.76x). ceil(kv / tp) is tp_shape's local KV heads for every valid split:
    kv / tp when tp divides them, and 1 (replicated) when tp is a multiple of them."""
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
    (in/g, out/8), scales fp16 (in/g, out). "runtime": what steadylm holds on the CPU after
    repacking for torch's int4 kernel, the 4-bit codes (in * out / 2 bytes) plus bf16 scale and
    zero per group and output (in/g, out, 2); layers whose shape the kernel cannot take
    (out % 16) keep the checkpoint layout and use the reference kernel. "cuda": the checkpoint
    layout, which the Triton GEMM reads in place."""
    if awq_group is None:
        return n_in * n_out * dtype_bytes
    groups = math.ceil(n_in / awq_group)
    if layout == "runtime" and n_out % 16 == 0 and awq_group in (32, 64, 128, 256):
        return n_in * n_out // 2 + groups * n_out * 2 * 2
    return n_in * n_out // 2 + groups * n_out // 2 + groups * n_out * 2


def awq_layout(device_type: str) -> str:
    """The AWQ weight layout steadylm holds on a device type (see `linear_bytes`)."""
    return "cuda" if device_type == "cuda" else "runtime"


def weight_bytes_from_config(
    cfg: ModelConfig, dtype_bytes: int, tp: int = 1, layout: str = "checkpoint"
) -> int:
    """Weight bytes on one of `tp` ranks, counted from the architecture alone (no files read).

    Column-parallel (qkv_proj with its bias, gate_up_proj) split their outputs, row-parallel
    (o_proj, down_proj) their inputs; embed_tokens and lm_head hold ceil(vocab / tp) rows; norms
    and o_proj's bias are whole on every rank."""
    awq = awq_group_size(cfg)
    heads, kv_heads, inter, vocab = tp_shape(cfg, tp)
    c, q = cfg.hidden_size, heads * cfg.head_dim
    qkv = q + 2 * kv_heads * cfg.head_dim
    lb = lambda n_in, n_out: linear_bytes(n_in, n_out, dtype_bytes, awq, layout)  # noqa: E731
    per_layer = (
        lb(c, qkv)  # merged qkv_proj
        + lb(q, c)
        + 2 * c * dtype_bytes
    )
    if cfg.architecture.startswith("Qwen2") or cfg.attention_bias:
        per_layer += qkv * dtype_bytes
    if cfg.attention_bias:
        per_layer += c * dtype_bytes  # o_proj's bias
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim * dtype_bytes
    mlp = lambda i: lb(c, 2 * i) + lb(i, c)  # merged gate_up_proj, down_proj  # noqa: E731
    moe = cfg.num_experts * mlp(cfg.moe_intermediate_size // tp)
    moe += cfg.num_experts * c * dtype_bytes  # the router, whole on every rank (never AWQ)
    if cfg.shared_expert_intermediate_size:
        moe += mlp(cfg.shared_expert_intermediate_size // tp) + c * dtype_bytes  # + its gate
    sparse = len(cfg.moe_layers)
    mlps = sparse * moe + (cfg.num_layers - sparse) * mlp(inter)
    embed = vocab * c * dtype_bytes
    head = 0 if cfg.tie_word_embeddings else embed
    return cfg.num_layers * per_layer + mlps + embed + head + c * dtype_bytes


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of the whole model, from the architecture. Active,
    as model cards count it: everything but the experts a token does not take (in each sparse
    layer: the router, `num_experts_per_tok` experts and the shared expert), the embedding and
    the LM head included."""
    c, d = cfg.hidden_size, cfg.head_dim
    attn = c * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * c + 2 * c
    if cfg.architecture.startswith("Qwen2") or cfg.attention_bias:
        attn += cfg.q_size + 2 * cfg.kv_size
    if cfg.qk_norm:
        attn += 2 * d
    mlp = lambda i: 3 * c * i  # noqa: E731
    sparse = len(cfg.moe_layers)
    dense = (cfg.num_layers - sparse) * mlp(cfg.intermediate_size)
    shared = cfg.shared_expert_intermediate_size
    shared = mlp(shared) + c if shared else 0  # + its gate
    router = cfg.num_experts * c
    expert = mlp(cfg.moe_intermediate_size)
    embed = cfg.vocab_size * c
    common = cfg.num_layers * attn + dense + sparse * (router + shared) + c + embed
    head = 0 if cfg.tie_word_embeddings else embed
    total = common + sparse * cfg.num_experts * expert + head
    active = common + sparse * cfg.num_experts_per_tok * expert + head
    return total, active


def awq_group_size(cfg: ModelConfig) -> int | None:
    q = cfg.quantization or {}
    if str(q.get("quant_method", "")).lower() == "awq":
        return int(q.get("group_size", 128))
    return None


def activation_bytes(
    cfg: ModelConfig,
    num_tokens: int,
    max_batch_size: int,
    max_context: int,
    dtype_bytes: int,
    tp: int = 1,
) -> int:
    """Peak transient memory of one step of `num_tokens` tokens with the reference backend, on
    rank 0 of `tp` (the largest).

    Counted: the residual stream and norm outputs (whole on every rank), this rank's fused qkv
    output and attention output, its fused gate/up output and activation (or, when larger, the
    attention workspace: its K and V heads gathered for at most `workspace_tokens` padded context
    tokens, plus the boolean mask), and fp32 logits with the sampler's copies for the rows that
    sample: at most one row per sequence, never one per prompt token. At tp > 1 each rank
    computes (rows, ceil(V / tp)) logits and rank 0 also holds them gathered, (rows, tp * that).
    """
    from steadylm.attention.torch_ref import workspace_tokens

    heads, kv_heads, inter, vocab = tp_shape(cfg, tp)
    t, c = num_tokens, cfg.hidden_size
    q, kv = heads * cfg.head_dim, kv_heads * cfg.head_dim
    stream = 4 * t * c * dtype_bytes
    qkv = t * (q + 2 * kv) * dtype_bytes + t * q * dtype_bytes
    mlp = 3 * t * inter * dtype_bytes
    if cfg.is_moe:  # the fused kernel's (T k, 2I), (T k, I) and (T k, C) buffers
        routed = t * cfg.num_experts_per_tok
        mlp = max(mlp, routed * (3 * cfg.moe_intermediate_size // tp + c) * dtype_bytes)
    attn = 2 * workspace_tokens(max_context) * kv * dtype_bytes + t * max_context
    rows = min(max_batch_size, t)
    local = 0 if tp == 1 else rows * vocab * 4  # at tp=1 the local logits are the full ones
    logits = local + rows * tp * vocab * 4 + 3 * rows * cfg.vocab_size * 4
    return stream + qkv + max(mlp, attn) + logits


def graph_blocker(mc: ModelConfig) -> str | None:
    """Why this model's decode step cannot be captured in a CUDA graph, or None."""
    group = awq_group_size(mc)
    if mc.is_moe and group is not None and (group == -1 or group % 16):
        return (
            f"AWQ experts of group size {group} run one by one (the fused kernel takes groups "
            "of a multiple of 16; counting each expert's tokens syncs with the host)"
        )
    return None


def graph_buckets(max_batch_size: int) -> list[int]:
    """The decode CUDA graphs' batch sizes: 1, 2, 4, ... below max_batch_size, then it."""
    sizes = [1 << i for i in range(max(1, max_batch_size).bit_length()) if 1 << i < max_batch_size]
    return [*sizes, max_batch_size]


GRAPH_OVERHEAD_BYTES = 2 << 20  # per captured graph, beyond its tensors (an estimate)
_SPLIT_SEGMENTS = 32  # the Triton decode kernel's MAX_SEGMENTS (attention/triton_attn.py)


def cuda_graph_bytes(cfg: ModelConfig, max_batch_size: int, dtype_bytes: int, tp: int = 1) -> int:
    """The decode CUDA graphs' private memory pool on one rank. All buckets share one pool,
    captured largest first, so it holds one decode step at max_batch_size rows: the residual
    stream and norm outputs, qkv and attention output, the MLP, and the split-KV partials (fp32
    output and max/sum per row, head and segment); plus a fixed cost per graph. Logits are
    computed outside the graphs (the activation reserve counts them)."""
    heads, kv_heads, inter, _ = tp_shape(cfg, tp)
    b, c, d = max_batch_size, cfg.hidden_size, cfg.head_dim
    q, kv = heads * d, kv_heads * d
    stream = 4 * b * c * dtype_bytes
    qkv = b * (q + 2 * kv) * dtype_bytes + b * q * dtype_bytes
    mlp = 3 * b * inter * dtype_bytes
    split = b * heads * _SPLIT_SEGMENTS * ((1 << (d - 1).bit_length()) + 2) * 4
    return stream + qkv + mlp + split + len(graph_buckets(b)) * GRAPH_OVERHEAD_BYTES


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
    tp: int = 1  # at tp > 1 every byte figure is one rank's (activations: rank 0's, the largest)
    cuda_graph_bytes: int = 0  # the decode CUDA graphs' pool (0: none captured)
    notes: list[str] = field(default_factory=list)
    speculative: str = ""  # speculative decoding's method and most drafts a step ("": off)

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
        per = " (per rank)" if self.tp > 1 else ""
        rows = [
            (
                "device" + per,
                f"{self.device} ({fmt_bytes(self.device_total_bytes)} total, "
                f"{fmt_bytes(self.device_free_bytes)} free)",
            ),
            ("budget from", self.budget_source),
            ("weights" + per, fmt_bytes(self.weight_bytes)),
            (
                "activation reserve" + (" (rank 0, the largest)" if per else ""),
                f"{fmt_bytes(self.activation_bytes)} "
                f"(max_prefill_token_num={self.max_prefill_token_num})",
            ),
            *(
                [
                    (
                        "CUDA graphs (decode)",
                        f"{fmt_bytes(self.cuda_graph_bytes)} "
                        f"(batch sizes {', '.join(map(str, graph_buckets(self.max_batch_size)))}; "
                        "eager_mode=True frees it for KV)",
                    )
                ]
                if self.cuda_graph_bytes
                else []
            ),
            *(
                [
                    (
                        "speculative decoding",
                        f"{self.speculative}: no draft model; logits for up to "
                        f"{self.max_batch_size} x (1 + drafts) rows in the activation reserve; "
                        "drafts' KV slots from the pool, released when rejected",
                    )
                ]
                if self.speculative
                else []
            ),
            ("KV cache" + per, fmt_bytes(self.kv_cache_bytes)),
            (
                "KV bytes per token" + per,
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
        title = f"memory plan (tp={self.tp}, byte figures per rank):" if per else "memory plan:"
        return "\n".join([title, *lines, *[f"  note: {n}" for n in self.notes]])


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
    local_ranks: int | None = None,
    cuda_graphs: bool | None = None,
) -> MemoryPlan:
    """Decide the KV pool for `ec` on `device`, per rank of `tp` (default `ec.tp`); every rank
    gets the same plan. `weight_bytes`, when given, is one rank's. On CPU, `local_ranks` (default
    tp) ranks share the machine's RAM, so each plans against that share of `device`.
    Deterministic: the engine allocates exactly `num_blocks` of the returned plan.
    `cuda_graphs`: whether decode CUDA graphs are captured (default: a device other than the
    CPU, tp=1, not eager_mode); the engine captures them exactly when the plan reserves them."""
    knob = check_knobs(ec)
    tp = tp or ec.tp
    tp_shape(mc, tp)  # an impossible split is a ConfigError before any arithmetic
    notes: list[str] = list(ec.plan_notes)
    if is_cpu and tp > 1:
        device = _cpu_rank_share(device, tp, local_ranks or tp, notes)
    weights = (
        weight_bytes if weight_bytes is not None else weight_bytes_from_config(mc, dtype_bytes, tp)
    )
    per_token = kv_bytes_per_token(mc, ec.quant_policy, dtype_bytes, tp)
    block_bytes = per_token * ec.block_size
    session_len = ec.session_len or mc.max_position_embeddings
    if cuda_graphs is None:
        cuda_graphs = not is_cpu and not ec.eager_mode and tp == 1
        blocker = graph_blocker(mc) if cuda_graphs else None
        if blocker:
            cuda_graphs = False
            notes.append(f"decode runs eagerly, without CUDA graphs: {blocker}")
    graphs = cuda_graph_bytes(mc, ec.max_batch_size, dtype_bytes, tp) if cuda_graphs else 0
    n = ec.max_prefill_token_num
    spec = ec.speculative_config
    # With drafts a decoding request samples at 1 + k positions: that many logits rows each.
    sample_rows = ec.max_batch_size * (1 + (spec.num_speculative_tokens if spec else 0))
    while True:
        act = activation_bytes(mc, n, sample_rows, session_len, dtype_bytes, tp)
        kv_bytes, source = _kv_budget(ec, knob, device, weights + graphs, act, block_bytes, is_cpu)
        num_blocks = max(0, int(kv_bytes // block_bytes))
        used = weights + graphs + act + num_blocks * block_bytes
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
            f"does not fit: weights {fmt_bytes(weights)} + "
            + (f"CUDA graphs {fmt_bytes(graphs)} (eager_mode=True frees them) + " if graphs else "")
            + f"activations {fmt_bytes(act)} "
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
        tp=tp,
        cuda_graph_bytes=graphs,
        notes=notes,
        speculative=f"{spec.method}, up to {spec.num_speculative_tokens} drafts a step"
        if spec
        else "",
    )


def _cpu_rank_share(
    device: DeviceMemory, tp: int, local_ranks: int, notes: list[str]
) -> DeviceMemory:
    """One rank's share of a CPU machine whose RAM `local_ranks` of the tp ranks share."""
    if not 1 <= local_ranks <= tp:
        raise ConfigError(
            f"local_ranks={local_ranks}: the ranks on this machine must number 1 to tp={tp}",
            param="local_ranks",
        )
    share = DeviceMemory(
        device.name, device.total_bytes // local_ranks, device.free_bytes // local_ranks
    )
    default = f"the CPU default KV budget of {fmt_bytes(CPU_DEFAULT_KV_BYTES)} applies per rank"
    if local_ranks == 1:
        notes.append(f"CPU, tp={tp}: one rank on this machine plans against all its RAM; {default}")
    else:
        notes.append(
            f"CPU, tp={tp}: the {local_ranks} ranks on this machine share its RAM, so each plans "
            f"against 1/{local_ranks} of it ({fmt_bytes(share.free_bytes)} of "
            f"{fmt_bytes(device.free_bytes)} free), and {default}."
        )
    return share


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
