"""Mistral: the Llama decoder; its sliding window (when set) is applied by the attention mask."""

from steadylm.config import ModelConfig
from steadylm.models.llama import LlamaForCausalLM
from steadylm.models.registry import register


@register("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def attn_flags(cls, cfg: ModelConfig) -> dict[str, bool]:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False}
