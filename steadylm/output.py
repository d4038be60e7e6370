"""Per-request output processing shared by the pipeline and the server: incremental text,
stop strings, and the LMDeploy rule that a stop token is not part of the output."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from steadylm.engine.request import RequestOutput
from steadylm.tokenizer import IncrementalDetokenizer


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: str | None
    error: str | None
    stop_string_hit: bool  # the caller must end the request (engine.abort with STOPPED)


@dataclass
class OutputProcessor:
    tokenizer: Any
    prompt_ids: list[int]
    eos_token_ids: tuple[int, ...]
    stop_words: list[str] | None = None
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # keep the stop string / stop token (LMDeploy)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""

    def __post_init__(self) -> None:
        # vLLM's stop_reason: the stop string or stop token id (not EOS) that ended the output
        self.stop_reason: int | str | None = None
        self.detok = IncrementalDetokenizer(
            self.tokenizer,
            self.prompt_ids,
            self.skip_special_tokens,
            self.spaces_between_special_tokens,
            stop=self.stop_words,
            include_stop=self.include_stop_str_in_output,
        )
        self.stops = set(self.stop_token_ids) | (
            set() if self.ignore_eos else set(self.eos_token_ids)
        )

    def feed(self, out: RequestOutput) -> Delta:
        new = list(out.new_token_ids)
        stop_token = out.finished and out.finish_reason == "stop" and new and new[-1] in self.stops
        if stop_token and new[-1] in self.stop_token_ids:
            self.stop_reason = new[-1]
        if stop_token and not self.include_stop_str_in_output:
            new = new[:-1]
        already_stopped = self.detok.stopped
        text = self.detok.add(new, final=out.finished)
        if already_stopped:  # tokens that raced past a stop string are not output
            new = []
        lps = out.new_logprobs[: len(new)]
        if self.detok.stop_hit is not None:
            self.stop_reason = self.detok.stop_hit
        self.token_ids += new
        self.logprobs += lps
        self.text += text
        reason = ("stop" if self.detok.stopped else out.finish_reason) if out.finished else None
        return Delta(
            text,
            new,
            lps,
            out.finished,
            reason,
            out.error,
            self.detok.stopped and not already_stopped and not out.finished,
        )


def timing(out: RequestOutput, num_tokens: int) -> dict[str, float | None]:
    """Time to first token and decode tokens/s of a request, from its output."""
    if out.first_token_time is None:
        return {"ttft_s": None, "tokens_per_s": None}
    end = out.finish_time or time.monotonic()
    decode = end - out.first_token_time
    return {
        "ttft_s": out.first_token_time - out.arrival_time,
        "tokens_per_s": (num_tokens - 1) / decode if num_tokens > 1 and decode > 0 else None,
    }
