"""Mixtral: Mistral's decoder with a sparse MoE block in every layer (8 experts, top 2, the
top-k weights renormalised). The checkpoint names the block `block_sparse_moe` and its
experts' projections w1 (gate), w3 (up), w2 (down)."""

import re

from torch import nn

from steadylm.config import ModelConfig
from steadylm.layers.moe import SparseMoeBlock
from steadylm.models.mistral import MistralForCausalLM
from steadylm.models.registry import register

_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3)\.")
_PROJ = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}


@register("MixtralForCausalLM")
class MixtralForCausalLM(MistralForCausalLM):
    @classmethod
    def make_mlp(cls, cfg: ModelConfig, layer: int) -> nn.Module:
        return SparseMoeBlock(cfg, f"model.layers.{layer}.block_sparse_moe.", ("w1", "w3", "w2"))

    def map_weight_name(self, name: str) -> tuple[str, int | None] | None:
        if ".block_sparse_moe." not in name:
            return None
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT.search(name)
        if m is None:
            return name, None  # the router
        proj, shard = _PROJ[m.group(2)]
        return name[: m.start()] + f".experts.{m.group(1)}.{proj}." + name[m.end() :], shard
