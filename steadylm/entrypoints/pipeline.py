"""`pipeline()`: LMDeploy's pipeline API on steadylm's engine. Change one import line and an
LMDeploy script keeps working."""

from __future__ import annotations

import logging
import queue
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from steadylm.api import (
    ChatTemplateConfig,
    GenerationConfig,
    PytorchEngineConfig,
    Response,
    TurbomindEngineConfig,
)
from steadylm.config import EngineConfig
from steadylm.engine.async_engine import CLOSED, AsyncEngine
from steadylm.engine.llm_engine import LLMEngine
from steadylm.engine.request import RequestOutput, RequestStatus
from steadylm.errors import RequestError
from steadylm.output import OutputProcessor, timing
from steadylm.tokenizer import PromptEncoder, load_tokenizer

logger = logging.getLogger("steadylm")

Prompt = str | list[dict] | list[int]


def pipeline(
    model_path: str,
    backend_config: PytorchEngineConfig | TurbomindEngineConfig | EngineConfig | None = None,
    chat_template_config: ChatTemplateConfig | None = None,
    log_level: str = "WARNING",
    **kwargs: Any,
) -> Pipeline:
    logging.getLogger("steadylm").setLevel(log_level.upper())
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    return Pipeline(model_path, backend_config, chat_template_config, **kwargs)


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
            error=d.error,
            num_preemptions=out.num_preemptions,
            **timing(out, len(self.proc.token_ids)),
        )

    def final(self, last: Response) -> Response:
        p = self.proc
        return Response(
            text=p.text,
            generate_token_len=len(p.token_ids),
            input_token_len=len(self.ids),
            finish_reason=last.finish_reason,
            token_ids=p.token_ids,
            logprobs=p.logprobs or None,
            index=self.index,
            error=last.error,
            ttft_s=last.ttft_s,
            tokens_per_s=last.tokens_per_s,
            num_preemptions=last.num_preemptions,
        )


@dataclass
class Session:
    """LMDeploy's chat session: the history and the last response."""

    history: list[dict] = field(default_factory=list)
    response: Response | None = None


class Pipeline:
    def __init__(
        self,
        model_path: str,
        backend_config=None,
        chat_template_config: ChatTemplateConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(f"pipeline() got unexpected arguments: {', '.join(kwargs)}")
        config = backend_config or PytorchEngineConfig()
        if not isinstance(config, EngineConfig):
            config = config.to_engine_config()
        self.tokenizer = load_tokenizer(model_path)
        template = chat_template_config.template_text() if chat_template_config else None
        self.encoder = PromptEncoder(self.tokenizer, template)
        self.engine = LLMEngine.from_pretrained(model_path, config)
        self.async_engine = AsyncEngine(self.engine)

    # ---- prompts ------------------------------------------------------------------------
    def encode(self, prompt: Prompt, do_preprocess: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if do_preprocess and self._has_template():
                return self.encoder.encode_messages([{"role": "user", "content": prompt}])
            return self.encoder.encode_text(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.encoder.encode_messages(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise RequestError(
            "a prompt is a str, a list of {role, content} messages, or a list of "
            f"token ids; got {type(prompt).__name__}",
            param="prompts",
        )

    def _has_template(self) -> bool:
        return bool(self.encoder.chat_template or getattr(self.tokenizer, "chat_template", None))

    @staticmethod
    def _as_batch(prompts: Any) -> tuple[list[Prompt], bool]:
        single = isinstance(prompts, str) or (
            isinstance(prompts, list)
            and prompts
            and (
                all(isinstance(p, dict) for p in prompts)
                or all(isinstance(p, int) for p in prompts)
            )
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
        gens = gen_config if isinstance(gen_config, list) else [gen_config] * len(prompts)
        if len(gens) != len(prompts):
            raise ValueError(f"{len(gens)} gen_configs for {len(prompts)} prompts")
        prepared = []
        for i, (p, g) in enumerate(zip(prompts, gens)):  # validate all before submitting any
            g = g or GenerationConfig()
            prepared.append(
                (
                    _Request(self, i, self.encode(p, do_preprocess), g),
                    g.to_sampling_params(self.tokenizer),
                )
            )
        submitted = []
        try:
            for req, params in prepared:
                stream = self.async_engine.add_request(req.ids, params, sink=sink)
                req.request_id = stream.request_id
                submitted.append((req, stream))
        except Exception:
            for req, _ in submitted:
                self.async_engine.abort(req.request_id)
            raise
        return submitted

    def __call__(
        self,
        prompts: Any,
        gen_config: GenerationConfig | list | None = None,
        do_preprocess: bool = True,
        use_tqdm: bool = False,
        **_: Any,
    ) -> Response | list[Response]:
        batch, single = self._as_batch(prompts)
        submitted = self._submit(batch, gen_config, do_preprocess)
        bar = _progress(len(batch)) if use_tqdm else None
        results = []
        for req, stream in submitted:
            last = None
            for out in stream:
                last = req.feed(out, self)
            results.append(req.final(last))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return results[0] if single else results

    batch_infer = __call__
    infer = __call__

    def stream_infer(
        self,
        prompts: Any,
        gen_config: GenerationConfig | list | None = None,
        do_preprocess: bool = True,
        **_: Any,
    ) -> Iterator[Response]:
        """Yield Response chunks (text deltas) as they come, each tagged with its `index`."""
        batch, _single = self._as_batch(prompts)
        sink: queue.Queue = queue.Queue()
        submitted = self._submit(batch, gen_config, do_preprocess, sink)
        by_id = {stream.request_id: req for req, stream in submitted}
        open_ids = set(by_id)
        try:
            while open_ids:
                rid, item = sink.get()
                if item is CLOSED:
                    open_ids.discard(rid)
                    continue
                yield by_id[rid].feed(item, self)
                if item.finished:
                    open_ids.discard(rid)
        finally:
            for rid in open_ids:  # the caller stopped iterating early
                self.async_engine.abort(rid)

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
        req = _Request(self, session_id, self.encode(prompt, do_preprocess), gen)
        params = gen.to_sampling_params(self.tokenizer)
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

    def chat(
        self,
        prompt: str,
        session: Session | None = None,
        gen_config: GenerationConfig | None = None,
        stream_response: bool = False,
        **_: Any,
    ) -> Session:
        session = session or Session()
        session.history.append({"role": "user", "content": prompt})
        resp = self(list(session.history), gen_config=gen_config)
        session.history.append({"role": "assistant", "content": resp.text})
        session.response = resp
        return session

    def get_ppl(self, input_ids: list[int] | list[list[int]]) -> list[float] | float:
        """Perplexity of token ids, as LMDeploy's `get_ppl` (one float per sequence)."""
        single = not (input_ids and isinstance(input_ids[0], list))
        batch = [input_ids] if single else input_ids
        with self.async_engine.paused():
            out = [self.engine.perplexity(list(ids)) for ids in batch]
        return out[0] if single else out

    def close(self) -> None:
        self.async_engine.shutdown()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="prompt")
