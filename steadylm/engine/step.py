"""The step contract: everything a model runner needs for one step, as plain picklable data.

The scheduler side decides with live `Request` objects and a `BlockManager`; the runner side (in
this process, or in tensor-parallel worker processes) sees only this contract and keeps its own
per-request state from it. A request is sent whole once (`NewRequestData`: on admission, and
again when it resumes after preemption), then only as differences (`CachedRequestData`: the
tokens appended since, new block ids, how far it is computed and how many tokens to feed).
`finished_ids` drop a request's runner state; `preempted_ids` drop its tokens and blocks but
keep its seeded generator, so a resumed request samples as it would have. `token_bitmask` holds
the allowed-token rows of this step's constrained requests (structured output, thinking
budgets); only the sampling rank reads it. A decoding request may carry draft tokens
(`spec_token_ids`, speculative decoding): this step feeds its last known token and them, and
samples at every one of those positions. After a step that rejected drafts the scheduler may
have taken back blocks at the end of a table: `num_kept_blocks` says how many of the blocks
the runner knows are still the request's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from steadylm.engine.request import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    token_ids: list[int]  # prompt + outputs so far (outputs only after a preemption)
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hits)
    num_new_tokens: int  # tokens to compute this step
    spec_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class CachedRequestData:
    request_id: str
    new_token_ids: list[int]  # appended since the runner last saw it (sampled tokens)
    new_block_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int  # with drafts: 1 + len(spec_token_ids)
    num_kept_blocks: int  # the runner's table is cut to this many blocks, then new_block_ids
    spec_token_ids: tuple[int, ...] = ()


@dataclass
class StepContract:
    new: list[NewRequestData] = field(default_factory=list)
    cached: list[CachedRequestData] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # request id -> its row of allowed tokens (ceil(V / 32) int32 words) for this step
    token_bitmask: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def scheduled(self) -> list[tuple[str, int]]:
        """(request id, tokens to compute) of every request this step runs, in order."""
        return [(r.request_id, r.num_new_tokens) for r in (*self.new, *self.cached)]


class ContractBuilder:
    """Scheduler side: remembers what the runner has been told about each request, so each
    step sends only the differences. Requests finished or aborted between steps are reported
    with the next step."""

    def __init__(self) -> None:
        self.sent: dict[str, tuple[int, int]] = {}  # id -> (tokens sent, blocks sent)
        self.pending_finished: list[str] = []

    def truncate(self, request_id: str, num_blocks: int) -> None:
        """The request's table was cut to `num_blocks` (rejected drafts' blocks released)."""
        known = self.sent.get(request_id)
        if known is not None:
            self.sent[request_id] = (known[0], min(known[1], num_blocks))

    def finish(self, request_id: str) -> None:
        self.sent.pop(request_id, None)
        self.pending_finished.append(request_id)

    def build(self, scheduled, preempted, block_table) -> StepContract:
        """`scheduled`: (Request, num_new_tokens, spec_token_ids) triples (or pairs, without
        drafts); `preempted`: Requests preempted by this schedule; `block_table(request_id)`
        gives the request's current block ids."""
        contract = StepContract(finished_ids=self.pending_finished)
        self.pending_finished = []
        for req in preempted:
            if self.sent.pop(req.request_id, None) is not None:
                contract.preempted_ids.append(req.request_id)
        for req, n, *spec in scheduled:
            spec = tuple(spec[0]) if spec else ()
            rid, table = req.request_id, block_table(req.request_id)
            known = self.sent.get(rid)
            if known is None:
                contract.new.append(
                    NewRequestData(
                        rid,
                        req.all_token_ids,
                        req.num_prompt_tokens,
                        req.params,
                        req.eos_token_ids,
                        list(table),
                        req.num_computed_tokens,
                        n,
                        spec,
                    )
                )
            else:
                tokens, blocks = known
                contract.cached.append(
                    CachedRequestData(
                        rid,
                        req.token_ids(tokens, req.num_tokens),
                        list(table[blocks:]),
                        req.num_computed_tokens,
                        n,
                        blocks,
                        spec,
                    )
                )
            self.sent[rid] = (req.num_tokens, len(table))
        return contract
