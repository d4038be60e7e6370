"""The sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE) and its router.

Routing follows transformers: the router's logits, a softmax in fp32, the top k experts per
token, renormalised over those k where the config says (`norm_topk_prob`; Mixtral always),
the weights cast back to the model dtype (Mixtral keeps them in fp32, as its modeling file).

Each expert is an MLP made of the same linears the dense layers use (`make_linear`): on the
CPU oneDNN's packed weight read by the GEMV, AWQ's int4 kernels for a quantized checkpoint,
and the checkpoint's per-expert tensors load into them directly (no full-model copy). The
experts run one after another over the tokens routed to them (`experts_reference`, the oracle
and the CPU path: a decode step of 16 rows reads each active expert's weights once). On CUDA
the experts' weights are stacked per layer ((E, 2I, H) and (E, H, I), or AWQ's 4-bit tensors
the same way; the per-expert parameters become views of them) for the fused Triton kernel
(`kernels/triton_moe.py`), which sorts tokens by expert on the device without a host sync, so
decode steps are captured in CUDA graphs.

Tensor parallelism: every expert's intermediate dim is split over the ranks (gate_up by
columns, down by rows, as a dense MLP), the router is replicated, and the block all-reduces
once: the routed experts' partial sums plus the (gated) shared expert's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steadylm import kernels, parallel, platform
from steadylm.config import ModelConfig
from steadylm.layers.awq import AWQLinear
from steadylm.layers.linear import Linear, make_linear
from steadylm.layers.shard import Split


class ExpertMLP(nn.Module):
    """SiLU(x Wg^T) * (x Wu^T) -> Wd: one expert (or the shared expert), its intermediate dim
    split over the ranks; returns this rank's partial sum (the block all-reduces)."""

    def __init__(self, cfg: ModelConfig, intermediate: int, names: tuple[str, str, str]):
        """names: the checkpoint's gate, up and down module names (AWQ's skip list)."""
        super().__init__()
        c = cfg.hidden_size
        gate, up, down = names
        self.gate_up_proj = make_linear(
            cfg, c, [intermediate] * 2, False, [gate, up], Split.column([intermediate] * 2)
        )
        self.down_proj = make_linear(
            cfg, intermediate, [c], False, [down], Split.row(intermediate, c), reduce_results=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_fp32: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (weights (T, k), expert ids (T, k) int64), as transformers: a
    softmax in fp32, top k, renormalised over the k if asked, then the weights in the logits'
    dtype (kept in fp32 for Mixtral, `weights_fp32`)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weights_fp32 else weights.to(router_logits.dtype)), ids


def experts_reference(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t: the tokens sorted by
    expert, each expert run once over its rows (ascending expert order, as transformers adds
    them), its outputs scaled and added into the token rows. Reads each routed expert's
    weights once; experts no token chose are skipped. Counting the rows per expert is one
    host sync (the CPU's path; CUDA takes the fused kernel)."""
    top_k = ids.shape[1]
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    token = order // top_k
    scale = weights.flatten()[order].unsqueeze(1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token[start : start + n]
        y = experts[e](x.index_select(0, rows)) * scale[start : start + n]
        out.index_add_(0, rows, y.to(out.dtype))
        start += n
    return out


def stacked_experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """`experts_reference` over stacked weights, w13 (E, 2I, H) and w2 (E, H, I): the oracle
    of the fused kernel (`kernels/triton_moe.py`)."""
    experts = [
        lambda v, e=e: F.linear(kernels.silu_and_mul_ref(F.linear(v, w13[e])), w2[e])
        for e in range(w13.shape[0])
    ]
    return experts_reference(x, weights, ids, experts)


def _awq_stackable(experts: nn.ModuleList) -> bool:
    from steadylm.kernels.triton_moe import awq_supported

    return all(
        awq_supported(lin.in_features, lin.out_features, lin.group) and lin.bias is None
        for lin in (experts[0].gate_up_proj, experts[0].down_proj)
    )


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: router, `num_experts` experts of which each token takes
    `num_experts_per_tok`, and (Qwen2-MoE) a shared expert gated by sigmoid(x w_g)."""

    # "auto" (the fused Triton kernel on CUDA, else the reference), or "reference" / "triton"
    # (tests; "triton" on CPU tensors needs TRITON_INTERPRET=1).
    kernel_choice = "auto"

    def __init__(
        self, cfg: ModelConfig, prefix: str, expert_names=("gate_proj", "up_proj", "down_proj")
    ):
        """prefix: the block's checkpoint name ("model.layers.3.mlp."); expert_names: its
        experts' module names (Mixtral's w1, w3, w2)."""
        super().__init__()
        c, e = cfg.hidden_size, cfg.num_experts
        self.num_experts, self.top_k = e, cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.weights_fp32 = cfg.architecture == "MixtralForCausalLM"
        self.gate = Linear(c, e)  # the router: every rank holds it whole
        self.experts = nn.ModuleList(
            ExpertMLP(
                cfg,
                cfg.moe_intermediate_size,
                tuple(f"{prefix}experts.{i}.{n}" for n in expert_names),
            )
            for i in range(e)
        )
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            shared = cfg.shared_expert_intermediate_size
            names = tuple(
                f"{prefix}shared_expert.{n}" for n in ("gate_proj", "up_proj", "down_proj")
            )
            self.shared_expert = ExpertMLP(cfg, shared, names)
            self.shared_expert_gate = Linear(c, 1)
        # (w13, w2) for the fused kernel: dense stacks, or AWQ's (qweight, qzeros, scales,
        # group) each; None: the experts run one by one (experts_reference).
        self.stacked: tuple | None = None

    def process_weights_after_loading(self) -> None:
        """On a device where the fused kernel runs, stack the experts' weights per layer (the
        dense matrices, or AWQ's qweight / qzeros / scales) and make each expert's parameters
        views of the stack: one copy, which the per-expert modules still read."""
        if self.kernel_choice == "reference":
            return
        first = self.experts[0].gate_up_proj
        awq = isinstance(first, AWQLinear)
        w = first.qweight if awq else getattr(first, "weight", None)
        if not isinstance(w, torch.Tensor) or first.kernel is not None:
            return  # already packed (a CPU kernel of its own): the per-expert path
        if self.kernel_choice == "auto" and w.device.type != "cuda":
            return
        if not platform.triton_usable(w.device) or (awq and not _awq_stackable(self.experts)):
            if self.kernel_choice == "triton":
                raise ValueError("SparseMoeBlock.kernel_choice='triton' cannot run here")
            return
        names = ("qweight", "qzeros", "scales") if awq else ("weight",)
        stacks = []
        for proj in ("gate_up_proj", "down_proj"):
            linears = [getattr(ex, proj) for ex in self.experts]
            per_name = []
            for name in names:
                stack = torch.stack([getattr(lin, name).data for lin in linears])
                for i, lin in enumerate(linears):
                    setattr(lin, name, nn.Parameter(stack[i], requires_grad=False))
                    lin.shared_weight = True  # a view of the stack: no packed copy of its own
                per_name.append(stack)
            stacks.append((*per_name, linears[0].group) if awq else per_name[0])
        self.stacked = tuple(stacks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize, self.weights_fp32)
        if self.stacked is not None:
            from steadylm.kernels.triton_moe import fused_experts  # triton imports where used

            out = fused_experts(x.contiguous(), *self.stacked, weights, ids)
        else:
            out = experts_reference(x, weights, ids, self.experts)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return parallel.all_reduce(out)  # (no-op at tp=1)
