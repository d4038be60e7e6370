"""Llama (and the decoder shared by Qwen2, Qwen3 and Mistral, which set class flags)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steadylm import kernels, parallel
from steadylm.attention import AttentionBackend, AttentionMetadata, KVCache
from steadylm.config import ModelConfig
from steadylm.layers.linear import Linear, OneDNNDenseKernel, make_linear
from steadylm.layers.norm import RMSNorm
from steadylm.layers.rotary import RotaryEmbedding, rotate
from steadylm.layers.shard import Shard, Split, check_shape, copy_rows
from steadylm.memory import tp_shape
from steadylm.models.registry import register


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer = layer
        # This rank's heads: query heads split evenly, KV heads split or (fewer KV heads than
        # ranks) one replicated head per rank, the one its query heads attend to.
        heads, kv_heads, _, _ = tp_shape(cfg, parallel.world_size())
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, cfg.head_dim
        d, r = cfg.head_dim, parallel.rank()
        kv_first = r * cfg.num_kv_heads // parallel.world_size()
        q_rows = Shard(r * heads * d, heads * d, cfg.q_size)
        kv_rows = Shard(kv_first * d, kv_heads * d, cfg.kv_size)
        at = f"model.layers.{layer}.self_attn."
        self.qkv_proj = make_linear(
            cfg,
            cfg.hidden_size,
            [cfg.q_size, cfg.kv_size, cfg.kv_size],
            qkv_bias,
            [at + "q_proj", at + "k_proj", at + "v_proj"],
            Split((q_rows, kv_rows, kv_rows)),
        )
        self.o_proj = make_linear(
            cfg,
            cfg.q_size,
            [cfg.hidden_size],
            o_bias,
            [at + "o_proj"],
            Split.row(cfg.q_size, cfg.hidden_size),
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, rope, backend: AttentionBackend, cache: KVCache, md: AttentionMetadata):
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(-1, h + 2 * hkv, d)  # (T, H + 2 Hkv, D)
        v = qkv[:, h + hkv :]
        if self.q_norm is None:  # one rotary pass over q and k together (fewer small ops)
            qk = rotate(qkv[:, : h + hkv], *rope)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q, k = self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + hkv])
            q, k = rotate(q, *rope), rotate(k, *rope)
        backend.write(cache, self.layer, k, v, md)
        o = backend.forward(q, cache, self.layer, md, self.scale)  # (T, H, D)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        at = f"model.layers.{layer}.mlp."
        i, c = cfg.intermediate_size, cfg.hidden_size
        self.gate_up_proj = make_linear(
            cfg, c, [i] * 2, False, [at + "gate_proj", at + "up_proj"], Split.column([i] * 2)
        )
        self.down_proj = make_linear(cfg, i, [c], False, [at + "down_proj"], Split.row(i, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))  # [gate | up] halves


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, mlp: nn.Module, **attn_flags: bool):
        super().__init__()
        self.self_attn = Attention(cfg, layer, **attn_flags)
        self.mlp = mlp  # a dense MLP, or a sparse MoE block (layers/moe.py)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, backend, cache, md):
        """x: the previous layer's MLP output, residual: the stream before it (None at layer
        0, where x is the embedding). Returns this layer's (MLP output, residual stream); the
        adds happen inside the next norm, as HF's `residual + hidden_states`."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, backend, cache, md)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Embedding(nn.Module):
    """Vocab-parallel: each rank holds a block of ceil(V / tp) rows; a token outside the
    block embeds to zeros there, and the sum over ranks is its row."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.rows = Split.vocab(vocab_size).out[0]
        self.weight = nn.Parameter(torch.empty(self.rows.size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded, shard_id: object = None) -> None:
        check_shape(loaded, (self.rows.full, param.shape[1]))
        copy_rows(param.data, loaded, self.rows)

    def share_rows(self, rows) -> None:
        """Read rows through `rows` (ids -> (T, C): a tied LM head's packed copy) and drop the
        dense weight, so the model holds one copy of the matrix."""
        self.read_rows = rows
        del self.weight

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        rows = getattr(self, "read_rows", None)
        return F.embedding(ids, self.weight) if rows is None else rows(ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if parallel.world_size() == 1:
            return self.lookup(ids)
        local = ids - self.rows.start
        mine = (local >= 0) & (local < self.rows.size)
        x = self.lookup(local.clamp(0, self.rows.size - 1))
        return parallel.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, make_mlp, **attn_flags: bool):
        """make_mlp(cfg, layer) -> that layer's MLP module."""
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, make_mlp(cfg, i), **attn_flags) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim)

    def forward(self, ids, positions, backend, cache, md):
        x = self.embed_tokens(ids)  # (T, C)
        upto = max(g.max_context_len for g in md.groups)  # every position is below it
        rope = self.rotary.cos_sin(positions, x.dtype, upto)  # once per step, for every layer
        plan = self._native_decode(x, cache, md)
        if plan is not None:
            x, residual = plan.run(x, rope, cache, md)
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, rope, backend, cache, md)
        return self.norm(x, residual)[0]

    def _native_decode(self, x, cache: KVCache, md: AttentionMetadata) -> NativeDecode | None:
        """The one-call layer stack for this step, if it is one: decode rows only, whose
        attention the backend gave to a native kernel (the decode one, or the per-row one
        over an int8 / int4 cache)."""
        if not x.is_cpu:  # (and a CUDA run never builds the CPU kernels for it)
            return None
        if "native_decode" not in self.__dict__:  # decided once, after the weights are packed
            self.native_decode = NativeDecode.build(self)
        plan = self.native_decode
        if plan is None or len(md.groups) != 1 or md.num_padded_tokens:
            return None
        g = md.groups[0]
        # The backend's plan: the decode kernel (unquantized), or the per-row kernel over an
        # int8 / int4 cache, here for decode rows only.
        kernel = "rows" if cache.quant_policy else "native"
        stored = cache.k_scale_zero if cache.quant_policy else cache.k  # in the model dtype
        if (
            kernel not in g.prepared
            or g.max_query_len != 1
            or x.shape[0] > plan.max_rows
            or x.dtype != stored.dtype
        ):
            return None
        return plan


class NativeDecode:
    """Every decoder layer of a decode step in one native call (`kernels.decode_layers`):
    the ops the modules call, in their order and with their arguments, so the bits are the
    same, without ~12 Python dispatches a layer (2-3 ms of an 11-17 ms step at batch 1 on a
    2-vCPU CPU, docs/benchmarks.md). Taken where every layer is Llama's (an optional qkv
    bias; no q/k norm, no bias after a row-parallel linear), one rank, and every linear has a
    packed GEMV, over a plain or int8 / int4 cache; `STEADYLM_CPU_DECODE_LAYERS=modules`
    keeps the module path. Batches above the GEMVs' rows (bf16 in AMX's layout: 2) run
    oneDNN's matmul inside the same call, as the modules would."""

    def __init__(self, op, layers, eps: float) -> None:
        attn, mlp = layers[0].self_attn, layers[0].mlp
        self.op, self.eps, self.scale = op, eps, attn.scale
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate = mlp.gate_up_proj.out_features // 2
        self.norm1 = [layer.input_layernorm.weight for layer in layers]
        self.norm2 = [layer.post_attention_layernorm.weight for layer in layers]
        linears = [(lay.self_attn.qkv_proj, lay.self_attn.o_proj, lay.mlp) for lay in layers]
        self.qkv = [q.kernel.gemv_address for q, _, _ in linears]
        self.qkv_bias = [q.kernel.bias for q, _, _ in linears]
        self.o_proj = [o.kernel.gemv_address for _, o, _ in linears]
        self.gate_up = [m.gate_up_proj.kernel.gemv_address for _, _, m in linears]
        self.down = [m.down_proj.kernel.gemv_address for _, _, m in linears]
        packed = [lin.kernel for q, o, m in linears for lin in (q, o, m.gate_up_proj, m.down_proj)]
        self.gemv_rows = min(k.gemv_max_rows for k in packed)
        full = kernels.packed_linear_max_rows()
        if self.gemv_rows < full:  # bf16 in AMX's layout: oneDNN's matmul above gemv_rows
            self.onednn = [k.weight for k in packed]
            self.max_rows = full
        else:
            self.onednn = []
            self.max_rows = self.gemv_rows

    @classmethod
    def build(cls, model: DecoderModel) -> NativeDecode | None:
        op = kernels.native_decode_layers()
        layers = list(model.layers)
        if op is None or parallel.world_size() != 1 or not layers:
            return None
        eps = {model.norm.eps}
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not MLP:  # a MoE block: the module path
                return None
            eps |= {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if attn.q_norm is not None or any(
                getattr(lin.kernel, "gemv_address", None) is None for lin in linears
            ):
                return None
            if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
                return None
            if mlp.gate_up_proj.kernel.bias is not None or attn.o_proj.kernel.bias is not None:
                return None
        return cls(op, layers, eps.pop()) if len(eps) == 1 else None

    def run(self, x, rope, cache: KVCache, md: AttentionMetadata):
        """(last layer's MLP output, residual stream), as the module loop returns them."""
        g = md.groups[0]
        cos, sin = rope
        p = g.prepared
        bits = cache.quant_policy
        return self.op(
            x,
            self.norm1,
            self.norm2,
            self.qkv,
            self.qkv_bias,
            self.o_proj,
            self.gate_up,
            self.down,
            cache.k,
            cache.v,
            cos,
            sin,
            md.slot_mapping,
            g.block_tables,
            p["token_ctx"] if bits else g.context_lens,
            cache.k_scale_zero,
            cache.v_scale_zero,
            p["token_seq"] if bits else None,
            bits,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.intermediate,
            self.eps,
            self.scale,
            p["window"],
            self.onednn,
            self.gemv_rows,
        )


@register("LlamaForCausalLM")
class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our module name, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def attn_flags(cls, cfg: ModelConfig) -> dict[str, bool]:
        return {"qkv_bias": cfg.attention_bias, "o_bias": cfg.attention_bias, "qk_norm": False}

    @classmethod
    def make_mlp(cls, cfg: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer`'s MLP (a mixture-of-experts model returns its sparse block)."""
        return MLP(cfg, layer)

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        """(parameter name, shard) for a checkpoint tensor name the `packed_modules` fragments
        do not cover, or None to use them."""
        return None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg, self.make_mlp, **self.attn_flags(cfg))
        # Vocab-parallel like the embedding: each rank computes its block of the logits.
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, split=Split.vocab(cfg.vocab_size))
        self.lm_head.greedy_screen = parallel.world_size() == 1
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads  # this rank's
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.lm_head.shared_weight = True

    def process_weights_after_loading(self) -> None:
        """A tied LM head on the CPU gets the packed GEMV kernel the untied heads have, and the
        embedding reads its rows out of the same packed buffer (one copy of the matrix, as
        before). On SmolLM2's 49152 x 576 head: 10.8 -> 5.0 ms at 1 row, 21.5 -> 6.4 ms at 5."""
        head = self.lm_head
        if not head.shared_weight or head.bias is not None:
            return
        tied = OneDNNDenseKernel.tied(head.weight.data)
        if tied is None:
            return
        head.kernel, rows = tied
        head.weight = None
        self.model.embed_tokens.share_rows(rows)

    def forward(
        self, ids, positions, backend: AttentionBackend, cache: KVCache, md: AttentionMetadata
    ):
        """ids, positions (T,) -> final hidden states (T, C)."""
        return self.model(ids, positions, backend, cache, md)

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's argmax of compute_logits(hidden) where the LM head can give it without
        the logits (an int8 copy, checked exactly: layers/linear.py), else None. Only a head
        built at tp == 1 (greedy_screen) and untied (its own kernel) keeps the copy."""
        return self.lm_head.greedy_tokens(hidden)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor | None:
        """(S, V) float32 logits (at tp == 1 with float32=False, as the lm_head wrote them: for a
        step whose tokens are their argmax, `Sampler.plain_greedy`); at tp > 1 gathered on rank
        0 (None on the other ranks)."""
        logits = self.lm_head(hidden)
        if parallel.world_size() == 1:
            return logits.float() if float32 else logits
        full = parallel.gather_to_first(logits.float(), dim=-1)
        return None if full is None else full[:, : self.cfg.vocab_size]
