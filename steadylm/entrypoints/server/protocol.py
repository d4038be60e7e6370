"""OpenAI request bodies (plus LMDeploy's extras), validated by pydantic. Every limit here is a
400 with the field named, never a crash.

Strict types, as OpenAI and vLLM check them: no "5" or true for an integer, no "yes" or 1 for a
boolean, no NaN or Infinity; integers bounded to what the engine represents (int64); no string
anywhere may hold a lone UTF-16 surrogate."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from steadylm.engine.request import INT64_MAX, SEED_MAX, SEED_MIN
from steadylm.tokenizer import has_surrogates

MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)


def _refuse_unsupported(body: Any) -> None:
    """Fields steadylm does not implement yet are a 400 naming them, never silently ignored."""
    checks = [
        (
            "response_format",
            body.response_format not in (None, {"type": "text"}),
            "structured output (response_format) is not supported yet",
        ),
        ("tools", bool(body.tools), "tool calls are not supported yet"),
        (
            "tool_choice",
            body.tool_choice not in (None, "none", "auto")
            or (body.tool_choice == "auto" and bool(body.tools)),
            "tool calls are not supported yet",
        ),
        ("functions", bool(body.functions), "function calls are not supported"),
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

    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _supported(self) -> SamplingFields:
        _refuse_unsupported(self)
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

    @model_validator(mode="after")
    def _no_echo(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported yet")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
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


class ChatMessage(StrictModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

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


class TokenizeRequest(StrictModel):
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


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
