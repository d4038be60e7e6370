"""The scheduler decides what each step computes. It never touches tensors.

Progress guarantee: `session_len` never exceeds the KV capacity (the engine clamps it at
startup), running requests are served oldest first, and when one cannot grow the newest running
request is preempted (recompute). So the oldest request can always take one more token, every
running request finishes, and every waiting request is admitted once the pool drains. No input
reaches an assert: a request that still cannot grow alone is finished with an error.

Order: every request has a key, (priority, arrival number); the waiting queue and the running
batch are both kept in key order. Under "fcfs" (the default) the priority is 0 for all, so the
key is arrival order. Under "priority" (vLLM's `--scheduling-policy priority`) a lower value
comes first and, within a value, the earlier arrival. The same guarantee holds with "oldest"
read as "first in key order", and a waiting request may preempt running requests of a larger
value when it cannot be admitted otherwise.

Deadlines: a request whose `timeout` has passed since its arrival is finished at the start of
the next schedule ("timeout", its output so far), running or waiting, and its blocks freed.

With speculative decoding a decoding request may also carry draft tokens (`spec_token_ids`):
it computes 1 + k tokens against the budget, and its drafts take only blocks that no request
behind it could need this step, so drafts never cause a preemption. The blocks the rejected
drafts used are released in `update`.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

from steadylm.engine.block_manager import BlockManager
from steadylm.engine.request import Request, RequestStatus
from steadylm.engine.speculative import Speculator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # with drafts: 1 + len(spec_token_ids)
    spec_token_ids: tuple[int, ...] = ()  # draft tokens scored after its last known token


@dataclass
class SchedulerOutput:
    """Everything the model runner needs to know about one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    errored: list[Request] = field(default_factory=list)
    trimmed: list[Request] = field(default_factory=list)  # gave back rejected drafts' blocks
    expired: list[Request] = field(default_factory=list)  # finished by their deadline

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0
    num_empty_steps: int = 0
    num_timeouts: int = 0


SCHEDULING_POLICIES = ("fcfs", "priority")


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_size: int,
        max_num_tokens: int,
        speculator: Speculator | None = None,
        policy: str = "fcfs",
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy {policy!r}: one of {SCHEDULING_POLICIES}")
        self.bm = block_manager
        self.speculator = speculator
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.policy = policy
        self.waiting: list[Request] = []  # in key order: the head is waiting[0]
        self.running: list[Request] = []  # in key order: the first can always grow
        self.stats = SchedulerStats()
        self._arrivals = 0
        self._deadlines = False  # some request ever came with a timeout: check each step

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        prio = request.params.priority if self.policy == "priority" else 0
        request.queue_key = (prio, self._arrivals)
        self._arrivals += 1
        self._deadlines |= request.params.timeout is not None
        _insort(self.waiting, request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self._deadlines:
            self._expire(out, time.monotonic())
        made_room = self.policy == "priority" and self._preempt_for_priority(out)
        budget = self._schedule_running(out, self.max_num_tokens)
        if len(out.preempted) == made_room:  # no preemption but those that made room
            self._admit_waiting(out, budget)
        self.stats.num_steps += 1
        self.stats.num_empty_steps += out.is_empty
        return out

    def _expire(self, out: SchedulerOutput, now: float) -> None:
        """Finish every request whose deadline has passed, with its output so far."""
        for queue in (self.running, self.waiting):
            for req in [r for r in queue if _expired(r, now)]:
                if queue is self.running:
                    self._remove(req)
                else:
                    self.waiting.remove(req)
                req.finish(RequestStatus.FINISHED_TIMEOUT)
                self.stats.num_timeouts += 1
                out.expired.append(req)

    def _preempt_for_priority(self, out: SchedulerOutput) -> int:
        """While the waiting head outranks the last running request (a strictly lower
        priority value) and cannot be admitted as things are, preempt that request. Returns
        how many were preempted."""
        n = 0
        while self.waiting and self.running:
            head, last = self.waiting[0], self.running[-1]
            if head.queue_key[0] >= last.queue_key[0]:
                break
            if len(self.running) < self.max_batch_size and self._fits(head):
                break
            self._preempt(self.running.pop(), out)
            n += 1
        return n

    def _fits(self, req: Request) -> bool:
        """Whether `req`'s first chunk could be admitted now (blocks and watermark)."""
        prefix = self.bm.find_cached_prefix(req)
        n = min(req.num_tokens - len(prefix) * self.bm.block_size, self.max_num_tokens)
        return self.bm.can_allocate(req, n, prefix, keep_watermark=bool(self.running))

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed_tokens, budget)
            while not self.bm.can_allocate(req, n) and self.running[-1] is not req:
                self._preempt(self.running.pop(), out)
            if self.bm.can_allocate(req, n):
                spec = self._drafts(req, n, budget, len(self.running) - i - 1)
                self.bm.allocate(req, n + len(spec))
                out.scheduled.append(ScheduledRequest(req, n + len(spec), spec))
                budget -= n + len(spec)
                i += 1
            elif out.scheduled:
                # Older requests scheduled this step hold the blocks; step back and retry later.
                self._preempt(self.running.pop(), out)
            else:
                self._fail_alone(req, n, out)
        return budget

    def _drafts(self, req: Request, n: int, budget: int, num_behind: int) -> tuple[int, ...]:
        """Draft tokens for a decoding request: within the step budget and its length cap,
        none under a structured-output constraint, and only if the blocks they take leave
        one free block for each running request behind it (and the watermark)."""
        if self.speculator is None or n != 1 or req.num_uncomputed_tokens != 1:
            return ()
        if req.constraint is not None:
            return ()
        limit = min(budget - 1, req.max_total_tokens - req.num_tokens - 1)
        spec = self.speculator.propose(req.request_id, req.all_token_ids, limit)
        if not spec:
            return ()
        extra = self.bm.num_blocks_to_allocate(req, 1 + len(spec)) - (
            self.bm.num_blocks_to_allocate(req, 1)
        )
        if extra and extra + 1 + num_behind + self.bm.watermark_blocks > self.bm.num_free_blocks:
            return ()
        return tuple(spec)

    def _fail_alone(self, req: Request, n: int, out: SchedulerOutput) -> None:
        # Unreachable while session_len <= capacity; kept so no state can stall the loop.
        self.running.remove(req)
        need = self.bm.num_blocks_to_allocate(req, n)
        msg = (
            f"KV cache exhausted: request {req.request_id} holds {req.num_tokens} tokens and "
            f"needs {need} more block(s), but only {self.bm.num_free_blocks} of "
            f"{self.bm.num_blocks} are free with nothing left to preempt. Lower session_len or "
            f"raise the KV cache size (gpu_memory_utilization, cache_max_entry_count)."
        )
        logger.error(msg)
        self.bm.free(req)
        req.finish(RequestStatus.FINISHED_ERROR, msg)
        out.errored.append(req)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.bm.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        victim.wait_reason = "preempted"
        _insort(self.waiting, victim)  # ahead of every later arrival of its priority
        self.stats.num_preemptions += 1
        out.preempted.append(victim)
        logger.debug("preempted %s at %d tokens", victim.request_id, victim.num_tokens)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting:
            req = self.waiting[0]
            if len(self.running) >= self.max_batch_size:
                return self._mark_waiting("max_batch_size")
            if budget <= 0:
                return self._mark_waiting("token_budget")
            prefix = self.bm.find_cached_prefix(req)
            num_cached = len(prefix) * self.bm.block_size
            n = min(req.num_tokens - num_cached, budget)
            # The watermark keeps headroom for running requests to grow; with nothing running
            # it would only block a request that fits, so it is not applied then.
            keep = bool(self.running)
            if not self.bm.can_allocate(req, n, prefix, keep_watermark=keep):
                return self._mark_waiting("no_free_blocks")
            self.waiting.pop(0)
            self.bm.allocate(req, n, prefix)
            self.bm.record_prefix_query(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.wait_reason = ""
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            _insort(self.running, req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n

    def _mark_waiting(self, reason: str) -> None:
        for req in self.waiting:
            req.wait_reason = reason

    def update(
        self, out: SchedulerOutput, sampled: dict[str, tuple[list[int], list | None]]
    ) -> list[Request]:
        """Advance progress after the model ran; return the requests that finished."""
        finished = out.errored + out.expired
        for s in out.scheduled:
            req = s.request
            tokens, logprobs = sampled.get(req.request_id, ((), None))
            for j, token in enumerate(tokens):
                req.append_output(token, None if logprobs is None else logprobs[j])
                if req.is_finished:  # a stop inside an accepted run cuts it
                    break
            if s.spec_token_ids:
                # Its last known token and the kept drafts are computed; the token sampled
                # after them is not. Drafts rejected or cut leave their slots to be rewritten.
                req.num_computed_tokens = req.num_tokens - 1
                self.speculator.record(req.request_id, len(s.spec_token_ids), len(tokens) - 1)
            else:
                req.num_computed_tokens += s.num_new_tokens
            self.bm.cache_full_blocks(req)
            if req.is_finished:
                self._remove(req)
                finished.append(req)
            elif s.spec_token_ids and self.bm.free(req, keep_tokens=req.num_tokens):
                out.trimmed.append(req)
        return finished

    def fail_one(self, request: Request, error: str) -> None:
        """One scheduled request failed on its own: finish it with the error, free its blocks."""
        request.finish(RequestStatus.FINISHED_ERROR, error)
        self._remove(request)

    def abort(
        self,
        request_id: str,
        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
        error: str | None = None,
    ) -> Request | None:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish(status, error)
                return req
        for req in self.running:
            if req.request_id == request_id:
                self._remove(req)
                req.finish(status, error)
                return req
        return None

    def _remove(self, req: Request) -> None:
        """A running request leaves for good (finished, failed or aborted)."""
        if req in self.running:
            self.running.remove(req)
        self.bm.free(req)


def _insort(queue: list[Request], req: Request) -> None:
    bisect.insort(queue, req, key=lambda r: r.queue_key)


def _expired(req: Request, now: float) -> bool:
    t = req.params.timeout
    return t is not None and now - req.arrival_time >= t
