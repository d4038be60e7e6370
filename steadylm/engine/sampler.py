"""Batched sampling for one step: penalties, bans, the structured-output token bitmask,
temperature, top-k, top-p, min-p, then an exponential race (argmax of p / E, E ~ Exp(1)), which
draws from p without a host sync. Logprobs are those of the logits before the bitmask.

A seeded request's noise for its j-th output token is drawn from a generator seeded with
(seed, j) alone, so its tokens depend on nothing else: not the batch, not a preemption, not
how many draft positions a speculative step scored before it. Unseeded rows share the
engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from steadylm import kernels
from steadylm.engine.request import SamplingParams
from steadylm.engine.structured import apply_token_bitmask


class SamplingRow(Protocol):
    """What the sampler reads of a request (the runner's `RunnerRequest`, or a `Request`)."""

    request_id: str
    params: SamplingParams
    eos_token_ids: tuple[int, ...]

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.seeded = torch.Generator(device=device)  # reseeded per seeded row: no state kept

    def release(self, request_id: str) -> None:
        """A request ended (the sampler keeps no state per request)."""

    @staticmethod
    def plain_greedy(requests: list[SamplingRow]) -> bool:
        """Whether each row's token is the argmax of its raw logits: every row greedy, with no
        logprobs and nothing that edits its logits (`_edits_logits`). Such a step's logits may
        stay in the model's dtype."""
        return all(
            r.params.greedy and r.params.logprobs is None and not _edits_logits(r) for r in requests
        )

    def __call__(self, logits: torch.Tensor, requests: list[SamplingRow]) -> SamplerOutput:
        """logits (S, V), one row per request that samples this step: float32, or any float
        dtype when `plain_greedy(requests)`. A retried seeded request draws the same."""
        return self._sample_step(logits, requests)

    def _sample_step(self, logits: torch.Tensor, requests: list[SamplingRow]) -> SamplerOutput:
        if self.plain_greedy(requests):
            return SamplerOutput(kernels.argmax(logits).tolist(), [None] * len(requests))
        logits = logits.float()  # (float32 already unless plain_greedy)
        raw = logits
        logits = self._apply_penalties(logits, requests)
        raw_logprobs = None
        want = [r.params.logprobs for r in requests]
        if any(w is not None for w in want):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = _apply_bitmask(logits, raw, requests)
        tokens = kernels.argmax(logits)
        if not all(r.params.greedy for r in requests):  # decided on the host: no sync
            greedy = torch.tensor([r.params.greedy for r in requests], device=logits.device)
            sampled = self._sample(logits, requests)
            tokens = torch.where(greedy, tokens, sampled)
        token_list = tokens.tolist()
        logprobs = _collect_logprobs(raw_logprobs, token_list, want)
        return SamplerOutput(token_list, logprobs)

    def _apply_penalties(self, logits: torch.Tensor, requests: list[SamplingRow]) -> torch.Tensor:
        if not any(_edits_logits(r) for r in requests):  # the plain_greedy fast path relies on it
            return logits
        banned_rows, banned_cols = [], []
        for i, r in enumerate(requests):
            ids = _banned_ids(r)
            banned_rows += [i] * len(ids)
            banned_cols += ids
        penalised = [i for i, r in enumerate(requests) if r.params.repetition_penalty != 1.0]
        counted = [
            i
            for i, r in enumerate(requests)
            if r.params.presence_penalty or r.params.frequency_penalty
        ]
        biased = [i for i, r in enumerate(requests) if r.params.logit_bias]
        logits = logits.clone()
        vocab = logits.shape[-1]
        # Ids past the vocabulary can never be sampled: nothing to ban (clamping them would
        # ban the last real token instead).
        pairs = [(r, c) for r, c in zip(banned_rows, banned_cols) if c < vocab]
        if pairs:
            rows = torch.tensor([r for r, _ in pairs], device=logits.device)
            cols = torch.tensor([c for _, c in pairs], device=logits.device)
            logits[rows, cols] = float("-inf")
        for i in penalised:  # HF semantics: divide positive logits, multiply negative ones
            seen = torch.tensor(sorted(set(requests[i].all_token_ids)), device=logits.device)
            seen = seen[seen < vocab]
            p = requests[i].params.repetition_penalty
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p, vals * p)
        for i in counted:  # OpenAI / vLLM semantics, over the generated tokens only
            out = [t for t in requests[i].output_token_ids if t < vocab]
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab).to(
                logits.device, logits.dtype
            )
            p = requests[i].params
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        for i in biased:
            pairs = [(t, b) for t, b in requests[i].params.logit_bias if t < vocab]
            if pairs:
                ids = torch.tensor([t for t, _ in pairs], device=logits.device)
                bias = torch.tensor([b for _, b in pairs], device=logits.device)
                logits[i, ids] += bias.to(logits.dtype)
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[SamplingRow]) -> torch.Tensor:
        dev = logits.device
        vocab = logits.shape[-1]
        # Greedy rows are replaced by the argmax afterwards; give them a harmless temperature.
        temp = [1.0 if r.params.greedy else r.params.temperature for r in requests]
        temp = torch.tensor(temp, device=dev)
        top_k = torch.tensor([min(r.params.top_k, vocab) for r in requests], device=dev)
        top_p = torch.tensor([r.params.top_p for r in requests], device=dev)
        min_p = torch.tensor([r.params.min_p for r in requests], device=dev)
        probs = filter_probs(logits / temp[:, None], top_k, top_p, min_p)
        noise = torch.empty_like(probs)
        for i, r in enumerate(requests):
            if r.params.seed is None:
                noise[i].exponential_(generator=self.generator)
            else:
                self.seeded.manual_seed(position_seed(r.params.seed, r.num_output_tokens))
                noise[i].exponential_(generator=self.seeded)
        return kernels.argmax(probs / noise)


def position_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's noise for its output token `index`: SplitMix64 over
    (seed, index), so neighbouring positions and seeds draw unrelated noise."""
    mask = 2**64 - 1
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def _banned_ids(r: SamplingRow) -> list[int]:
    """Token ids the row may not produce this step: its bad words, and its stop and EOS tokens
    until min_new_tokens."""
    ids = list(r.params.bad_token_ids)
    if r.num_output_tokens < r.params.min_new_tokens:
        ids += list(r.params.stop_token_ids) + list(r.eos_token_ids)
    return ids


def _edits_logits(r: SamplingRow) -> bool:
    """Whether `_apply_penalties` or `_apply_bitmask` change this row's logits: bans,
    penalties, logit bias, or a token bitmask. The one test of both the sampler's full path
    and the plain-greedy one (a feature added to either must be added here)."""
    p = r.params
    return bool(
        _banned_ids(r)
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
        or p.logit_bias
        or getattr(r, "token_bitmask", None) is not None
    )


def _apply_bitmask(
    logits: torch.Tensor, raw: torch.Tensor, requests: list[SamplingRow]
) -> torch.Tensor:
    """The logits with each constrained row's disallowed tokens at -inf (`raw`: before the
    penalties and bans)."""
    rows = [i for i, r in enumerate(requests) if getattr(r, "token_bitmask", None) is not None]
    if not rows:
        return logits
    bitmask = torch.stack([requests[i].token_bitmask for i in rows])
    masked = logits.clone() if logits is raw else logits  # never write the model's logits
    apply_token_bitmask(masked, bitmask, rows)
    # A ban (min_new_tokens, bad words) may remove every token the grammar allows, e.g.
    # EOS once the grammar is complete: the grammar wins.
    dead = ~masked[rows].isfinite().any(dim=-1)
    if bool(dead.any()):
        fallback = raw[rows][dead]  # a copy
        keep = bitmask[dead.to(bitmask.device)]
        apply_token_bitmask(fallback, keep, list(range(len(keep))))
        idx = torch.tensor(rows, device=logits.device)[dead.to(logits.device)]
        masked[idx] = fallback
    return masked


def filter_probs(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Probabilities after top-k, top-p (nucleus) and min-p, renormalised. logits (S, V);
    top_k 0 disables it. At least the most likely token always survives."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass before it already reaches top_p.
    before = probs.cumsum(dim=-1) - probs
    drop = (before >= top_p[:, None]) & (rank > 0)
    drop |= probs < min_p[:, None] * probs[:, :1]
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.empty_like(probs).scatter_(1, order, probs)


def _collect_logprobs(
    raw: torch.Tensor | None, tokens: list[int], want: list[int | None]
) -> list[dict[int, float] | None]:
    if raw is None:
        return [None] * len(tokens)
    out: list[dict[int, float] | None] = []
    kmax = min(max(w or 0 for w in want), raw.shape[-1])
    top_vals, top_ids = raw.topk(kmax, dim=-1) if kmax else (None, None)
    chosen = raw.gather(1, torch.tensor(tokens, device=raw.device)[:, None]).squeeze(1).tolist()
    for i, w in enumerate(want):
        if w is None:
            out.append(None)
            continue
        d = {tokens[i]: chosen[i]}
        if w:
            d.update(zip(top_ids[i, :w].tolist(), top_vals[i, :w].tolist()))
        out.append(d)
    return out
