"""One chat choice's text as OpenAI sends it: the thought split into `reasoning_content`, then
tool calls read out of the answer. Streaming and non-streaming share one path: the final
message is the merge of the deltas a stream would have sent, so the two can never differ."""

from __future__ import annotations

from typing import Any

from steadylm.entrypoints.server.reasoning import ReasoningSplitter
from steadylm.entrypoints.server.tool_parsers import ToolParser, call_deltas, parse_forced


class ChoiceOutput:
    """`splitter`: the reasoning parser's (None: no thought). `tool_parser`: reads calls out of
    the answer (tool_choice "auto"). `forced`: tool_choice "required" or a named function,
    whose output a grammar made a JSON call list or object: sent whole once it is complete."""

    def __init__(
        self,
        splitter: ReasoningSplitter | None = None,
        tool_parser: ToolParser | None = None,
        forced: Any = None,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.splitter = splitter
        self.tool_parser = tool_parser
        self.forced = forced
        self.parallel = parallel_tool_calls
        self.forced_text = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """The next piece of the choice's text -> the deltas to send now."""
        reasoning, content = self.splitter.feed(text, final) if self.splitter else ("", text)
        out: list[dict] = [{"reasoning_content": reasoning}] if reasoning else []
        if self.forced is not None:
            self.forced_text += content
            if final:
                out += self._forced_calls()
        elif self.tool_parser is not None:
            out += self.tool_parser.feed(content)
            if final:
                out += self.tool_parser.finish()
        elif content:
            out.append({"content": content})
        return [d for d in out if self._keep(d)]

    def _forced_calls(self) -> list[dict]:
        calls = parse_forced(self.forced_text, self.forced)
        if not calls:  # cut short (max_tokens): what was written is the content
            return [{"content": self.forced_text}] if self.forced_text else []
        return [d for i, call in enumerate(calls) for d in call_deltas(i, call)]

    def _keep(self, delta: dict) -> bool:
        """Count calls; with parallel_tool_calls false, only the first call is kept."""
        calls = delta.get("tool_calls")
        if not calls:
            return True
        index = calls[0]["index"]
        if not self.parallel and index > 0:
            return False
        self.num_calls = max(self.num_calls, index + 1)
        return True

    def finish_reason(self, reason: str | None) -> str | None:
        """ "tool_calls" when the model chose to call (auto, required); a named function was
        the caller's choice, so it stays "stop" (as OpenAI and vLLM report it)."""
        named = isinstance(self.forced, dict)
        return "tool_calls" if self.num_calls and reason == "stop" and not named else reason

    def message(self, text: str) -> dict:
        """The whole choice's message (non-streaming)."""
        return merge_deltas(self.feed(text, final=True), self.splitter is not None)


def merge_deltas(deltas: list[dict], reasoning: bool) -> dict:
    """Stream deltas -> the assistant message they add up to."""
    content: list[str] = []
    thought: list[str] = []
    calls: dict[int, dict] = {}
    for d in deltas:
        content.append(d.get("content", ""))
        thought.append(d.get("reasoning_content", ""))
        for c in d.get("tool_calls", ()):
            call = calls.setdefault(
                c["index"], {"id": None, "type": "function", "function": {"name": None}}
            )
            if "id" in c:
                call["id"] = c["id"]
            fn = c.get("function", {})
            if "name" in fn:
                call["function"]["name"] = fn["name"]
            args = call["function"].get("arguments", "") + fn.get("arguments", "")
            call["function"]["arguments"] = args
    text = "".join(content)
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = "".join(thought) or None
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message
