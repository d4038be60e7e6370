"""Decode steps from static buffers, padded to batch-size buckets: CUDA graphs on the GPU.

A decode step (every sequence feeds one token) of n sequences runs as the smallest bucket
b >= n of 1, 2, 4, 8, ... up to `max_batch_size`. The inputs live in static buffers (token
ids, positions, slots, block tables, context lengths); rows n..b-1 are padding: slot -1 (the
store writes nowhere), context 1, block table zeros, and their outputs are never read. The
attention backend's per-step preparation and the model forward are captured together per
bucket (largest first, one shared memory pool) and replayed; logits and sampling run
outside the graph, on the real rows only.

The engine captures them when its memory plan reserved their pool (CUDA, tp=1, the Triton
backend, not `eager_mode`; see `llm_engine._captures_cuda_graphs`); otherwise decode takes the
runner's ordinary path. With `capture=False` the same padded path runs eagerly: that is how
the tests check the bucketing and padding on the CPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from steadylm.attention import AttentionBackend, AttentionGroup, AttentionMetadata, KVCache
from steadylm.memory import graph_buckets

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """The static buffers and, when `capture`, one CUDA graph per bucket."""

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        cache: KVCache,
        block_size: int,
        max_batch_size: int,
        max_model_len: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        self.model, self.backend, self.cache = model, backend, cache
        self.block_size = block_size
        self.sliding_window = model.cfg.sliding_window
        self.buckets = graph_buckets(max_batch_size)
        self.max_blocks = math.ceil(max_model_len / block_size)
        self.device = device
        b, dev = self.buckets[-1], device
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.full((b,), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros(b, self.max_blocks, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(b, dtype=torch.long, device=dev)
        self.query_lens = torch.ones(b, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = dict.fromkeys(self.buckets, 0)  # steps run per bucket
        if capture:
            self._capture_all()

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def fits(self, num_seqs: int, widest_table: int) -> bool:
        return num_seqs <= self.buckets[-1] and widest_table <= self.max_blocks

    def _metadata(self, b: int, host: tuple | None = None) -> AttentionMetadata:
        """The bucket's metadata over the static buffers. `host` (eager runs only): the step's
        context lengths, query lengths and block tables on the CPU, for backends that plan on
        the host (the torch reference); a graph's metadata has none (it must not need them)."""
        group = AttentionGroup(
            0,
            b,
            self.tables[:b],
            self.context_lens[:b],
            self.query_lens[:b],
            max_query_len=1,
            max_context_len=self.max_blocks * self.block_size,
        )
        if host is not None:
            group.host_context_lens, group.host_query_lens, group.host_block_tables = host
        return AttentionMetadata(self.slots[:b], [group], self.block_size, self.sliding_window)

    def _forward(self, b: int, md: AttentionMetadata) -> torch.Tensor:
        self.backend.prepare(md, self.cache)
        return self.model(self.ids[:b], self.positions[:b], self.backend, self.cache, md)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        with torch.cuda.device(self.device):  # capture on this device's stream (cuda:1 too)
            pool = torch.cuda.graph_pool_handle()
            for b in reversed(self.buckets):  # largest first: the smaller ones reuse its pool
                md = self._metadata(b)
                self._forward(b, md)  # compiles the kernels and warms the allocator, outside
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[b] = self._forward(b, md)
                self.graphs[b] = graph
            torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def run(
        self, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """One decode step: each sequence's token, its position and its block ids -> the
        final hidden states of the real rows, (n, C)."""
        n, bs = len(tokens), self.block_size
        b = self.bucket(n)
        pad = b - n
        pos = torch.tensor(list(positions) + [0] * pad)
        width = max(len(t) for t in tables)  # the columns past it are never read
        table = torch.zeros(b, width, dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t)
        slots = table[torch.arange(b), pos // bs] * bs + pos % bs
        slots[n:] = -1  # padded rows write nowhere
        ctx = pos + 1  # padded rows: position 0, one key (block 0), never read
        self.ids[:b].copy_(torch.tensor(list(tokens) + [0] * pad), non_blocking=True)
        self.positions[:b].copy_(pos, non_blocking=True)
        self.slots[:b].copy_(slots, non_blocking=True)
        self.tables[:b, :width].copy_(table, non_blocking=True)
        self.context_lens[:b].copy_(ctx, non_blocking=True)
        self.replays[b] += 1
        if b in self.graphs:
            with torch.cuda.device(self.device):
                self.graphs[b].replay()
            return self.outputs[b][:n]
        host = (ctx, torch.ones(b, dtype=torch.long), table)
        md = self._metadata(b, host)
        md.num_padded_tokens = pad
        return self._forward(b, md)[:n]
