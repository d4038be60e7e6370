"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: `input` (a string or
items: messages, function_call, function_call_output), `instructions`, `max_output_tokens`,
`text.format` (json_schema / json_object: structured output), function `tools` and
`tool_choice`, `previous_response_id` against a bounded in-memory store; the answer as output
items (`reasoning`, `message` with `output_text`, `function_call`) and, streamed, the API's
typed events (`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import ConfigDict, Field

from steadylm.entrypoints.server.protocol import INT64_MAX, StrictModel

MAX_STORED_RESPONSES = 1024  # previous_response_id reaches this many recent responses


class _Open(StrictModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class ContentPart(_Open):
    type: Literal["input_text", "output_text", "text", "input_image", "input_file", "refusal"]
    text: str | None = None


class InputItem(_Open):
    """A message, or a function call / its output, as Responses clients send them."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class FunctionTool(_Open):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Open):
    format: TextFormat | None = None


class ResponsesRequest(_Open):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = Field(None, max_length=1024)
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=256)
    metadata: dict[str, Any] | None = None
    # the chat route's extras, passed through
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool | None = None
    priority: int | None = None
    timeout: float | None = None
    max_thinking_tokens: int | None = None


PASSED = ("temperature", "top_p", "seed", "top_k", "min_p", "ignore_eos", "priority", "timeout")
PASSED += ("max_thinking_tokens",)


class ResponseStore:
    """The conversations of recent responses (chat messages in, the answer out), for
    `previous_response_id`: at most MAX_STORED_RESPONSES, the oldest dropped first."""

    def __init__(self, limit: int = MAX_STORED_RESPONSES) -> None:
        self.limit, self.items = limit, OrderedDict()

    def get(self, response_id: str) -> list[dict] | None:
        return self.items.get(response_id)

    def put(self, response_id: str, messages: list[dict]) -> None:
        self.items[response_id] = messages
        while len(self.items) > self.limit:
            self.items.popitem(last=False)


def _text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type in ("input_image", "input_file"):
            raise ValueError(f"input: {part.type} parts are not supported (a text-only model)")
    return "".join(p.text or "" for p in content)


def input_messages(body: ResponsesRequest) -> list[dict]:
    """This request's own turns as chat messages (instructions first)."""
    msgs: list[dict] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*msgs, {"role": "user", "content": body.input}]
    for item in body.input:
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise ValueError("input: a message item needs a role")
            role = "system" if item.role == "developer" else item.role
            msgs.append({"role": role, "content": _text(item.content)})
        elif kind == "function_call":
            if not (item.call_id and item.name):
                raise ValueError("input: a function_call item needs call_id and name")
            call = {"name": item.name, "arguments": item.arguments or "{}"}
            tool_call = {"id": item.call_id, "type": "function", "function": call}
            if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1].get("content"):
                msgs[-1].setdefault("tool_calls", []).append(tool_call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            if not item.call_id:
                raise ValueError("input: a function_call_output item needs call_id")
            msgs.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            )
        # reasoning items of earlier turns are dropped from the context
    return msgs


def to_chat(body: ResponsesRequest, history: list[dict]) -> dict:
    """The chat request `body` means, after `history` (previous_response_id's turns)."""
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": [*history, *input_messages(body)],
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    for name in PASSED:
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": t.model_dump(
                    include={"name", "description", "parameters", "strict"}, exclude_none=True
                ),
            }
            for t in body.tools
        ]
    if body.tool_choice is not None:
        choice = body.tool_choice
        if isinstance(choice, NamedTool):
            choice = {"type": "function", "function": {"name": choice.name}}
        chat["tool_choice"] = choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ValueError("text.format: a json_schema format needs its schema")
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.name or "output",
                "schema": fmt.schema_,
                "strict": fmt.strict,
            },
        }
    return chat


def _rid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _message_item(text: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": _rid("msg"),
        "status": "completed",
        "role": "assistant",
        "content": [part],
    }


def _reasoning_item(text: str) -> dict:
    return {
        "type": "reasoning",
        "id": _rid("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(call_id: str, name: str, arguments: str) -> dict:
    return {
        "type": "function_call",
        "id": _rid("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _response(
    rid: str, body: ResponsesRequest, model: str, output: list, status: str, usage: dict | None
) -> dict:
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "usage": usage,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tool_choice": body.tool_choice.model_dump()
        if isinstance(body.tool_choice, NamedTool)
        else body.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "text": {"format": {"type": "text"}}
        if body.text is None
        else body.text.model_dump(by_alias=True, exclude_none=True),
        "metadata": body.metadata or {},
        "store": body.store,
    }


def _usage(prompt: int, output: int, cached: int) -> dict:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def _status(reason: str | None) -> str:
    return "incomplete" if reason in ("length", "timeout") else "completed"


def answer_messages(output: list[dict]) -> list[dict]:
    """The answer's output items as the chat messages the next turn's history holds."""
    text = "".join(
        p["text"] for item in output if item["type"] == "message" for p in item["content"]
    )
    calls = [
        {
            "id": i["call_id"],
            "type": "function",
            "function": {"name": i["name"], "arguments": i["arguments"]},
        }
        for i in output
        if i["type"] == "function_call"
    ]
    msg: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def to_response(result: dict, body: ResponsesRequest, rid: str, cached: int) -> dict:
    """A finished chat completion as a Response object."""
    choice = result["choices"][0]
    msg = choice["message"]
    output: list[dict] = []
    if msg.get("reasoning_content"):
        output.append(_reasoning_item(msg["reasoning_content"]))
    if msg.get("content"):
        output.append(_message_item(msg["content"]))
    for call in msg.get("tool_calls") or []:
        output.append(
            _call_item(call["id"], call["function"]["name"], call["function"]["arguments"])
        )
    u = result["usage"]
    usage = _usage(u["prompt_tokens"], u["completion_tokens"], cached)
    return _response(rid, body, result["model"], output, _status(choice["finish_reason"]), usage)


def _sse(seq: list[int], data: dict) -> str:
    data["sequence_number"] = seq[0]
    seq[0] += 1
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def events(
    chunks: AsyncIterator[dict], body: ResponsesRequest, model: str, rid: str, prompt: int, done
) -> AsyncIterator[str]:
    """OpenAI chat chunks as the Responses API's event stream; `done(response)` is called
    with the final response (the store)."""
    seq = [0]
    head = _response(rid, body, model, [], "in_progress", None)
    yield _sse(seq, {"type": "response.created", "response": head})
    yield _sse(seq, {"type": "response.in_progress", "response": head})
    output: list[dict] = []
    current: dict | None = None  # the open item
    reason, completion = None, 0

    def close():
        item = current
        out = []
        idx = len(output) - 1
        if item["type"] == "message":
            part = item["content"][0]
            base = {"item_id": item["id"], "output_index": idx, "content_index": 0}
            out.append(
                _sse(
                    seq,
                    {
                        "type": "response.output_text.done",
                        **base,
                        "text": part["text"],
                        "logprobs": [],
                    },
                )
            )
            out.append(_sse(seq, {"type": "response.content_part.done", **base, "part": part}))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            base = {"item_id": item["id"], "output_index": idx, "content_index": 0}
            out.append(_sse(seq, {"type": "response.reasoning_text.done", **base, "text": text}))
        else:
            out.append(
                _sse(
                    seq,
                    {
                        "type": "response.function_call_arguments.done",
                        "item_id": item["id"],
                        "output_index": idx,
                        "name": item["name"],
                        "arguments": item["arguments"],
                    },
                )
            )
        out.append(
            _sse(seq, {"type": "response.output_item.done", "output_index": idx, "item": item})
        )
        return out

    def open_item(item: dict):
        nonlocal current
        out = close() if current is not None else []
        added = json.loads(json.dumps(item))  # as it starts: empty
        if item["type"] == "message":
            added["status"] = "in_progress"
            added["content"] = []
        output.append(item)
        current = item
        idx = len(output) - 1
        out.append(
            _sse(seq, {"type": "response.output_item.added", "output_index": idx, "item": added})
        )
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            base = {"item_id": item["id"], "output_index": idx, "content_index": 0}
            out.append(_sse(seq, {"type": "response.content_part.added", **base, "part": part}))
        return out

    async for chunk in chunks:
        if "error" in chunk:
            yield _sse(
                seq,
                {
                    "type": "error",
                    "code": "server_error",
                    "message": chunk["error"].get("message", ""),
                    "param": None,
                },
            )
            continue
        if not chunk.get("choices"):
            completion = chunk.get("usage", {}).get("completion_tokens", completion)
            continue
        choice = chunk["choices"][0]
        d = choice.get("delta") or {}
        idx = len(output) - 1
        if d.get("reasoning_content"):
            if current is None or current["type"] != "reasoning":
                for e in open_item(_reasoning_item("")):
                    yield e
            current["content"][0]["text"] += d["reasoning_content"]
            base = {"item_id": current["id"], "output_index": len(output) - 1, "content_index": 0}
            yield _sse(
                seq,
                {"type": "response.reasoning_text.delta", **base, "delta": d["reasoning_content"]},
            )
        if d.get("content"):
            if current is None or current["type"] != "message":
                for e in open_item(_message_item("")):
                    yield e
            current["content"][0]["text"] += d["content"]
            base = {"item_id": current["id"], "output_index": len(output) - 1, "content_index": 0}
            yield _sse(
                seq,
                {
                    "type": "response.output_text.delta",
                    **base,
                    "delta": d["content"],
                    "logprobs": [],
                },
            )
        for call in d.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                for e in open_item(_call_item(call["id"], fn.get("name", ""), "")):
                    yield e
            if fn.get("arguments") and current is not None and current["type"] == "function_call":
                current["arguments"] += fn["arguments"]
                idx = len(output) - 1
                yield _sse(
                    seq,
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": current["id"],
                        "output_index": idx,
                        "delta": fn["arguments"],
                    },
                )
        if choice.get("finish_reason") is not None:
            reason = choice["finish_reason"]
    if current is not None:
        for e in close():
            yield e
    final = _response(rid, body, model, output, _status(reason), _usage(prompt, completion, 0))
    done(final)
    # response.completed even when the status says incomplete, as vLLM sends it: the openai
    # SDK's stream helper finishes on that event only
    yield _sse(seq, {"type": "response.completed", "response": final})
