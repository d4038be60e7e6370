"""Attention backends behind one small interface; `torch_ref` is the pure-torch reference."""

from steadylm.attention.base import AttentionBackend, AttentionGroup, AttentionMetadata, KVCache


def get_backend(name: str = "torch") -> AttentionBackend:
    if name == "torch":
        from steadylm.attention.torch_ref import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: torch")


__all__ = ["AttentionBackend", "AttentionGroup", "AttentionMetadata", "KVCache", "get_backend"]
