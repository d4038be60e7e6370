"""Qwen2 / Qwen2.5 / DeepSeek-R1-Distill-Qwen: Llama with a bias on q, k and v."""

from steadylm.config import ModelConfig
from steadylm.models.llama import LlamaForCausalLM
from steadylm.models.registry import register


@register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attn_flags(cls, cfg: ModelConfig) -> dict[str, bool]:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}
