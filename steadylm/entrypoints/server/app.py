"""The OpenAI-compatible server: FastAPI routes over one `AsyncEngine`.

Everything a client can send maps to a 2xx or an OpenAI-style 4xx; an engine fault is a 500
(or an error event in a stream) for the requests it touched, and the server keeps serving.
A client that disconnects has its request aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from steadylm.engine.async_engine import CLOSED, AsyncEngine
from steadylm.engine.llm_engine import LLMEngine
from steadylm.engine.request import RequestStatus, SamplingParams
from steadylm.engine.structured import StructuredOutputs
from steadylm.entrypoints.serve_cli import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CHOICES
from steadylm.entrypoints.server import anthropic, responses
from steadylm.entrypoints.server.chat_output import ChoiceOutput
from steadylm.entrypoints.server.metrics import Metrics
from steadylm.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    error_body,
)
from steadylm.entrypoints.server.reasoning import (
    REASONING_PARSERS,
    ReasoningSplitter,
    marker_ids,
    thinking_params,
)
from steadylm.entrypoints.server.tool_parsers import TOOL_PARSERS, tool_call_schema
from steadylm.errors import ConfigError, EngineDeadError, RequestError, SteadyLMError
from steadylm.output import Delta, OutputProcessor, timing
from steadylm.tokenizer import PromptEncoder

logger = logging.getLogger("steadylm.server")
LOGPROB_CONTEXT_TOKENS = 6  # tokens before one that its text is decoded after
GRAMMAR_THREADS = 2
LOGPROBS_INLINE = 64  # longer logprob lists are formatted off the event loop
MIN_LOGPROB = -9999.0  # what a -inf logprob is reported as (JSON has no infinity), as OpenAI


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers


def check_api_keys(api_keys: list[str] | None) -> None:
    """None means no auth. An empty list or an empty key (a bare `--api-keys`, or an unset
    variable expanded into it) would silently leave every route open: refuse it."""
    if api_keys is None:
        return
    if not api_keys or any(not isinstance(k, str) or not k.strip() for k in api_keys):
        raise ConfigError(
            "--api-keys was given without a usable key (empty, or an empty string such as an "
            "unset variable): that would leave every route open. Pass one or more non-empty "
            "keys, or drop --api-keys to serve without authentication.",
            param="api_keys",
        )


class ServerState:
    def __init__(
        self,
        engine: LLMEngine,
        tokenizer: Any,
        model_name: str,
        api_keys: list[str] | None = None,
        max_concurrent_requests: int | None = None,
        chat_template: str | None = None,
        max_choices_per_request: int = DEFAULT_MAX_CHOICES,
        max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        metrics_names: str = "both",
        request_timeout_s: float | None = None,
    ) -> None:
        check_api_keys(api_keys)
        for name, value in (
            ("max_choices_per_request", max_choices_per_request),
            ("max_request_body_bytes", max_request_body_bytes),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be an int >= 1", param=name)
        self.engine = engine
        self.async_engine = AsyncEngine(engine)
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer, chat_template)
        self.model_name = model_name
        self.api_keys = set(api_keys or [])
        self.max_concurrent = max_concurrent_requests
        self.max_choices = max_choices_per_request
        self.max_body_bytes = max_request_body_bytes
        self.in_flight = 0  # choices in flight (a request of n choices counts n)
        self.metrics = Metrics(metrics_names, model_name, engine.session_len)
        if request_timeout_s is not None and not 0 < request_timeout_s < float("inf"):
            raise ConfigError(
                f"request_timeout_s={request_timeout_s!r} must be a number of seconds > 0",
                param="request_timeout_s",
            )
        self.request_timeout_s = request_timeout_s  # a request's deadline when it gives none
        self.responses = responses.ResponseStore()  # previous_response_id's conversations
        self.created = int(time.time())
        self.reasoning = None
        if reasoning_parser is not None:
            if reasoning_parser not in REASONING_PARSERS:
                raise ConfigError(
                    f"--reasoning-parser {reasoning_parser!r} is not one of "
                    f"{sorted(REASONING_PARSERS)}",
                    param="reasoning_parser",
                )
            self.reasoning = REASONING_PARSERS[reasoning_parser]
            marker_ids(tokenizer, self.reasoning)  # a model without the markers fails now
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(
                f"--tool-call-parser {tool_call_parser!r} is not one of {sorted(TOOL_PARSERS)}",
                param="tool_call_parser",
            )
        self.tool_call_parser = tool_call_parser
        # Grammar compiles get their own (daemon) threads, at most GRAMMAR_THREADS at once: a
        # schema or regex that takes long to compile (xgrammar cannot be interrupted) then
        # delays only other compiles, never tokenizing, /metrics, requests without a grammar
        # or the server's exit.
        self.grammar_slots = asyncio.Semaphore(GRAMMAR_THREADS)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="steadylm", version="0.1.0")
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.type, exc.param, request, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        err = _validation_api_error(exc.errors())
        return _error(err.status, err.message, err.type, err.param, request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error", None, request)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        """Auth, the body size limit before anything is read, and a last-resort handler: an
        unexpected error is a 500 in OpenAI's shape on a connection that stays usable."""
        if state.api_keys and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            key = header[7:] if header.lower().startswith("bearer ") else ""
            key = key or request.headers.get("x-api-key", "")  # Anthropic's clients send this
            if key not in state.api_keys:
                return _error(
                    401,
                    "invalid or missing API key (Authorization: Bearer <key>, or x-api-key)",
                    "authentication_error",
                    None,
                    request,
                )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > state.max_body_bytes:
            return _error(413, _too_large_message(state), "invalid_request_error", None, request)
        try:
            return await call_next(request)
        except Exception:
            logger.exception("unhandled error on %s %s", request.method, request.url.path)
            message = "internal server error (logged on the server)"
            return _error(500, message, "server_error", None, request)

    @app.get("/health")
    async def health():
        # The cause goes to the log and /metrics, never into an unauthenticated body.
        if state.async_engine.healthy:
            return {"status": "ok"}
        return JSONResponse({"status": "unhealthy"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        stats = await asyncio.to_thread(state.async_engine.stats)
        return Response(
            state.metrics.render(stats, state.async_engine.healthy),
            media_type="text/plain; version=0.0.4",
        )

    def model_card() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "steadylm",
            "max_model_len": state.engine.session_len,
            # steadylm's: the token ids a client may send (bench serve draws from it)
            "vocab_size": state.engine.model_config.vocab_size,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):  # the openai SDK's models.retrieve
        _check_model(state, model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse_body(request, CompletionRequest, state)
        _check_request(state, body, body.num_prompts())
        # Tokenizing is CPU work: off the event loop, so /health and streams stay responsive.
        prompts = await _encode(_completion_prompts, state, body.prompt)
        return await _serve(state, request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse_body(request, ChatCompletionRequest, state)
        _check_request(state, body, 1)
        ids = await _encode_chat(state, body)
        return await _serve(state, request, body, [ids], chat=True)

    @app.post("/v1/messages")
    async def messages(request: Request):
        """Anthropic's Messages API, run as the chat request it means (anthropic.py)."""
        msg = await _parse_body(request, anthropic.MessagesRequest, state)
        body = _chat_of(anthropic.to_chat, msg)
        _check_request(state, body, 1)
        ids = await _encode_chat(state, body)
        shape = _Shape(
            lambda run: anthropic.events(run.chunks(), msg, state.model_name, run.prompt_lens[0]),
            lambda run, result: anthropic.to_message(result, msg, run.cached.get(0, 0)),
        )
        return await _serve(state, request, body, [ids], chat=True, shape=shape)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        """OpenAI's Responses API, run as the chat request it means (responses.py)."""
        req = await _parse_body(request, responses.ResponsesRequest, state)
        history: list[dict] = []
        if req.previous_response_id is not None:
            history = state.responses.get(req.previous_response_id)
            if history is None:
                raise APIError(
                    404,
                    f"previous_response_id {req.previous_response_id!r} is not found: the server "
                    f"keeps the last {responses.MAX_STORED_RESPONSES} stored responses in memory",
                    "invalid_request_error",
                    "previous_response_id",
                )
        body = _chat_of(lambda r: responses.to_chat(r, history), req)
        _check_request(state, body, 1)
        ids = await _encode_chat(state, body)
        rid = responses._rid("resp")
        turns = [*history, *responses.input_messages(req)]

        def keep(response: dict) -> dict:
            if req.store:
                state.responses.put(rid, [*turns, *responses.answer_messages(response["output"])])
            return response

        shape = _Shape(
            lambda run: responses.events(
                run.chunks(), req, state.model_name, rid, run.prompt_lens[0], keep
            ),
            lambda run, result: keep(responses.to_response(result, req, rid, run.cached.get(0, 0))),
        )
        return await _serve(state, request, body, [ids], chat=True, shape=shape)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        msg = await _parse_body(request, anthropic.CountTokensRequest, state)
        body = _chat_of(anthropic.to_chat, msg)
        _check_model(state, body.model)
        return {"input_tokens": len(await _encode_chat(state, body))}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's /tokenize: the ids a completion or chat request would feed the model."""
        body = await _parse_body(request, TokenizeRequest, state)
        if body.model is not None:
            _check_model(state, body.model)
        if body.messages is not None:
            ids = await _encode_chat(state, body)
        else:
            ids = await _encode(state.encoder.encode_text, body.prompt, body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": state.engine.session_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _parse_body(request, DetokenizeRequest, state)
        if body.model is not None:
            _check_model(state, body.model)
        vocab = state.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400,
                f"tokens must be in [0, {vocab}); got {bad[:5]}",
                "invalid_request_error",
                "tokens",
            )
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, body.tokens)}

    return app


def _error(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    request: Request | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    """An error in OpenAI's shape, or Anthropic's on its routes (/v1/messages...)."""
    if request is not None and request.url.path.startswith("/v1/messages"):
        body = anthropic.error_body(
            status, f"{param}: {message}" if param and param not in message else message
        )
    else:
        body = error_body(message, type_, param, status)
    return JSONResponse(body, status_code=status, headers=headers)


def _too_large_message(state: ServerState) -> str:
    return f"the request body is larger than --max-request-body-bytes={state.max_body_bytes}"


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits is out of range")
    return int(text)


MAX_INT_DIGITS = 40  # 2**64 has 20 digits; longer literals are never a valid value


def _check_content_type(request: Request) -> None:
    """JSON bodies only, as FastAPI-based servers (vLLM) require; a missing header is JSON."""
    value = request.headers.get("content-type")
    if value is None:
        return
    kind = value.split(";")[0].strip().lower()
    if kind != "application/json" and not kind.endswith("+json"):
        raise APIError(
            400,
            f"Content-Type must be application/json, got {kind!r}",
            "invalid_request_error",
        )


async def _parse_body(request: Request, model: type[BaseModel], state: ServerState):
    """Read at most the body limit (also when no content-length is sent), parse JSON strictly
    (no NaN / Infinity; nesting too deep is a 400, not a RecursionError) and validate."""
    _check_content_type(request)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > state.max_body_bytes:
            raise APIError(413, _too_large_message(state), "invalid_request_error")
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks), parse_constant=_no_constants, parse_int=_bounded_int)
    except RecursionError:
        raise APIError(400, "the JSON body is nested too deeply", "invalid_request_error") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the body is not valid JSON: {exc}", "invalid_request_error") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", "invalid_request_error")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_api_error(exc.errors()) from None
    except RecursionError:
        raise APIError(400, "the JSON body is nested too deeply", "invalid_request_error") from None


def _validation_api_error(errors: list) -> APIError:
    """The most specific of pydantic's errors (the deepest: a union's matching branch says
    more than "not a string"), named by its field path without the branches' type names."""
    err = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _branch(p)]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid request")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    text = f"{param}: {msg}" if param else msg
    return APIError(400, text, "invalid_request_error", param)


def _branch(part) -> bool:
    """A union branch's name in a pydantic error location (`list[...]`, `tagged-union[...]`,
    `str`, `function-after[...]`), not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


async def _encode(fn, *args):
    try:
        return await asyncio.to_thread(fn, *args)
    except SteadyLMError as exc:
        raise APIError(400, exc.message, "invalid_request_error", exc.param) from None


async def _encode_chat(state: ServerState, body) -> list[int]:
    """The prompt ids of a body with chat `messages` (a chat request, or /tokenize's), its
    tools (if any) given to the template."""
    msgs = [m.for_template() for m in body.messages]
    return await _encode(
        state.encoder.encode_messages,
        msgs,
        body.add_generation_prompt,
        body.continue_final_message,
        body.chat_template_kwargs,
        body.tool_dicts(),
    )


def _check_request(state: ServerState, body, num_prompts: int) -> None:
    """Checks that need no tokenizing: the model name and the choices a request asks for."""
    _check_model(state, body.model)
    choices = num_prompts * body.n
    if choices > state.max_choices:
        raise APIError(
            400,
            f"this request asks for {num_prompts} prompt(s) x n={body.n} = {choices} choices; "
            f"the limit is --max-choices-per-request={state.max_choices}",
            "invalid_request_error",
            "n",
        )


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(
            404,
            f"model {name!r} does not exist; this server serves {state.model_name!r}",
            "invalid_request_error",
            "model",
        )


def _completion_prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    out = []
    for p in prompt or [""]:
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt is empty", "invalid_request_error", "prompt")
            out.append(state.encoder.encode_text(p))
        else:
            out.append(list(p))
    return out


def _constraints(body: SamplingFields, state: ServerState, chat: bool):
    """(structured output, thinking) of a request: its own constraint, or the schema that a
    forced tool choice compiles to; the thought's markers when a reasoning parser is set."""
    thinking = thinking_params(
        state.tokenizer, state.reasoning if chat else None, body.max_thinking_tokens
    )
    so = body.structured()
    choice = body.tool_choice_value() if chat else "none"
    if choice == "auto" and state.tool_call_parser is None:
        raise RequestError(
            'tool_choice "auto" (the default when tools are given) needs the server started '
            'with --tool-call-parser; or ask for tool_choice "required", a named function, '
            'or "none"',
            param="tool_choice",
        )
    if choice not in ("none", "auto"):
        if so is not None:
            raise RequestError(
                "tool_choice 'required' or a named function cannot be combined with another "
                "structured output constraint",
                param="tool_choice",
            )
        try:
            schema = tool_call_schema(body.tool_dicts(), choice, state.tool_call_parser or "hermes")
        except (ValueError, TypeError) as exc:  # tools that the choice cannot be made from
            raise RequestError(str(exc), param="tool_choice") from None
        so = StructuredOutputs("json", json.dumps(schema, ensure_ascii=False))
    return so, thinking


def _sampling(
    body: SamplingFields, state: ServerState, chat: bool, index: int, constraints=(None, None)
) -> SamplingParams:
    max_new = body.max_new_tokens() if chat else body.max_tokens
    temperature = 1.0 if body.temperature is None else body.temperature
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    seed = None if body.seed is None else (body.seed + index) % (2**64)
    max_new = max_new or state.engine.session_len
    if body.min_new_tokens is not None and body.min_new_tokens > max_new:
        raise RequestError(
            f"min_new_tokens={body.min_new_tokens} is larger than the {max_new} tokens this "
            "request may generate (max_tokens, or session_len when unset)",
            param="min_new_tokens",
        )
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=body.top_p or 1.0,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        seed=seed,
        ignore_eos=body.ignore_eos,
        min_new_tokens=body.min_new_tokens or 0,
        logprobs=logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=_logit_bias(body, state),
        prompt_logprobs=logprobs if not chat and body.echo else None,
        structured_outputs=constraints[0],
        thinking=constraints[1],
        priority=body.priority,
        timeout=body.timeout if body.timeout is not None else state.request_timeout_s,
    )


def _logit_bias(body: SamplingFields, state: ServerState) -> tuple[tuple[int, float], ...]:
    pairs = body.logit_bias_pairs()
    vocab = state.engine.model_config.vocab_size
    bad = [t for t, _ in pairs if t >= vocab]
    if bad:
        raise RequestError(
            f"logit_bias: token id {bad[0]} is not in the vocabulary (size {vocab})",
            param="logit_bias",
        )
    return pairs


@dataclasses.dataclass(frozen=True)
class _Shape:
    """Another API's answer over the chat path: `stream(run)` its SSE text, `finish(run,
    result)` its body from the finished chat completion."""

    stream: Any
    finish: Any


def _chat_of(translate, req) -> ChatCompletionRequest:
    """The chat request another API's request means (`translate(req)`), validated as one."""
    try:
        data = translate(req)
        return ChatCompletionRequest.model_validate(data)
    except ValueError as exc:  # pydantic's ValidationError is one
        errors = getattr(exc, "errors", None)
        if callable(errors):
            raise _validation_api_error(errors()) from None
        raise APIError(400, str(exc), "invalid_request_error") from None


async def _serve(
    state: ServerState,
    request: Request,
    body,
    prompts: list[list[int]],
    chat: bool,
    shape: _Shape | None = None,
):
    jobs = [(i * body.n + j, ids) for i, ids in enumerate(prompts) for j in range(body.n)]
    cost = len(jobs)  # every choice is a sequence in the engine: it counts as one in flight
    if state.max_concurrent is not None and cost > state.max_concurrent:
        raise APIError(
            400,
            f"this request has {cost} choices (prompts x n); the server runs at most "
            f"--max-concurrent-requests={state.max_concurrent} at once",
            "invalid_request_error",
            "n",
        )
    if state.max_concurrent is not None and state.in_flight + cost > state.max_concurrent:
        state.metrics.rejected.inc()
        raise APIError(
            503,
            f"the server is at --max-concurrent-requests={state.max_concurrent} (choices in "
            f"flight: {state.in_flight}, this request: {cost}); retry shortly",
            "server_busy",
            None,
            headers={"Retry-After": "1"},
        )
    run = _Run(state, body, chat)
    state.in_flight += cost  # counted from admission, so a slow start cannot let more in
    try:
        await run.start(jobs)
    except BaseException:
        state.in_flight -= cost
        raise
    if body.stream:
        stream = run.sse() if shape is None else shape.stream(run)
        return StreamingResponse(_release(stream, state, cost), media_type="text/event-stream")
    try:
        result = await _until_done_or_disconnect(run, request)
    finally:
        state.in_flight -= cost
    if shape is not None and isinstance(result, dict):
        return shape.finish(run, result)
    return result


async def _release(gen: AsyncIterator[str], state: ServerState, cost: int) -> AsyncIterator[str]:
    try:
        async for item in gen:
            yield item
    finally:
        state.in_flight -= cost


async def _until_done_or_disconnect(run: _Run, request: Request):
    work = asyncio.ensure_future(run.collect())
    gone = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if work not in done:  # the client left: abort and free its blocks now
        work.cancel()
        run.abort_open()
        return Response(status_code=499)
    gone.cancel()
    return work.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Run:
    """One HTTP request's choices in flight, merged from their engine streams."""

    def __init__(self, state: ServerState, body, chat: bool) -> None:
        self.state, self.body, self.chat = state, body, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.index: dict[str, int] = {}
        self.procs: dict[int, OutputProcessor] = {}
        self.outs: dict[int, ChoiceOutput] = {}  # chat: reasoning and tool calls per choice
        self.echo: dict[int, tuple[list[int], str]] = {}  # echo: choice -> prompt ids, text
        self.held_lps: dict[int, list] = {}  # stream: logprobs of tokens not yet sent
        prompt = getattr(body, "prompt", None)  # echo gives a text prompt back as it came
        texts = [prompt] if isinstance(prompt, str) else prompt or []
        self.prompt_texts = {k: t for k, t in enumerate(texts) if isinstance(t, str)}
        self.prompt_lens: dict[int, int] = {}
        self.cached: dict[int, int] = {}  # choice -> prompt tokens served by the prefix cache
        self.text_offset: dict[int, int] = {}  # choice -> characters of logprob tokens so far
        self.lp_history: dict[int, list[int]] = {}  # choice -> its last tokens (for their text)
        self.max_tokens: dict[int, int] = {}  # choice -> its max_new_tokens (metrics)
        self.last_token_at: dict[int, float] = {}  # choice -> when its last tokens arrived
        self.open: set[str] = set()

    async def start(self, jobs: list[tuple[int, list[int]]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            constraints = _constraints(self.body, self.state, self.chat)
            if constraints[0] is not None:
                async with self.state.grammar_slots:
                    compile_ = self.state.engine.structured.compile
                    await _in_daemon_thread(compile_, constraints[0])
            await asyncio.to_thread(self._add_all, jobs, loop, constraints)
        except SteadyLMError as exc:
            self.abort_open()
            status = 503 if isinstance(exc, EngineDeadError) else 400
            raise APIError(
                status,
                exc.message,
                "invalid_request_error" if status == 400 else "server_error",
                exc.param,
            ) from None

    def _add_all(self, jobs, loop, constraints) -> None:
        """Every choice enters the engine between two steps, all or none."""
        eng = self.state.engine
        params = [_sampling(self.body, self.state, self.chat, i, constraints) for i, _ in jobs]
        streams = self.state.async_engine.add_requests(
            [(ids, p) for (_, ids), p in zip(jobs, params)], loop=loop, sink=self.queue
        )
        for (i, ids), stream, p in zip(jobs, streams, params):
            self.index[stream.request_id] = i
            self.open.add(stream.request_id)
            self.prompt_lens[i] = len(ids)
            self.max_tokens[i] = p.max_new_tokens
            self.lp_history[i] = list(ids[-LOGPROB_CONTEXT_TOKENS:])  # the first token's context
            if not self.chat and self.body.echo:
                text = self.prompt_texts.get(i // self.body.n)
                text = text if text is not None else self.state.tokenizer.decode(ids)
                self.echo[i] = (list(ids), text)
                self.lp_history[i] = []  # the prompt's own tokens are reported first
            self.procs[i] = OutputProcessor(
                self.state.tokenizer,
                ids,
                eng.model_config.eos_token_ids,
                self.body.stop_list(),
                (),
                self.body.skip_special_tokens,
                self.body.spaces_between_special_tokens,
                self.body.ignore_eos,
            )
            if self.chat:
                self.outs[i] = self._choice_output(ids, p)

    def _choice_output(self, ids: list[int], params: SamplingParams) -> ChoiceOutput:
        state, body = self.state, self.body
        splitter = None
        if state.reasoning is not None:
            splitter = ReasoningSplitter(state.reasoning, params.thinking.open_after(ids))
        choice = body.tool_choice_value()
        parser = None
        if choice == "auto" and body.tools:
            parser = TOOL_PARSERS[state.tool_call_parser](body.tool_dicts())
        forced = choice if choice not in ("none", "auto") else None
        return ChoiceOutput(splitter, parser, forced, body.parallel_tool_calls)

    def abort_open(self) -> None:
        """The client went away (or a choice failed to start): end what is still running."""
        for rid in list(self.open):
            self.state.async_engine.abort_nowait(rid)
            self.state.metrics.aborted()
        self.open.clear()

    async def deltas(self):
        """Yield (choice index, Delta) until every choice has finished."""
        try:
            while self.open:
                rid, item = await self.queue.get()
                if rid not in self.open:
                    continue
                if item is CLOSED:
                    self.open.discard(rid)
                    continue
                i = self.index[rid]
                self._time_tokens(i, len(item.new_token_ids))
                self.cached[i] = max(self.cached.get(i, 0), item.num_cached_tokens)
                d = self.procs[i].feed(item)
                if i in self.echo:  # the prompt (and its logprobs) come first
                    d = self._echoed(i, d, item.prompt_logprobs)
                if d.stop_string_hit:  # the STOPPED final output follows
                    self.state.async_engine.abort_nowait(rid, RequestStatus.FINISHED_STOPPED)
                if item.finished:
                    self.open.discard(rid)
                    n = len(self.procs[i].token_ids)
                    t = timing(item, n)
                    times = {
                        "arrival": item.arrival_time,
                        "scheduled": item.scheduled_time,
                        "first_token": item.first_token_time,
                        "finish": item.finish_time,
                    }
                    self.state.metrics.observe_finished(
                        d.finish_reason,
                        self.prompt_lens[i],
                        n,
                        t["ttft_s"],
                        t["tokens_per_s"],
                        times,
                        self.max_tokens.get(i),
                    )
                yield i, d
        finally:
            self.abort_open()

    def _time_tokens(self, i: int, new: int) -> None:
        """Inter-token latency as vLLM counts it: one observation per step that gave a choice
        tokens after its first (a step's accepted drafts share one), timed as they reach the
        server."""
        if not new:
            return
        now = time.monotonic()
        last = self.last_token_at.get(i)
        if last is not None:
            self.state.metrics.observe_itl(now - last)
        self.last_token_at[i] = now

    def _echoed(self, i: int, d: Delta, prompt_logprobs: list | None) -> Delta:
        """The choice's first delta with the prompt before it (completions' `echo`)."""
        ids, text = self.echo.pop(i)
        lps = prompt_logprobs or [None] * len(ids)
        return dataclasses.replace(
            d,
            text=text + d.text,
            token_ids=ids + d.token_ids,
            logprobs=lps + d.logprobs,
        )

    def _usage(self) -> dict:
        prompt = sum(self.prompt_lens.values())
        completion = sum(len(p.token_ids) for p in self.procs.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # prompt tokens whose KV came from the prefix cache (OpenAI's field)
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }

    async def collect(self):
        errors = []
        reasons: dict[int, str | None] = {}
        lps: dict[int, list] = {i: [] for i in self.procs}
        texts: dict[int, str] = {i: "" for i in self.procs}  # echo puts the prompt first
        async for i, d in self.deltas():
            texts[i] += d.text
            lps[i] += list(zip(d.token_ids, d.logprobs))
            if d.finished:
                reasons[i] = d.finish_reason
                if d.error:
                    errors.append(d.error)
        if errors:
            raise APIError(500, errors[0], "internal_server_error")
        choices = [
            self._choice(i, texts[i], reasons.get(i), await self._logprobs_of(i, lps[i]))
            for i in sorted(self.procs)
        ]
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
            "usage": self._usage(),
        }

    def _choice(self, i: int, text: str, reason: str | None, logprobs: dict | None) -> dict:
        if self.chat:
            out = self.outs[i]
            return {
                "index": i,
                "message": out.message(text),
                "logprobs": logprobs,
                "finish_reason": out.finish_reason(reason),
                "stop_reason": self.procs[i].stop_reason,  # vLLM's: which stop ended it
            }
        return {
            "index": i,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": reason,
            "stop_reason": self.procs[i].stop_reason,
        }

    async def _logprobs_of(self, i: int, pairs: list) -> dict | None:
        """`_logprobs` when asked for; a long list (an echoed prompt) is decoded off the event
        loop, so other streams and /health go on meanwhile."""
        if not self._wants_logprobs():
            return None
        if len(pairs) > LOGPROBS_INLINE:
            return await asyncio.to_thread(self._logprobs, i, pairs)
        return self._logprobs(i, pairs)

    def _wants_logprobs(self) -> bool:
        return bool(self.body.logprobs) if self.chat else self.body.logprobs is not None

    def _logprobs(self, i: int, pairs: list) -> dict:
        """Choice `i`'s logprobs in OpenAI's shape. pairs: (chosen token, {token: logprob})
        with the chosen token and the top-k. A token's text is what it adds after the tokens
        before it (so SentencePiece's leading spaces stay, and the texts join to the choice's
        text); chat entries carry its UTF-8 `bytes`, completion logprobs its `text_offset`
        in the choice's text, continuing across the chunks of a stream (as vLLM does)."""
        tok = self.state.tokenizer
        history = self.lp_history.setdefault(i, [])

        def top(lp: dict, n: int | None) -> list[tuple[int, float]]:
            return sorted(lp.items(), key=lambda kv: -kv[1])[: n or 0]

        rows = []  # (chosen text, logprob, [(alternative text, logprob)])
        for t, lp in pairs:
            ctx = history[-LOGPROB_CONTEXT_TOKENS:]
            base = tok.decode(ctx)

            def text(k: int, ctx=ctx, base=base) -> str:
                return tok.decode([*ctx, k])[len(base) :]

            n = self.body.top_logprobs if self.chat else self.body.logprobs
            if lp is None:  # the first prompt token (echo): nothing before it to predict it
                rows.append((text(t), None, None))
            else:  # a token forced over a ban (a grammar wins) may be -inf: JSON has no inf
                alts = [(text(k), max(v, MIN_LOGPROB)) for k, v in top(lp, n)]
                rows.append((text(t), max(lp.get(t, 0.0), MIN_LOGPROB), alts))
            history.append(t)
        del history[:-LOGPROB_CONTEXT_TOKENS]

        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        if self.chat:
            content = [
                {**entry(t, v), "top_logprobs": [entry(k, w) for k, w in alts]}
                for t, v, alts in rows
            ]
            return {"content": content}
        offsets = []
        for t, _, _ in rows:
            offsets.append(self.text_offset.get(i, 0))
            self.text_offset[i] = offsets[-1] + len(t)
        return {
            "tokens": [t for t, _, _ in rows],
            "token_logprobs": [v for _, v, _ in rows],
            "top_logprobs": [None if alts is None else dict(alts) for _, _, alts in rows],
            "text_offset": offsets,
        }

    async def sse(self) -> AsyncIterator[str]:
        async for chunk in self.chunks():
            yield _event(chunk)
        yield "data: [DONE]\n\n"

    async def chunks(self) -> AsyncIterator[dict]:
        """The stream's chunks in OpenAI's shape (an error as an error body), before SSE
        framing: /v1/messages translates them into Anthropic's events."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        head = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.state.model_name,
        }
        if self.chat:
            for i in sorted(self.procs):
                first = {"role": "assistant", "content": ""}
                choice = {"index": i, "delta": first, "logprobs": None, "finish_reason": None}
                yield {**head, "choices": [choice]}
        async for i, d in self.deltas():
            if d.error:
                yield error_body(d.error, "internal_server_error", None, 500)
                continue
            pieces = self.outs[i].feed(d.text, final=d.finished) if self.chat else []
            # tokens whose text is held back keep their logprobs for the next chunk sent
            held = self.held_lps.setdefault(i, [])
            held += zip(d.token_ids, d.logprobs)
            if not (pieces if self.chat else d.text) and not d.finished:
                continue
            lps = await self._logprobs_of(i, held)
            held.clear()
            if self.chat:
                pieces = pieces or [{}]
                for k, piece in enumerate(pieces):
                    last = k == len(pieces) - 1
                    reason = self.outs[i].finish_reason(d.finish_reason) if last else None
                    choice = {
                        "index": i,
                        "delta": piece,
                        "logprobs": lps if k == 0 else None,
                        "finish_reason": reason,
                    }
                    if reason is not None:
                        choice["stop_reason"] = self.procs[i].stop_reason
                    yield {**head, "choices": [choice]}
                continue
            choice = {
                "index": i,
                "text": d.text,
                "logprobs": lps,
                "finish_reason": d.finish_reason,
            }
            if d.finished:
                choice["stop_reason"] = self.procs[i].stop_reason
            yield {**head, "choices": [choice]}
        opts = self.body.stream_options
        if opts is not None and opts.include_usage:
            yield {**head, "choices": [], "usage": self._usage()}


async def _in_daemon_thread(fn, *args):
    """fn(*args) in a daemon thread, awaited: a call that never returns cannot hold up the
    process's exit (asyncio.to_thread's pool threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():  # the awaiting request may have gone
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed meanwhile (the server stopped)
            pass

    threading.Thread(target=work, name="steadylm-grammar", daemon=True).start()
    return await future


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
