"""The OpenAI-compatible server: FastAPI routes over one `AsyncEngine`.

Everything a client can send maps to a 2xx or an OpenAI-style 4xx; an engine fault is a 500
(or an error event in a stream) for the requests it touched, and the server keeps serving.
A client that disconnects has its request aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from steadylm.engine.async_engine import CLOSED, AsyncEngine
from steadylm.engine.llm_engine import LLMEngine
from steadylm.engine.request import RequestStatus, SamplingParams
from steadylm.entrypoints.server.metrics import Metrics
from steadylm.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
)
from steadylm.errors import EngineDeadError, SteadyLMError
from steadylm.output import OutputProcessor, timing
from steadylm.tokenizer import PromptEncoder

logger = logging.getLogger("steadylm.server")


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


class ServerState:
    def __init__(
        self,
        engine: LLMEngine,
        tokenizer: Any,
        model_name: str,
        api_keys: list[str] | None = None,
        max_concurrent_requests: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.engine = engine
        self.async_engine = AsyncEngine(engine)
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer, chat_template)
        self.model_name = model_name
        self.api_keys = set(api_keys or [])
        self.max_concurrent = max_concurrent_requests
        self.in_flight = 0
        self.metrics = Metrics()
        self.created = int(time.time())


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="steadylm", version="0.1.0")
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(
            error_body(exc.message, exc.type, exc.param, exc.status),
            status_code=exc.status,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = err.get("msg", "invalid request")
        text = f"{param}: {msg}" if param else msg
        return JSONResponse(error_body(text, "invalid_request_error", param, 400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return JSONResponse(
            error_body(str(exc.detail), "invalid_request_error", None, exc.status_code),
            status_code=exc.status_code,
        )

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if state.api_keys and request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            key = header[7:] if header.lower().startswith("bearer ") else ""
            if key not in state.api_keys:
                return JSONResponse(
                    error_body(
                        "invalid or missing API key (Authorization: Bearer <key>)",
                        "authentication_error",
                        None,
                        401,
                    ),
                    status_code=401,
                )
        return await call_next(request)

    @app.get("/health")
    async def health():
        if state.async_engine.healthy:
            return {"status": "ok"}
        cause = state.async_engine.dead_error or state.engine.last_error
        return JSONResponse({"status": "unhealthy", "cause": cause}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        stats = await asyncio.to_thread(state.async_engine.stats)
        return Response(
            state.metrics.render(stats, state.async_engine.healthy),
            media_type="text/plain; version=0.0.4",
        )

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "steadylm",
                    "max_model_len": state.engine.session_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = _completion_prompts(state, body.prompt)
        return await _serve(state, request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = state.encoder.encode_messages(msgs, body.add_generation_prompt)
        except SteadyLMError as exc:
            raise APIError(400, exc.message, "invalid_request_error", exc.param) from None
        return await _serve(state, request, body, [ids], chat=True)

    return app


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


def _sampling(body: SamplingFields, state: ServerState, chat: bool, index: int) -> SamplingParams:
    max_new = body.max_new_tokens() if chat else body.max_tokens
    temperature = 1.0 if body.temperature is None else body.temperature
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    seed = None if body.seed is None else (body.seed + index) % (2**64)
    return SamplingParams(
        max_new_tokens=max_new or state.engine.session_len,
        temperature=temperature,
        top_p=body.top_p or 1.0,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        seed=seed,
        ignore_eos=body.ignore_eos,
        min_new_tokens=body.min_new_tokens or 0,
        logprobs=logprobs,
    )


async def _serve(state: ServerState, request: Request, body, prompts: list[list[int]], chat: bool):
    _check_model(state, body.model)
    if state.max_concurrent is not None and state.in_flight >= state.max_concurrent:
        state.metrics.rejected.inc()
        raise APIError(
            503,
            f"the server is at --max-concurrent-requests={state.max_concurrent}; retry shortly",
            "server_busy",
            None,
            headers={"Retry-After": "1"},
        )
    jobs = [(i * body.n + j, ids) for i, ids in enumerate(prompts) for j in range(body.n)]
    run = _Run(state, body, chat)
    state.in_flight += 1  # counted from admission, so a slow start cannot let more in
    try:
        await run.start(jobs)
    except BaseException:
        state.in_flight -= 1
        raise
    if body.stream:
        return StreamingResponse(_guard(run.sse(), state), media_type="text/event-stream")
    try:
        return await _until_done_or_disconnect(run, request)
    finally:
        state.in_flight -= 1


async def _guard(gen: AsyncIterator[str], state: ServerState) -> AsyncIterator[str]:
    try:
        async for item in gen:
            yield item
    finally:
        state.in_flight -= 1


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
        self.prompt_lens: dict[int, int] = {}
        self.open: set[str] = set()

    async def start(self, jobs: list[tuple[int, list[int]]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self._add_all, jobs, loop)
        except SteadyLMError as exc:
            self.abort_open()
            status = 503 if isinstance(exc, EngineDeadError) else 400
            raise APIError(
                status,
                exc.message,
                "invalid_request_error" if status == 400 else "server_error",
                exc.param,
            ) from None

    def _add_all(self, jobs, loop) -> None:
        eng = self.state.engine
        for i, ids in jobs:
            params = _sampling(self.body, self.state, self.chat, i)
            stream = self.state.async_engine.add_request(ids, params, loop=loop, sink=self.queue)
            self.index[stream.request_id] = i
            self.open.add(stream.request_id)
            self.prompt_lens[i] = len(ids)
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

    def abort_open(self) -> None:
        """The client went away (or a choice failed to start): end what is still running."""
        for rid in list(self.open):
            self.state.async_engine.abort_nowait(rid)
            self.state.metrics.requests.labels("abort").inc()
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
                d = self.procs[i].feed(item)
                if d.stop_string_hit:  # the STOPPED final output follows
                    self.state.async_engine.abort_nowait(rid, RequestStatus.FINISHED_STOPPED)
                if item.finished:
                    self.open.discard(rid)
                    n = len(self.procs[i].token_ids)
                    t = timing(item, n)
                    self.state.metrics.observe_finished(
                        d.finish_reason, self.prompt_lens[i], n, t["ttft_s"], t["tokens_per_s"]
                    )
                yield i, d
        finally:
            self.abort_open()

    def _usage(self) -> dict:
        prompt = sum(self.prompt_lens.values())
        completion = sum(len(p.token_ids) for p in self.procs.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    async def collect(self):
        errors = []
        reasons: dict[int, str | None] = {}
        lps: dict[int, list] = {i: [] for i in self.procs}
        async for i, d in self.deltas():
            lps[i] += list(zip(d.token_ids, d.logprobs))
            if d.finished:
                reasons[i] = d.finish_reason
                if d.error:
                    errors.append(d.error)
        if errors:
            raise APIError(500, errors[0], "internal_server_error")
        choices = [
            self._choice(i, self.procs[i].text, reasons.get(i), lps[i]) for i in sorted(self.procs)
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

    def _choice(self, i: int, text: str, reason: str | None, lps: list) -> dict:
        logprobs = self._logprobs(lps) if self._wants_logprobs() else None
        if self.chat:
            return {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def _wants_logprobs(self) -> bool:
        return bool(self.body.logprobs) if self.chat else self.body.logprobs is not None

    def _logprobs(self, pairs: list) -> dict:
        """pairs: (chosen token, {token: logprob}) with the chosen token and the top-k."""
        tok = self.state.tokenizer

        def top(lp: dict, n: int | None) -> list[tuple[int, float]]:
            return sorted(lp.items(), key=lambda kv: -kv[1])[: n or 0]

        if self.chat:
            content = [
                {
                    "token": tok.decode([t]),
                    "logprob": lp.get(t, 0.0),
                    "top_logprobs": [
                        {"token": tok.decode([k]), "logprob": v}
                        for k, v in top(lp, self.body.top_logprobs)
                    ],
                }
                for t, lp in pairs
            ]
            return {"content": content}
        return {
            "tokens": [tok.decode([t]) for t, _ in pairs],
            "token_logprobs": [lp.get(t, 0.0) for t, lp in pairs],
            "top_logprobs": [
                {tok.decode([k]): v for k, v in top(lp, self.body.logprobs)} for _, lp in pairs
            ],
        }

    async def sse(self) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        head = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.state.model_name,
        }
        if self.chat:
            for i in sorted(self.procs):
                yield _event(
                    {
                        **head,
                        "choices": [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
        async for i, d in self.deltas():
            if d.error:
                yield _event(error_body(d.error, "internal_server_error", None, 500))
                continue
            if not d.text and not d.finished:
                continue
            lps = (
                self._logprobs(list(zip(d.token_ids, d.logprobs)))
                if self._wants_logprobs()
                else None
            )
            if self.chat:
                choice = {
                    "index": i,
                    "delta": {"content": d.text} if d.text else {},
                    "logprobs": lps,
                    "finish_reason": d.finish_reason,
                }
            else:
                choice = {
                    "index": i,
                    "text": d.text,
                    "logprobs": lps,
                    "finish_reason": d.finish_reason,
                }
            yield _event({**head, "choices": [choice]})
        opts = self.body.stream_options
        if opts is not None and opts.include_usage:
            yield _event({**head, "choices": [], "usage": self._usage()})
        yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
