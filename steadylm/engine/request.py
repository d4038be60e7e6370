"""A request is plain data: its tokens, one progress counter and an ordered status."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from steadylm.engine.structured import RequestConstraint, StructuredOutputs, ThinkingParams
from steadylm.errors import RequestError

INT64_MAX = 2**63 - 1  # every count and id becomes an int64 tensor element somewhere
INT64_MIN = -(2**63)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 1024  # top logprobs per token (the server allows 20, as OpenAI does)
GREEDY_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)


class RequestStatus(enum.IntEnum):
    """Ordered: everything above PREEMPTED is finished, so `is_finished` is one comparison."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    FINISHED_TIMEOUT = 7  # its deadline (SamplingParams.timeout) passed: partial output

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
}


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature == 0 means greedy."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    bad_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI / vLLM: subtracted once from each generated token
    frequency_penalty: float = 0.0  # ... and this times its count in the output so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    structured_outputs: StructuredOutputs | None = None  # what the answer must match
    thinking: ThinkingParams | None = None  # a reasoning model's thought markers and budget
    prompt_logprobs: int | None = None  # top logprobs per prompt token (None: not computed)
    # vLLM's: with scheduling_policy="priority", lower values are served first (FCFS within
    # a value), and a waiting request may preempt running ones of a larger value
    priority: int = 0
    # seconds from arrival: then the request ends with its output so far, finish reason
    # "timeout", and its KV blocks are freed (None: no deadline)
    timeout: float | None = None

    def __post_init__(self) -> None:
        """Every field is checked against what the engine can represent, so no value reaches
        a tensor constructor or a kernel it would break (one request must never fail a step)."""
        _require_int(self.max_new_tokens, "max_new_tokens", 1, INT64_MAX)
        _require_float(self.temperature, "temperature", 0, None, "(0 means greedy)")
        _require_int(self.top_k, "top_k", 0, INT64_MAX, "(0 disables it)")
        _require(
            _finite(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"top_p={self.top_p!r} must be in (0, 1]",
        )
        _require_float(self.min_p, "min_p", 0, 1)
        _require(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            f"repetition_penalty={self.repetition_penalty!r} must be > 0 (1 disables it)",
        )
        if self.seed is not None:
            _require_int(self.seed, "seed", SEED_MIN, SEED_MAX)
        _require_int(self.min_new_tokens, "min_new_tokens", 0, INT64_MAX)
        if self.logprobs is not None:
            _require_int(self.logprobs, "logprobs", 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _require_int(self.prompt_logprobs, "prompt_logprobs", 0, MAX_LOGPROBS)
        _require_float(self.presence_penalty, "presence_penalty", -2, 2)
        _require_float(self.frequency_penalty, "frequency_penalty", -2, 2)
        _require_int(self.priority, "priority", INT64_MIN, INT64_MAX)
        if self.timeout is not None:
            _require(
                _finite(self.timeout) and self.timeout > 0,
                "timeout",
                f"timeout={self.timeout!r} must be a finite number of seconds > 0",
            )
        _require(
            all(
                _is_int(t) and 0 <= t <= INT64_MAX and _finite(b) and -100 <= b <= 100
                for t, b in self.logit_bias
            ),
            "logit_bias",
            "logit_bias maps token ids to biases in [-100, 100]",
        )
        for name, kind in (("structured_outputs", StructuredOutputs), ("thinking", ThinkingParams)):
            value = getattr(self, name)
            _require(
                value is None or isinstance(value, kind),
                name,
                f"{name} must be a {kind.__name__} or None",
            )
        for name in ("stop_token_ids", "bad_token_ids"):
            ids = getattr(self, name)
            _require(
                all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids),
                name,
                f"{name} must hold non-negative token ids, got {list(ids)[:8]!r}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _require_int(x: object, param: str, lo: int, hi: int, note: str = "") -> None:
    _require(
        _is_int(x) and lo <= x <= hi,
        param,
        f"{param}={x!r} must be an int in [{lo}, {hi}] {note}".rstrip(),
    )


def _require_float(x: object, param: str, lo: float, hi: float | None, note: str = "") -> None:
    ok = _finite(x) and lo <= x and (hi is None or x <= hi)
    bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
    _require(ok, param, f"{param}={x!r} must be a finite number {bound} {note}".rstrip())


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise RequestError(message, param=param)


@dataclass
class Request:
    """One generation. `num_computed_tokens` is the only progress counter: tokens whose K/V are
    in the cache. A request samples a new token in a step that computes its last known token."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_total_tokens: int = 0  # prompt + output cap: min(prompt + max_new_tokens, session_len)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    wait_reason: str = "queued"
    error: str | None = None
    scheduled_time: float | None = None  # first admitted to the running batch
    queue_key: tuple[int, int] = (0, 0)  # the scheduler's order: (priority, arrival number)
    first_token_time: float | None = None
    finish_time: float | None = None
    constraint: RequestConstraint | None = None  # its grammar matcher and thought (structured)
    # with params.prompt_logprobs: entry j is {prompt[j]: logprob, top...} (entry 0 is None)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __post_init__(self) -> None:
        if not self.max_total_tokens:
            self.max_total_tokens = len(self.prompt_token_ids) + self.params.max_new_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence (the
        per-step paths call this; `all_token_ids` copies everything)."""
        p = self.prompt_token_ids
        if end <= len(p):
            return p[start:end]
        if start >= len(p):
            return self.output_token_ids[start - len(p) : end - len(p)]
        return p[start:] + self.output_token_ids[: end - len(p)]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_output(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        """The one place output tokens change; it also decides stop and length."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        if self.constraint is not None:
            if not self.constraint.accept(token_id):
                self.finish(RequestStatus.FINISHED_ERROR, self.constraint.error)
                return
            if self.constraint.completed:  # its stop token: done, whatever min_new_tokens says
                self.finish(RequestStatus.FINISHED_STOPPED)
                return
        n = self.num_output_tokens
        stops = self.params.stop_token_ids + (() if self.params.ignore_eos else self.eos_token_ids)
        if n >= self.params.min_new_tokens and token_id in stops:
            self.finish(RequestStatus.FINISHED_STOPPED)
        elif self.num_tokens >= self.max_total_tokens:
            self.finish(RequestStatus.FINISHED_LENGTH)

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        assert status.is_finished, status
        if self.is_finished:
            return
        self.status = status
        self.error = error
        self.finish_time = time.monotonic()


@dataclass(frozen=True)
class RequestOutput:
    """What the engine reports for one request after a step: the new tokens since the last
    report, and the finish state once it is done."""

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # in the first output only
