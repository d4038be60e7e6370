"""The attention backend interface and the per-step metadata it receives.

A step's tokens are flat: (T, heads, head_dim). They are split into groups of sequences with
one kernel call each; the model runner puts decode sequences (one new token each) in the first
group and prefill chunks in the second, so decodes are never padded to a prefill's length.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from steadylm import platform


@dataclass
class AttentionGroup:
    """Sequences whose new tokens are the flat slice [token_start, token_end)."""

    token_start: int
    token_end: int
    block_tables: torch.Tensor  # (S, max_blocks) int64, padded with 0
    context_lens: torch.Tensor  # (S,) int64: cached + new tokens after this step
    query_lens: torch.Tensor  # (S,) int64: new tokens this step
    max_query_len: int
    max_context_len: int
    prepared: dict = field(default_factory=dict)  # backend-owned, built once per step
    # The same on the CPU, where the runner has them: a backend that plans on the host (the
    # torch reference) reads these instead of copying device tensors back (a sync on CUDA).
    host_context_lens: torch.Tensor | None = None
    host_query_lens: torch.Tensor | None = None
    host_block_tables: torch.Tensor | None = None

    def host(self, name: str) -> torch.Tensor:
        """`context_lens`, `query_lens` or `block_tables` on the CPU."""
        t = getattr(self, "host_" + name)
        return t if t is not None else getattr(self, name).cpu()


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: flat cache slot of each new token
    groups: list[AttentionGroup]
    block_size: int
    sliding_window: int | None = None
    # Tokens at the end of the flat batch that are padding (a CUDA graph bucket's spare rows):
    # their slots are -1 and they write nowhere.
    num_padded_tokens: int = 0
    # The blocks that requests took since the last step (the model runner's), the only ones
    # a table can name for the first time; None: any entry may be (a backend checks them all).
    new_block_ids: list[int] | None = None


@dataclass
class KVCache:
    """One allocation for all layers. Unquantized: k/v are (L, num_blocks, block_size, Hkv, D)
    in the model dtype. Quantized caches add per-token, per-head scales and zero points."""

    k: torch.Tensor
    v: torch.Tensor
    quant_policy: int = 0
    k_scale_zero: torch.Tensor | None = None  # (L, num_blocks, block_size, Hkv, 2)
    v_scale_zero: torch.Tensor | None = None
    initialized: torch.Tensor | None = None  # (num_blocks,) bool on the CPU: zeroed once used

    def __post_init__(self) -> None:
        if self.initialized is None:
            self.initialized = torch.zeros(self.k.shape[1], dtype=torch.bool)

    @property
    def num_bytes(self) -> int:
        tensors = [self.k, self.v, self.k_scale_zero, self.v_scale_zero]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class AttentionBackend(ABC):
    name: str = "base"

    def allocate(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        quant_policy: int = 0,
    ) -> KVCache:
        """The cache layout every backend shares: (L, num_blocks, block_size, Hkv, D) in the model
        dtype, or uint8 codes (D, or D / 2 for int4: dims 2i and 2i+1 in the low and high nibble
        of byte i) with (scale, zero) per token and head. Uninitialised on purpose: on the CPU the
        pages cost memory only once used."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads)
        if quant_policy == 0:
            cache = KVCache(
                k=torch.empty(*shape, head_dim, dtype=dtype, device=device),
                v=torch.empty(*shape, head_dim, dtype=dtype, device=device),
            )
        else:
            if quant_policy == 4 and head_dim % 2:
                raise ValueError(f"int4 KV needs an even head_dim, got {head_dim}")
            width = head_dim if quant_policy == 8 else head_dim // 2
            cache = KVCache(
                k=torch.empty(*shape, width, dtype=torch.uint8, device=device),
                v=torch.empty(*shape, width, dtype=torch.uint8, device=device),
                quant_policy=quant_policy,
                k_scale_zero=torch.empty(*shape, 2, dtype=dtype, device=device),
                v_scale_zero=torch.empty(*shape, 2, dtype=dtype, device=device),
            )
        for t in (cache.k, cache.v, cache.k_scale_zero, cache.v_scale_zero):
            if t is not None:  # pages fault in as huge pages once used (CPU; a no-op elsewhere)
                platform.advise_huge_pages(t)
                t[:, 0].zero_()  # block 0: the tables' padding entry, read (masked) from the start
        cache.initialized[0] = True
        return cache

    def prepare(self, metadata: AttentionMetadata, cache: KVCache) -> None:
        """Build per-step index tensors once (every layer reuses them) and make the blocks
        this step reads safe to read."""

    @abstractmethod
    def write(
        self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> None:
        """Store this step's k, v (T, Hkv, D) at md.slot_mapping."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, cache: KVCache, layer: int, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal attention of q (T, H, D) over each sequence's cached context -> (T, H, D)."""
