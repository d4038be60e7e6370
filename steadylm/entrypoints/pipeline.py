"""`pipeline()`: LMDeploy's pipeline API on steadylm's engine. Change one import line and an
LMDeploy script keeps working."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
from collections.abc import AsyncIterator, Iterator
from typing import Any

from steadylm.api import (
    ChatTemplateConfig,
    GenerationConfig,
    PytorchEngineConfig,
    Response,
    TurbomindEngineConfig,
)
from steadylm.api import speculative_config as api_speculative
from steadylm.config import EngineConfig
from steadylm.engine.async_engine import CLOSED, AsyncEngine
from steadylm.engine.llm_engine import LLMEngine
from steadylm.engine.request import RequestOutput, RequestStatus
from steadylm.errors import ConfigError, RequestError, SteadyLMError
from steadylm.output import OutputProcessor, timing
from steadylm.tokenizer import PromptEncoder, load_tokenizer

logger = logging.getLogger("steadylm")

Prompt = str | list[dict] | list[int]


def pipeline(
    model_path: str,
    backend_config: PytorchEngineConfig | TurbomindEngineConfig | EngineConfig | None = None,
    chat_template_config: ChatTemplateConfig | None = None,
    log_level: str = "WARNING",
    max_log_len: int | None = None,
    trust_remote_code: bool = False,
    speculative_config: Any = None,
    allowed_media_domains: list[str] | None = None,
    **kwargs: Any,
) -> Pipeline:
    """LMDeploy's `pipeline()`, with its arguments. `max_log_len`, `trust_remote_code` and
    `allowed_media_domains` are accepted with no effect (said at INFO); `speculative_config`
    (LMDeploy's `SpeculativeConfig`, method "ngram" or "suffix") turns on speculative
    decoding."""
    logging.getLogger("steadylm").setLevel(log_level.upper())
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    return Pipeline(
        model_path,
        backend_config,
        chat_template_config,
        log_level=log_level,
        max_log_len=max_log_len,
        trust_remote_code=trust_remote_code,
        speculative_config=speculative_config,
        allowed_media_domains=allowed_media_domains,
        **kwargs,
    )


_NO_EFFECT_ARGS = {
    "max_log_len": "steadylm does not log prompts",
    "trust_remote_code": "steadylm runs no code from model directories (configs, tokenizers "
    "and templates load without it)",
    "allowed_media_domains": "steadylm serves text-only models and fetches nothing",
}


class _Request:
    """One prompt in flight: turns engine outputs into Response chunks."""

    def __init__(self, pipe: Pipeline, index: int, ids: list[int], gen: GenerationConfig):
        self.index, self.ids, self.gen = index, ids, gen
        self.proc = OutputProcessor(
            pipe.tokenizer,
            ids,
            pipe.engine.model_config.eos_token_ids,
            gen.stop_words,
            tuple(gen.stop_token_ids or ()),
            gen.skip_special_tokens,
            gen.spaces_between_special_tokens,
            gen.ignore_eos,
            include_stop_str_in_output=gen.include_stop_str_in_output,
        )
        self.request_id = ""

    def feed(self, out: RequestOutput, pipe: Pipeline) -> Response:
        d = self.proc.feed(out)
        if d.stop_string_hit:
            pipe.async_engine.abort(self.request_id, RequestStatus.FINISHED_STOPPED)
        return Response(
            text=d.text,
            generate_token_len=len(self.proc.token_ids),
            input_token_len=len(self.ids),
            finish_reason=d.finish_reason,
            token_ids=d.token_ids,
            logprobs=d.logprobs or None,
            index=self.index,
            cached_tokens=out.num_cached_tokens,
            error_code="internal_error" if d.error else None,
            error_message=d.error,
            num_preemptions=out.num_preemptions,
            **timing(out, len(self.proc.token_ids)),
        )

    def final(self, last: Response) -> Response:
        p = self.proc
        return dataclasses.replace(
            last, text=p.text, token_ids=list(p.token_ids), logprobs=list(p.logprobs) or None
        )


def _error_response(index: int, exc: SteadyLMError, input_len: int = 0) -> Response:
    """A prompt that cannot run gets its own error Response (LMDeploy's shape); the others
    in the batch run."""
    long = "longer than" in exc.message or "more than the whole KV" in exc.message
    return Response(
        text="",
        generate_token_len=0,
        input_token_len=input_len,
        finish_reason="error",
        index=index,
        error_code="context_length_exceeded" if long else "invalid_request",
        error_message=exc.message,
    )


class Session:
    """LMDeploy's chat session: an id, the history as (prompt, reply) pairs, the last prompt
    and response."""

    def __init__(self, session_id: int) -> None:
        self.session_id = session_id
        self.prompt: Any = None
        self.response: Response | None = None
        self.history: list[tuple[Any, str]] = []
        self.gen_config: GenerationConfig | None = None

    def update(self, **kwargs: Any) -> None:
        self.prompt = kwargs.get("prompt", self.prompt)
        self.response = kwargs.get("response", self.response)
        self.gen_config = kwargs.get("gen_config", self.gen_config)

    def reset(self) -> None:
        self.prompt, self.response, self.history, self.gen_config = None, None, [], None

    def __repr__(self) -> str:
        return (
            f"Session(session_id={self.session_id}, history_len={len(self.history)}, "
            f"has_response={self.response is not None}, "
            f"has_gen_config={self.gen_config is not None})"
        )


def history_to_messages(history: list[tuple[Any, str]], prompt: Any) -> list[dict]:
    """LMDeploy's history layout, (user prompt, assistant text) pairs, as chat messages."""

    def user(p: Any) -> list[dict]:
        if isinstance(p, str):
            return [{"role": "user", "content": p}]
        return list(p)  # already messages

    messages: list[dict] = []
    for prompt_i, reply in history:
        messages += user(prompt_i) + [{"role": "assistant", "content": reply}]
    return messages + user(prompt)


class Pipeline:
    def __init__(
        self,
        model_path: str,
        backend_config=None,
        chat_template_config: ChatTemplateConfig | None = None,
        log_level: str = "WARNING",
        max_log_len: int | None = None,
        trust_remote_code: bool = False,
        speculative_config: Any = None,
        allowed_media_domains: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.pop("vision_config", None) is not None:
            logger.info(
                "pipeline(vision_config=...) has no effect: steadylm serves text-only models"
            )
        if kwargs:
            raise ConfigError(
                f"pipeline() does not take {', '.join(sorted(kwargs))}: steadylm accepts "
                "LMDeploy's pipeline arguments (backend_config, chat_template_config, "
                "log_level, max_log_len, trust_remote_code, speculative_config, "
                "allowed_media_domains)",
                param=sorted(kwargs)[0],
            )
        given = dict(
            max_log_len=max_log_len,
            trust_remote_code=trust_remote_code,
            allowed_media_domains=allowed_media_domains,
        )
        for name, value in given.items():
            if value not in (None, False):
                logger.info("pipeline(%s=%r) has no effect: %s", name, value, _NO_EFFECT_ARGS[name])
        config = backend_config or PytorchEngineConfig()
        if not isinstance(config, EngineConfig):
            config = config.to_engine_config()
        if speculative_config is not None:
            config = config.replace(speculative_config=api_speculative(speculative_config))
        from steadylm.config import ModelConfig

        ModelConfig.from_path(model_path)  # a missing path fails here, before anything loads
        self.tokenizer = load_tokenizer(model_path)
        tc = chat_template_config
        formatter = tc.formatter() if tc else None
        self.encoder = PromptEncoder(
            self.tokenizer,
            tc.template_text() if tc else None,
            formatter=formatter,
            meta_instruction=tc.meta_instruction if tc and tc.uses_tokenizer_template() else None,
        )
        # A built-in template's stop words end every templated generation, as in LMDeploy.
        self.template_stop_words = list(tc.pieces()["stop_words"] or []) if formatter else []
        self.engine = LLMEngine.from_pretrained(model_path, config, self.tokenizer)
        self.async_engine = AsyncEngine(self.engine)
        self.backend_config = backend_config
        self._session_ids = itertools.count()

    # ---- prompts ------------------------------------------------------------------------
    def encode(self, prompt: Prompt, do_preprocess: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if do_preprocess and self._has_template():
                return self.encoder.encode_messages([{"role": "user", "content": prompt}])
            return self.encoder.encode_text(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.encoder.encode_messages(prompt)
        if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
            return list(prompt)
        raise RequestError(
            "a prompt is a str, a list of {role, content} messages, or a list of "
            f"token ids; got {type(prompt).__name__}",
            param="prompts",
        )

    def _has_template(self) -> bool:
        return bool(
            self.encoder.chat_template
            or self.encoder.formatter
            or getattr(self.tokenizer, "chat_template", None)
        )

    @staticmethod
    def _as_batch(prompts: Any) -> tuple[list[Prompt], bool]:
        single = isinstance(prompts, str) or (
            isinstance(prompts, list)
            and prompts
            and (all(isinstance(p, dict) for p in prompts) or all(_is_token(p) for p in prompts))
        )
        return ([prompts], True) if single else (list(prompts), False)

    # ---- submission ---------------------------------------------------------------------
    def _submit(
        self,
        prompts: list[Prompt],
        gen_config,
        do_preprocess: bool,
        sink: queue.Queue | None = None,
    ) -> list[tuple[_Request, Any]]:
        """Submit every prompt that can run; one that cannot (too long, not encodable) gets
        an error Response in place of its stream, and the others run, as in LMDeploy."""
        gens = gen_config if isinstance(gen_config, list) else [gen_config] * len(prompts)
        if len(gens) != len(prompts):
            raise ValueError(
                f"input gen_config length differs from the length of prompts: {len(gens)} "
                f"gen_configs for {len(prompts)} prompts"
            )
        submitted: list[tuple[_Request, Any]] = []
        for i, (p, g) in enumerate(zip(prompts, gens)):
            g = g or GenerationConfig()
            if self.template_stop_words and do_preprocess and not isinstance(p[0], int):
                extra = [w for w in self.template_stop_words if w not in (g.stop_words or [])]
                g = dataclasses.replace(g, stop_words=(g.stop_words or []) + extra)
            ids: list[int] = []
            try:
                ids = self.encode(p, do_preprocess)
                room = max(1, self.engine.session_len - len(ids))
                params = g.to_sampling_params(self.tokenizer, max_new_tokens=room)
                req = _Request(self, i, ids, g)
                stream = self.async_engine.add_request(ids, params, sink=sink)
            except RequestError as exc:
                submitted.append((None, _error_response(i, exc, len(ids))))
                continue
            req.request_id = stream.request_id
            submitted.append((req, stream))
        return submitted

    def infer(
        self,
        prompts: Any,
        gen_config: GenerationConfig | list | None = None,
        do_preprocess: bool = True,
        adapter_name: str | None = None,
        use_tqdm: bool = False,
        **kwargs: Any,
    ) -> Response | list[Response]:
        """LMDeploy's `infer` (also `__call__`, `batch_infer`): one Response per prompt."""
        _no_adapter(adapter_name)
        batch, single = self._as_batch(prompts)
        submitted = self._submit(batch, gen_config, do_preprocess)
        bar = _progress(len(batch)) if use_tqdm else None
        results = []
        for req, stream in submitted:
            if req is None:  # an error Response in place of a stream
                results.append(stream)
            else:
                last = None
                for out in stream:
                    last = req.feed(out, self)
                results.append(req.final(last))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return results[0] if single else results

    def __call__(self, prompts: Any, gen_config=None, **kwargs: Any):
        return self.infer(prompts, gen_config=gen_config, **kwargs)

    batch_infer = infer

    def stream_infer(
        self,
        prompts: Any,
        sessions: Session | list[Session] | None = None,
        gen_config: GenerationConfig | list | None = None,
        do_preprocess: bool = True,
        adapter_name: str | None = None,
        stream_response: bool = True,
        **kwargs: Any,
    ) -> Iterator[Response]:
        """LMDeploy's `stream_infer(prompts, sessions, gen_config, ...)`: Response chunks
        (text deltas) as they come, each tagged with its `index`; with stream_response=False,
        one final Response per prompt."""
        _no_adapter(adapter_name)
        if _looks_like_gen_config(sessions):  # steadylm's older (prompts, gen_config) order
            gen_config, sessions = sessions, None
        batch, _single = self._as_batch(prompts)
        session_list = _sessions_for(sessions, len(batch))
        sink: queue.Queue = queue.Queue()
        submitted = self._submit(batch, gen_config, do_preprocess, sink)
        by_id = {s.request_id: r for r, s in submitted if r is not None}
        finals: dict[int, Response] = {}
        open_ids = set(by_id)
        try:
            for req, resp in submitted:
                if req is None:
                    self._close_session(session_list, resp.index, resp)
                    yield resp
            while open_ids:
                rid, item = sink.get()
                if item is CLOSED:
                    open_ids.discard(rid)
                    continue
                req = by_id[rid]
                chunk = req.feed(item, self)
                acc = finals.get(req.index)  # a copy: the chunks yielded stay as they were
                finals[req.index] = dataclasses.replace(chunk) if acc is None else acc.extend(chunk)
                if stream_response:
                    yield chunk
                if item.finished:
                    open_ids.discard(rid)
                    self._close_session(session_list, req.index, finals[req.index])
                    if not stream_response:
                        yield req.final(finals[req.index])
        finally:
            for rid in open_ids:  # the caller stopped iterating early
                self.async_engine.abort(rid)

    @staticmethod
    def _close_session(sessions: list[Session] | None, index: int, resp: Response) -> None:
        if sessions is not None:
            sessions[index].update(response=resp)

    async def generate(
        self,
        prompt: Prompt,
        session_id: int = 0,
        gen_config: GenerationConfig | None = None,
        stream_response: bool = True,
        do_preprocess: bool = True,
        **_: Any,
    ) -> AsyncIterator[Response]:
        gen = gen_config or GenerationConfig()
        ids = self.encode(prompt, do_preprocess)
        req = _Request(self, session_id, ids, gen)
        room = max(1, self.engine.session_len - len(ids))
        params = gen.to_sampling_params(self.tokenizer, max_new_tokens=room)
        last = None
        agen = self.async_engine.generate(req.ids, params)
        async for out in agen:
            if not req.request_id:
                req.request_id = out.request_id
            last = req.feed(out, self)
            if stream_response:
                yield last
        if not stream_response and last is not None:
            yield req.final(last)

    def session(self) -> Session:
        """A new chat session (LMDeploy's `pipe.session()`)."""
        return Session(next(self._session_ids))

    def chat(
        self,
        prompt: Any,
        session: Session | None = None,
        gen_config: GenerationConfig | None = None,
        stream_response: bool = False,
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> Session | Iterator[Response]:
        """LMDeploy's `chat`: the session's history as (prompt, reply) pairs; returns the
        session, or with stream_response=True an iterator of Response chunks that updates the
        session when it ends."""
        _no_adapter(adapter_name)
        session = session if session is not None else self.session()
        session.update(prompt=prompt, response=None, gen_config=gen_config)
        messages = history_to_messages(session.history, prompt)
        chunks = self.stream_infer([messages], session, gen_config, stream_response=True)

        def run() -> Iterator[Response]:
            resp = None
            for out in chunks:
                resp = dataclasses.replace(out) if resp is None else resp.extend(out)
                yield out
            session.response = resp
            session.history.append((prompt, resp.text if resp is not None else ""))

        if stream_response:
            return run()
        for _ in run():
            pass
        return session

    def get_ppl(self, input_ids: list[int] | list[list[int]]) -> list[float]:
        """Perplexity of token ids, one float per sequence, always a list (as LMDeploy)."""
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids must be a non-empty list", param="input_ids")
        batch = [input_ids] if _is_token(input_ids[0]) else input_ids
        if any(len(ids) < 2 for ids in batch):
            raise RequestError("each sequence needs at least 2 tokens", param="input_ids")
        with self.async_engine.paused():
            return [self.engine.perplexity(list(ids)) for ids in batch]

    def close(self) -> None:
        self.async_engine.shutdown()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_adapter(name: str | None) -> None:
    if name is not None:
        raise ConfigError(
            f"adapter_name={name!r}: LoRA adapters are not supported", param="adapter_name"
        )


def _looks_like_gen_config(x: Any) -> bool:
    return isinstance(x, GenerationConfig) or (
        isinstance(x, list) and bool(x) and all(isinstance(g, GenerationConfig) for g in x)
    )


def _sessions_for(sessions: Any, n: int) -> list[Session] | None:
    if sessions is None:
        return None
    sessions = sessions if isinstance(sessions, list) else [sessions]
    if len(sessions) != n:
        raise ValueError(
            f"prompts and sessions should have the same length: {n} prompts and "
            f"{len(sessions)} sessions"
        )
    return sessions


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="prompt")
