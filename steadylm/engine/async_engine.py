"""A background loop around `LLMEngine` for concurrent callers (the pipeline and the server).

One thread owns stepping. Callers add and abort requests under a lock (so a bad request raises
in the caller's thread at once) and read their results from a per-request stream, from threads
or from asyncio. If the loop itself dies, every open stream gets the error immediately and later
calls raise `EngineDeadError` naming the cause: no caller is left waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator

from steadylm.engine.llm_engine import LLMEngine
from steadylm.engine.request import RequestOutput, RequestStatus, SamplingParams
from steadylm.errors import EngineDeadError

logger = logging.getLogger(__name__)
CLOSED = object()  # put on a stream when the loop dies, after the error output


class RequestStream:
    """Outputs of one request, readable by a thread (`__iter__`) or by asyncio (`__aiter__`)."""

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop | None = None,
        sink: queue.Queue | None = None,
    ) -> None:
        self.request_id = request_id
        self._loop = loop
        self._sink = sink  # a queue shared by several streams gets (request_id, item) pairs
        self._sync: queue.Queue = queue.Queue()
        self._async: asyncio.Queue | None = (
            asyncio.Queue() if loop is not None and sink is None else None
        )

    def put(self, item: object) -> None:
        if self._sink is not None and self._loop is not None:  # an asyncio.Queue
            try:
                self._loop.call_soon_threadsafe(self._sink.put_nowait, (self.request_id, item))
            except RuntimeError:
                pass
        elif self._sink is not None:
            self._sink.put((self.request_id, item))
        elif self._async is not None:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed; nobody is listening
                pass
        else:
            self._sync.put(item)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._sync.get()
            if item is CLOSED:
                return
            yield item
            if item.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self._async is not None, "stream was opened without an event loop"
        while True:
            item = await self._async.get()
            if item is CLOSED:
                return
            yield item
            if item.finished:
                return


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._streams: dict[str, RequestStream] = {}
        self._pending_aborts: queue.SimpleQueue[tuple[str, RequestStatus]] = queue.SimpleQueue()
        self._stopping = False
        self.dead_error: str | None = None
        listeners = getattr(engine.executor, "on_dead", None)
        if listeners is not None:  # a tensor-parallel worker died: fail callers now
            listeners.append(self._executor_died)
        self._thread = threading.Thread(target=self._run, name="steadylm-engine", daemon=True)
        self._thread.start()

    # ---- callers ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        sink: queue.Queue | None = None,
    ) -> RequestStream:
        """Raise RequestError for a request that can never run; otherwise return its stream."""
        self._precompile([params])
        with self._wake:
            self._check_alive()
            rid = self.engine.add_request(prompt, params, request_id)
            stream = RequestStream(rid, loop, sink)
            self._streams[rid] = stream
            self._wake.notify()
        return stream

    def add_requests(
        self,
        jobs: list[tuple[str | list[int], SamplingParams]],
        loop: asyncio.AbstractEventLoop | None = None,
        sink: queue.Queue | None = None,
    ) -> list[RequestStream]:
        """Add several requests at once, between two steps (one lock acquisition, so a caller
        with many choices never waits a step per choice). All or none: if one raises, the ones
        already added are aborted before the error propagates."""
        streams: list[RequestStream] = []
        self._precompile([params for _, params in jobs])
        with self._wake:
            self._check_alive()
            try:
                for prompt, params in jobs:
                    rid = self.engine.add_request(prompt, params)
                    streams.append(RequestStream(rid, loop, sink))
                    self._streams[rid] = streams[-1]
            except BaseException:
                for stream in streams:
                    self._streams.pop(stream.request_id, None)
                    self.engine.abort(stream.request_id)
                raise
            self._wake.notify()
        return streams

    def _precompile(self, params: list[SamplingParams]) -> None:
        """Compile (and cache) structured-output grammars outside the lock, so steps go on
        meanwhile; an invalid one raises RequestError here."""
        for p in params:
            if p.structured_outputs is not None:
                self.engine.structured.compile(p.structured_outputs)

    def abort(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """End a request now: its blocks are freed before this returns."""
        with self._wake:
            out = self.engine.abort(request_id, status)
            if out is not None:
                self._deliver([out])

    def abort_nowait(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Abort without waiting for the lock (safe from an event loop or a finally block):
        the loop applies it before its next step, so the blocks are freed within one step."""
        self._pending_aborts.put((request_id, status))
        if self._lock.acquire(blocking=False):  # idle loop: apply now
            try:
                self._drain_aborts()
            finally:
                self._lock.release()

    def _drain_aborts(self) -> None:
        while True:
            try:
                rid, status = self._pending_aborts.get_nowait()
            except queue.Empty:
                return
            out = self.engine.abort(rid, status)
            if out is not None:
                self._deliver([out])

    async def generate(
        self, prompt, params: SamplingParams, request_id=None
    ) -> AsyncIterator[RequestOutput]:
        stream = self.add_request(prompt, params, request_id, asyncio.get_running_loop())
        try:
            async for out in stream:
                yield out
        finally:
            if stream.request_id in self._streams:  # the caller went away early
                self.abort_nowait(stream.request_id)

    @contextlib.contextmanager
    def paused(self) -> Iterator[LLMEngine]:
        """Hold the engine between steps (the loop steps only while holding this lock)."""
        with self._lock:
            yield self.engine

    def stats(self):
        with self._lock:
            return self.engine.stats()

    @property
    def healthy(self) -> bool:
        return self.dead_error is None and self.engine.healthy

    def shutdown(self, timeout: float | None = 30.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)
        self.engine.shutdown()

    def _executor_died(self, error: str) -> None:
        """Called from the executor's watchdog. An idle loop is woken to fail every caller; a
        loop inside a step (holding the lock) fails on its own when the step's collective
        sees the dead peer."""
        if self._lock.acquire(blocking=False):
            try:
                self._wake.notify()
            finally:
                self._lock.release()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self.dead_error}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    # ---- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    executor = self.engine.executor
                    while (
                        not self._stopping
                        and not self.engine.has_unfinished()
                        and executor.dead_error is None
                    ):
                        self._wake.wait()
                    if executor.dead_error is not None:
                        raise EngineDeadError(executor.dead_error)
                    if self._stopping:
                        self._deliver(self.engine.abort_all())
                        return
                    self._drain_aborts()
                    self._deliver(self.engine.step())
        except BaseException as exc:  # the loop itself broke: tell everyone, then stop
            self.dead_error = f"{type(exc).__name__}: {exc}"
            logger.exception("engine loop died")
            with self._lock:
                try:
                    self._deliver(self.engine.abort_all(self.dead_error))
                except Exception:  # still: every open stream ends with the error below
                    logger.exception("could not finish the requests cleanly")
                finally:
                    for rid, stream in self._streams.items():
                        stream.put(RequestOutput(rid, [], 0, 0, True, "error", self.dead_error))
                        stream.put(CLOSED)
                    self._streams.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
