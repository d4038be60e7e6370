"""Reasoning parsers: a thinking model's `<think>...</think>` kept apart from its answer, as
`message.reasoning_content` and streamed `delta.reasoning_content` (vLLM's and LMDeploy's
`--reasoning-parser`).

The engine tracks the thought by token (`ThinkingParams`: structured output applies to the
answer only, and `max_thinking_tokens` forces the end marker); the server splits the text.
Both start from the same rule: the request is in a thought when the prompt's last marker opens
one (DeepSeek-R1's template ends with `<think>\\n`, so its output holds only `</think>`), when
the parser thinks by default and the prompt has no marker, or when the output opens with
`<think>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from steadylm.engine.structured import ThinkingParams
from steadylm.errors import ConfigError, RequestError


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    think_by_default: bool  # no marker in the prompt: is the output a thought until </think>?
    start: str = "<think>"
    end: str = "</think>"


# deepseek-r1: all output before </think> is the thought (R1 may or may not write <think>).
# qwen3: a thought only when <think> opens it (enable_thinking=False puts an empty one in the
# prompt, and the output is all answer).
REASONING_PARSERS = {
    "deepseek-r1": ReasoningParser("deepseek-r1", think_by_default=True),
    "deepseek_r1": ReasoningParser("deepseek-r1", think_by_default=True),
    "qwen3": ReasoningParser("qwen3", think_by_default=False),
}


def marker_ids(tokenizer: Any, parser: ReasoningParser) -> tuple[int, int]:
    """The single token ids of the parser's markers; a tokenizer without them is refused."""
    ids = []
    for marker in (parser.start, parser.end):
        enc = tokenizer.encode(marker, add_special_tokens=False)
        if len(enc) != 1:
            raise ConfigError(
                f"--reasoning-parser {parser.name}: {marker!r} is not one token in this model's "
                f"tokenizer ({len(enc)} tokens); the model does not use these thought markers",
                param="reasoning_parser",
            )
        ids += enc
    return ids[0], ids[1]


def thinking_params(
    tokenizer: Any, parser: ReasoningParser | None, max_thinking_tokens: int | None
) -> ThinkingParams | None:
    """The engine's view of a request's thought. Without a parser, `max_thinking_tokens` uses
    the tokenizer's own `<think>` / `</think>` (a thought only where the prompt or the first
    output token opens one)."""
    if parser is None:
        if max_thinking_tokens is None:
            return None
        if tokenizer is None:
            raise RequestError(
                "max_thinking_tokens needs the model's tokenizer", param="max_thinking_tokens"
            )
        try:
            start, end = marker_ids(tokenizer, ReasoningParser("auto", False))
        except ConfigError:
            raise RequestError(
                "max_thinking_tokens needs a thinking model: this tokenizer has no single "
                "<think> and </think> tokens",
                param="max_thinking_tokens",
            ) from None
        return ThinkingParams(start, end, False, max_thinking_tokens)
    start, end = marker_ids(tokenizer, parser)
    return ThinkingParams(start, end, parser.think_by_default, max_thinking_tokens)


class ReasoningSplitter:
    """One choice's text, fed piece by piece, split into (reasoning, content) pieces. Text that
    may be the start of a marker is held back until the next piece decides it."""

    def __init__(self, parser: ReasoningParser, in_thought: bool) -> None:
        self.parser = parser
        self.in_thought = in_thought
        self.pending = ""
        self.at_start = True  # nothing emitted yet

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.at_start:  # an opening <think> (after whitespace) is a marker here only
                opening = self._opening(final)
                if opening == "wait":
                    break
                self.at_start = False
                if opening == "open":
                    self.in_thought = True
                    continue
            if not self.in_thought:
                content.append(self.pending)
                self.pending = ""
                break
            i = self.pending.find(self.parser.end)
            if i >= 0:
                reasoning.append(self.pending[:i])
                self.pending = self.pending[i + len(self.parser.end) :]
                self.in_thought = False
                continue
            keep = 0 if final else _partial_suffix(self.pending, self.parser.end)
            reasoning.append(self.pending[: len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep :]
            break
        return "".join(reasoning), "".join(content)

    def _opening(self, final: bool) -> str:
        """ "open" (the pending text starts with <think>, now dropped), "wait" (it may), "no"."""
        head = self.pending.lstrip()
        if head.startswith(self.parser.start):
            self.pending = head[len(self.parser.start) :]
            return "open"
        if not final and (not head or self.parser.start.startswith(head)):
            return "wait"
        return "no"

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def split_reasoning(parser: ReasoningParser, in_thought: bool, text: str) -> tuple[str, str]:
    """A whole output split at once (the same rules as streaming)."""
    s = ReasoningSplitter(parser, in_thought)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2
