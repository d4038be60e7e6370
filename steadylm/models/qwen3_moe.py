"""Qwen3-MoE: Qwen3's attention (q/k norm) with a sparse MoE block in the layers
`ModelConfig.moe_layers` names (`decoder_sparse_step`, less `mlp_only_layers`)."""

from torch import nn

from steadylm.config import ModelConfig
from steadylm.layers.moe import SparseMoeBlock
from steadylm.models.llama import MLP
from steadylm.models.qwen3 import Qwen3ForCausalLM
from steadylm.models.registry import register


def moe_or_dense_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """Qwen's rule: the sparse block in `moe_layers`, a dense MLP of intermediate_size
    elsewhere."""
    if layer in cfg.moe_layers:
        return SparseMoeBlock(cfg, f"model.layers.{layer}.mlp.")
    return MLP(cfg, layer)


@register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def make_mlp(cls, cfg: ModelConfig, layer: int) -> nn.Module:
        return moe_or_dense_mlp(cfg, layer)
