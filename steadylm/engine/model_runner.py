"""The model runner: the only code that touches the device.

It turns a `SchedulerOutput` into flat batch tensors (input ids, positions, slot mapping, block
tables), runs the model, computes logits only for the rows that sample, and calls the sampler.
Decode sequences come first in the flat batch and prefill chunks after them, each group with
its own attention call.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from steadylm.attention import AttentionBackend, AttentionGroup, AttentionMetadata, KVCache
from steadylm.engine.block_manager import BlockManager
from steadylm.engine.sampler import Sampler
from steadylm.engine.scheduler import ScheduledRequest, SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_cache: KVCache,
        block_manager: BlockManager,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.bm = block_manager
        self.device = device
        self.sampler = Sampler(device, seed)
        self.sliding_window = model.cfg.sliding_window
        self.model_seconds = 0.0  # time inside the model forward + logits (benchmarks read it)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, dict | None]]:
        """Run one step; return request id -> (sampled token, logprobs) for rows that sample."""
        if out.is_empty:
            return {}
        order = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first
        ids, positions, md = self._prepare(order)
        self.backend.prepare(md, self.kv_cache)
        t0 = time.perf_counter()
        hidden = self.model(ids, positions, self.backend, self.kv_cache, md)  # (T, C)
        sampling = [s for s in order if s.samples]
        if not sampling:
            self.model_seconds += time.perf_counter() - t0
            return {}
        ends = torch.tensor([s.num_new_tokens for s in order]).cumsum(0)
        rows = torch.tensor([i for i, s in enumerate(order) if s.samples])
        logits = self.model.compute_logits(hidden[(ends[rows] - 1).to(self.device)])  # (S, V)
        if logits.is_cuda:
            torch.cuda.synchronize()  # so model_seconds measures the work, not the launch
        self.model_seconds += time.perf_counter() - t0
        requests = [s.request for s in sampling]
        result = self.sampler(logits, requests)
        return {
            r.request_id: (tok, lp)
            for r, tok, lp in zip(requests, result.token_ids, result.logprobs)
        }

    @torch.inference_mode()
    def all_logits(self, s: ScheduledRequest) -> torch.Tensor:
        """Logits of every new token of one scheduled chunk, (n, V) float32 (for scoring)."""
        ids, positions, md = self._prepare([s])
        self.backend.prepare(md, self.kv_cache)
        hidden = self.model(ids, positions, self.backend, self.kv_cache, md)
        return self.model.compute_logits(hidden)

    def _prepare(self, order: list[ScheduledRequest]):
        dev = self.device
        bs = self.bm.block_size
        tokens: list[int] = []
        for s in order:
            start = s.request.num_computed_tokens
            tokens += s.request.token_ids(start, start + s.num_new_tokens)
        q_lens = torch.tensor([s.num_new_tokens for s in order])
        computed = torch.tensor([s.request.num_computed_tokens for s in order])
        seq_of_token = torch.repeat_interleave(torch.arange(len(order)), q_lens)  # (T,)
        starts = q_lens.cumsum(0) - q_lens
        positions = torch.arange(len(tokens)) - starts[seq_of_token] + computed[seq_of_token]
        tables = [self.bm.block_table(s.request.request_id) for s in order]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # (S, MB)
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        ctx = computed + q_lens
        num_decode = sum(1 for s in order if s.num_new_tokens == 1)
        groups = []
        for lo, hi in ((0, num_decode), (num_decode, len(order))):
            if lo == hi:
                continue
            groups.append(
                AttentionGroup(
                    token_start=int(starts[lo]),
                    token_end=int(starts[hi - 1] + q_lens[hi - 1]),
                    block_tables=block_tables[lo:hi].to(dev),
                    context_lens=ctx[lo:hi].to(dev),
                    query_lens=q_lens[lo:hi].to(dev),
                    max_query_len=int(q_lens[lo:hi].max()),
                    max_context_len=int(ctx[lo:hi].max()),
                )
            )
        md = AttentionMetadata(slot_mapping.to(dev), groups, bs, self.sliding_window)
        return torch.tensor(tokens, device=dev), positions.to(dev), md
