"""Attention backends behind one small interface: `torch_ref`, the pure-torch reference (and
the oracle in tests), and `triton_attn`, the Triton kernels (CUDA)."""

from steadylm.attention.base import AttentionBackend, AttentionGroup, AttentionMetadata, KVCache


def get_backend(name: str = "torch", max_context: int | None = None) -> AttentionBackend:
    """`max_context`: the engine's session_len (the Triton decode split is fixed by it)."""
    if name == "torch":
        from steadylm.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":  # imported only where chosen: triton need not be installed
        from steadylm.attention.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend(max_context=max_context)
    raise ValueError(f"unknown attention backend {name!r}; available: torch, triton")


__all__ = ["AttentionBackend", "AttentionGroup", "AttentionMetadata", "KVCache", "get_backend"]
