"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat
path: a request becomes the OpenAI chat request it means (system prompt, content blocks,
tool_use / tool_result turns, tools and tool_choice, stop_sequences, `thinking` with its
`budget_tokens` as our thinking budget), runs through the same engine path, and its answer or
stream comes back in Anthropic's shape: content blocks (`thinking`, `text`, `tool_use`),
`stop_reason`, usage, and the typed event stream (`message_start`, `content_block_start` /
`_delta` / `_stop`, `message_delta`, `message_stop`). Errors take Anthropic's error body.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from steadylm.entrypoints.server.protocol import INT64_MAX, StrictModel

# HTTP status -> Anthropic's error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message},
    }


class _Block(StrictModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")  # cache_control


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    type: Literal["image", "document"]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(b.text for b in self.content)


class ThinkingBlock(_Block):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolParam(_Block):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Block):
    # enabled: at most budget_tokens of thought; adaptive / between_tools: as the model will
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=0, le=INT64_MAX)


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Block):
    format: OutputFormat | None = None  # structured output: the answer matches the schema
    effort: str | None = None  # no effect: the thinking budget is the knob


class MessagesRequest(StrictModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")  # metadata...

    model: str
    max_tokens: int = Field(ge=1, le=INT64_MAX)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=64)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=INT64_MAX)
    tools: list[ToolParam] | None = Field(None, max_length=1024)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    # the chat route's extras (vLLM's and ours), passed through as they are
    seed: int | None = None
    ignore_eos: bool | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = None
    timeout: float | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int = Field(1, ge=1, le=INT64_MAX)  # not needed to count


PASSED = ("seed", "ignore_eos", "min_p", "repetition_penalty", "priority", "timeout")


def to_chat(body: MessagesRequest) -> dict:
    """The OpenAI chat request `body` means (validated by ChatCompletionRequest after)."""
    msgs: list[dict] = []
    if body.system:
        system = (
            body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        )
        msgs.append({"role": "system", "content": system})
    for m in body.messages:
        msgs += _turn(m)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": msgs,
        "max_tokens": body.max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,  # Anthropic's
        "stream": body.stream,
    }
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    for name in ("top_p", "top_k", *PASSED):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description is not None else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise ValueError("tool_choice: type 'tool' needs the tool's name")
        chat["tool_choice"] = {
            "auto": "auto",
            "any": "required",
            "none": "none",
            "tool": {"type": "function", "function": {"name": choice.name}},
        }[choice.type]
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if body.thinking is not None:
        if body.thinking.type == "enabled":
            if body.thinking.budget_tokens is None:
                raise ValueError("thinking: type 'enabled' needs budget_tokens")
            chat["max_thinking_tokens"] = body.thinking.budget_tokens
        elif body.thinking.type == "disabled":  # templates that can think (Qwen3's) do not
            chat["chat_template_kwargs"] = {"enable_thinking": False}
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is not None:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt.schema_},
        }
    last = body.messages[-1]
    if last.role == "assistant":  # a prefilled answer: the reply continues it
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    return chat


def _turn(m: MessageParam) -> list[dict]:
    """One Anthropic message as OpenAI messages: tool results become tool messages (before
    the user's text), an assistant's tool_use blocks its tool_calls; thoughts of earlier
    turns are dropped (as Anthropic drops them from the context)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict] = []
    texts: list[str] = []
    calls: list[dict] = []
    for b in m.content:
        if isinstance(b, ImageBlock):
            raise ValueError(f"messages: {b.type} blocks are not supported (a text-only model)")
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolResultBlock):
            if m.role != "user":
                raise ValueError("messages: tool_result blocks belong in a user message")
            text = b.text()
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": text})
        elif isinstance(b, ToolUseBlock):
            if m.role != "assistant":
                raise ValueError("messages: tool_use blocks belong in an assistant message")
            args = json.dumps(b.input, ensure_ascii=False)
            calls.append(
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": args}}
            )
    if m.role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            msg["tool_calls"] = calls
        return [*out, msg]
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _stop(reason: str | None, stop_reason: Any, stops: list[str], called: bool) -> tuple:
    """(Anthropic stop_reason, stop_sequence) of an OpenAI finish."""
    if called or reason == "tool_calls":
        return "tool_use", None
    if reason in ("length", "timeout"):  # out of tokens, or of its deadline (steadylm's)
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in stops:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def to_message(result: dict, body: MessagesRequest, cached: int) -> dict:
    """A finished chat completion as an Anthropic message."""
    choice = result["choices"][0]
    msg = choice["message"]
    content: list[dict] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        fn = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": fn["name"],
                "input": _tool_input(fn["arguments"]),
            }
        )
    stop_reason, stop_sequence = _stop(
        choice["finish_reason"],
        choice.get("stop_reason"),
        body.stop_sequences or [],
        any(b["type"] == "tool_use" for b in content),
    )
    usage = result["usage"]
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": result["model"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(usage["prompt_tokens"], usage["completion_tokens"], cached),
    }


def _usage(prompt: int, output: int, cached: int) -> dict:
    return {
        "input_tokens": prompt - cached,  # Anthropic counts cache reads apart
        "output_tokens": output,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def events(
    chunks: AsyncIterator[dict], body: MessagesRequest, model: str, prompt_tokens: int
) -> AsyncIterator[str]:
    """OpenAI chat chunks as Anthropic's typed events: one content block per thought, text
    run and tool call, in the order they appear."""
    head = {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(prompt_tokens, 0, 0),
    }
    yield _sse("message_start", {"type": "message_start", "message": head})
    index, kind = -1, None
    finish, stop_reason, output, called = None, None, 0, False

    def open_block(block: dict):
        nonlocal index, kind
        out = []
        if kind is not None:
            out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
        index, kind = index + 1, block["type"]
        out.append(
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        return out

    def delta(d: dict) -> str:
        return _sse(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}
        )

    async for chunk in chunks:
        if "error" in chunk:
            message = chunk["error"].get("message", "internal error")
            yield _sse("error", error_body(500, message))
            continue
        if not chunk.get("choices"):  # the usage chunk
            output = chunk.get("usage", {}).get("completion_tokens", output)
            continue
        choice = chunk["choices"][0]
        d = choice.get("delta") or {}
        if d.get("reasoning_content"):
            if kind != "thinking":
                for e in open_block({"type": "thinking", "thinking": "", "signature": ""}):
                    yield e
            yield delta({"type": "thinking_delta", "thinking": d["reasoning_content"]})
        if d.get("content"):
            if kind != "text":
                for e in open_block({"type": "text", "text": ""}):
                    yield e
            yield delta({"type": "text_delta", "text": d["content"]})
        for call in d.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):  # a new call
                called = True
                block = {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": fn.get("name", ""),
                    "input": {},
                }
                for e in open_block(block):
                    yield e
            if fn.get("arguments"):
                yield delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
        if choice.get("finish_reason") is not None:
            finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
    if kind is not None:
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
    reason, sequence = _stop(finish, stop_reason, body.stop_sequences or [], called)
    yield _sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": output},
        },
    )
    yield _sse("message_stop", {"type": "message_stop"})
