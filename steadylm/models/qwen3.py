"""Qwen3: Llama with a per-head RMSNorm on q and k before RoPE."""

from steadylm.config import ModelConfig
from steadylm.models.llama import LlamaForCausalLM
from steadylm.models.registry import register


@register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attn_flags(cls, cfg: ModelConfig) -> dict[str, bool]:
        return {"qkv_bias": cfg.attention_bias, "o_bias": cfg.attention_bias, "qk_norm": True}
