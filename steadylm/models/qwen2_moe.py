"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v bias) with a sparse MoE block that adds
a shared expert gated by sigmoid(x w_g)."""

from torch import nn

from steadylm.config import ModelConfig
from steadylm.models.qwen2 import Qwen2ForCausalLM
from steadylm.models.qwen3_moe import moe_or_dense_mlp
from steadylm.models.registry import register


@register("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    @classmethod
    def make_mlp(cls, cfg: ModelConfig, layer: int) -> nn.Module:
        return moe_or_dense_mlp(cfg, layer)
