"""OpenAI request bodies (plus LMDeploy's extras), validated by pydantic. Every limit here is a
400 with the field named, never a crash.

Strict types, as OpenAI and vLLM check them: no "5" or true for an integer, no "yes" or 1 for a
boolean, no NaN or Infinity; integers bounded to what the engine represents (int64); no string
anywhere may hold a lone UTF-16 surrogate."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from steadylm.engine.request import INT64_MAX, SEED_MAX, SEED_MIN
from steadylm.engine.structured import StructuredOutputs, from_response_format
from steadylm.tokenizer import has_surrogates

MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)


def _refuse_unsupported(body: Any) -> None:
    """Fields steadylm does not implement yet are a 400 naming them, never silently ignored."""
    checks = [
        ("functions", bool(body.functions), "functions (deprecated) are not supported; use tools"),
        (
            "function_call",
            body.function_call not in (None, "none"),
            "function calls are not supported",
        ),
        (
            "best_of",
            body.best_of not in (None, 1, body.n),
            "best_of other than n is not supported; ask for n choices",
        ),
    ]
    for name, bad, why in checks:
        if bad:
            raise ValueError(f"{name}: {why}")


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_surrogates(cls, data: Any) -> Any:
        bad = _surrogate_path(data)
        if bad is not None:
            raise ValueError(
                f"{bad or 'a string'} contains a lone UTF-16 surrogate, which is not valid "
                "Unicode text"
            )
        return data


def _surrogate_path(data: Any, path: str = "", depth: int = 0) -> str | None:
    """The path of the first string (key or value) holding a surrogate, else None."""
    if isinstance(data, str):
        return path if has_surrogates(data) else None
    if depth > 8:  # request bodies are shallow; deeper values are rejected by their types
        return None
    items = (
        data.items()
        if isinstance(data, dict)
        else enumerate(data)
        if isinstance(data, list)
        else ()
    )
    for key, value in items:
        if isinstance(key, str) and has_surrogates(key):
            return path or "a key"
        found = _surrogate_path(value, f"{path}.{key}" if path else str(key), depth + 1)
        if found is not None:
            return found
    return None


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Unknown fields are ignored, as OpenAI does.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # LMDeploy / vLLM extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    min_new_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    # vLLM's: served lower first under --scheduling-policy priority (0 otherwise)
    priority: int = Field(0, ge=-(2**63), le=INT64_MAX)
    # steadylm's deadline: seconds from arrival, then the request ends with its output so far
    # (finish_reason "timeout") and its KV is freed; the server default is --request-timeout-s
    timeout: float | None = Field(None, gt=0)

    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM's structured output: `structured_outputs` {json | regex | choice | grammar |
    # json_object}, or the older guided_* fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # the thought's budget for a thinking model (tokens between <think> and </think>)
    max_thinking_tokens: int | None = Field(None, ge=0, le=INT64_MAX)

    @model_validator(mode="after")
    def _supported(self) -> SamplingFields:
        _refuse_unsupported(self)
        self.structured()  # a malformed spec is a 400 now (an invalid grammar when compiled)
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries")
            for key, bias in self.logit_bias.items():
                if not key.isdigit() or len(key) > 19:
                    raise ValueError(f"logit_bias: {key!r} is not a token id")
                if not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias: the bias of {key} must be in [-100, 100]")
        stops = self.stop_list()
        if len(stops) > MAX_STOP or not all(stops) and isinstance(self.stop, list):
            raise ValueError(f"stop: at most {MAX_STOP} non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop: each stop string has at most {MAX_STOP_CHARS} characters")
        return self

    def structured(self) -> StructuredOutputs | None:
        """The one structured-output constraint this body asks for, or None."""
        found: list[tuple[str, StructuredOutputs]] = []
        so = from_response_format(self.response_format)
        if so is not None:
            found.append(("response_format", so))
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        for kind, value in guided.items():
            if value is not None:
                found.append((f"guided_{kind}", _structured(kind, value)))
        for key, value in (self.structured_outputs or {}).items():
            if key == "json_object":
                if value is True:
                    found.append(("structured_outputs", StructuredOutputs("json_object")))
            elif key in guided:
                if value is not None:
                    found.append(("structured_outputs", _structured(key, value)))
            else:
                raise ValueError(
                    f"structured_outputs: {key!r} is not one of json, regex, choice, grammar, "
                    "json_object"
                )
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise ValueError(f"give one structured output constraint, not several ({names})")
        return found[0][1] if found else None

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    def stop_list(self) -> list[str]:
        if self.stop is None or self.stop == "":
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    tools: Any = None  # a chat feature: refused here, never ignored
    tool_choice: Any = None

    @model_validator(mode="after")
    def _no_suffix(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError(
                "tools, tool_choice: tool calls are a chat completions feature "
                "(/v1/chat/completions)"
            )
        return self

    def num_prompts(self) -> int:
        """Prompts in the body, counted before any is tokenized."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return 1
        return len(p)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # the call a tool message answers

    def for_template(self) -> dict:
        """The message as chat templates read it: arguments as objects (Qwen's and Llama's
        templates serialise them themselves), as vLLM passes them."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _arguments(c)},
                }
                for c in self.tool_calls
            ]
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDef(StrictModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class WithTools(StrictModel):
    """OpenAI's `tools` (function definitions), which also reach the chat template."""

    tools: list[ToolDef] | None = Field(None, max_length=1024)

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class ChatCompletionRequest(WithTools, SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def tool_choice_value(self) -> Any:
        """ "none", "auto", "required" or {"type": "function", "function": {"name"}}; OpenAI's
        default: "auto" with tools, "none" without."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice

    @model_validator(mode="after")
    def _continue(self) -> ChatCompletionRequest:
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError(
                    "continue_final_message: set add_generation_prompt to false with it"
                )
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message: the last message must be the assistant's")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(WithTools):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for `prompt`; the chat template decides for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)


def _arguments(call: MessageToolCall) -> Any:
    try:
        value = json.loads(call.function.arguments)
    except (ValueError, RecursionError):
        return call.function.arguments
    return value if isinstance(value, dict) else call.function.arguments


def _structured(kind: str, value: Any) -> StructuredOutputs:
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("a choice constraint is a list of strings")
        return StructuredOutputs.choice(value)
    if kind == "json" and isinstance(value, dict):
        return StructuredOutputs.json_schema(value)
    if not isinstance(value, str):
        raise ValueError(f"a {kind} constraint is a string")
    return StructuredOutputs(kind, value)


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
