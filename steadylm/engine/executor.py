"""Executors: where the model runners live and how each step's contract reaches them.

`InProcessExecutor` (tp=1) calls the one runner directly. `TPExecutor` runs rank 0's runner in
this process and tp - 1 workers elsewhere: worker processes it spawns on this machine, or the
other ranks of a `torchrun` launch (`steadylm.engine.worker`). Each call is broadcast to the
workers on a gloo control group as (method, args); every rank runs the same runner method on its
shard, the model's collectives join them, and rank 0 gathers the logits and samples.

Faults. A worker that raises reports its error and exits; one that dies closes its sockets. The
collective rank 0 is in then fails at once (gloo reports the closed peer; a hung peer hits the
group timeout), the executor marks itself dead, stops the other workers, and every later call
raises `EngineDeadError` naming the worker and its cause. A watchdog thread notices a spawned
worker's death between steps too, and calls `on_dead` so the serving loop can fail its callers
and turn unhealthy without waiting for the next step. A fault on rank 0 inside the forward is
fatal for the same reason (the workers wait in a collective it will never join); a fault after
the forward (in the sampler) is an ordinary step fault, retried request by request.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from steadylm import parallel
from steadylm.config import EngineConfig, ModelConfig
from steadylm.engine.model_runner import ModelRunner, Sampled
from steadylm.engine.step import StepContract
from steadylm.errors import ConfigError, EngineDeadError, ModelLoadError
from steadylm.memory import MemoryPlan

logger = logging.getLogger(__name__)


class Executor:
    """Runs the runner methods the engine calls; `runner` is rank 0's, in this process."""

    runner: ModelRunner
    dead_error: str | None = None

    def execute(self, contract: StepContract) -> Sampled:
        return self._call("execute", contract)

    def apply(self, contract: StepContract) -> None:
        self._call("apply", contract)

    def run(self, scheduled: list[tuple[str, int]]) -> Sampled:
        return self._call("run", scheduled)

    def all_logits(self, request_id: str, num_new_tokens: int):
        return self._call("all_logits", request_id, num_new_tokens)

    @property
    def model_seconds(self) -> float:
        return self.runner.model_seconds

    def _call(self, method: str, *args):
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class InProcessExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def _call(self, method: str, *args):
        return getattr(self.runner, method)(*args)


class TPExecutor(Executor):
    """Rank 0 of a tensor-parallel group, in this process."""

    def __init__(
        self,
        model_dir: str,
        model_config: ModelConfig,
        config: EngineConfig,
        plan: MemoryPlan,
        torchrun: bool = False,
    ) -> None:
        from steadylm.engine import worker

        self.tp = config.tp
        self.procs: list[subprocess.Popen] = []
        self.on_dead: list[Callable[[str], None]] = []
        self._closing = False  # workers being stopped: their deaths are expected
        self._shut = False
        self._lock = threading.Lock()  # one call on the group at a time
        self._die_lock = threading.Lock()
        threads = worker.threads_per_rank(self.tp)
        self._tmp = None
        if torchrun:
            world = int(os.environ["WORLD_SIZE"])
            if world != self.tp or int(os.environ["RANK"]) != 0:
                raise ConfigError(
                    f"under torchrun, tp={self.tp} must equal WORLD_SIZE={world} (one rank per "
                    "process) and this must be rank 0",
                    param="tp",
                )
            init_method = "env://"
        else:
            # Workers are fresh interpreters (`python -m steadylm.engine.worker`), not
            # multiprocessing children: a user's script needs no `if __name__ == "__main__"`.
            self._tmp = tempfile.TemporaryDirectory(prefix="steadylm-tp-")
            init_method = f"file://{self._tmp.name}/store"
            for rank in range(1, self.tp):
                cmd = [
                    sys.executable,
                    "-m",
                    "steadylm.engine.worker",
                    f"--rank={rank}",
                    f"--world-size={self.tp}",
                    f"--init-method={init_method}",
                    f"--threads={threads}",
                    f"--error-file={self._error_file(rank)}",
                ]
                self.procs.append(subprocess.Popen(cmd))
        try:
            self.runner = worker.start_rank0(
                model_dir, model_config, config, plan, init_method, threads
            )
        except BaseException as exc:
            cause = self._root_cause() or f"{type(exc).__name__}: {exc}"
            self._stop_workers()
            parallel.shutdown()
            if isinstance(exc, ModelLoadError) or "worker" in cause:
                raise ModelLoadError(f"tensor-parallel startup failed: {cause}") from None
            raise
        atexit.register(self.shutdown)  # a script that never closes its pipeline
        for rank, p in enumerate(self.procs, start=1):
            threading.Thread(
                target=self._watch, args=(p,), name=f"steadylm-tp{rank}-watchdog", daemon=True
            ).start()

    # ---- calls --------------------------------------------------------------------------
    def _call(self, method: str, *args):
        with self._lock:
            if self.dead_error is not None:
                raise EngineDeadError(self.dead_error)
            try:
                parallel.broadcast_message((method, _for_workers(args)))
            except Exception as exc:
                raise self._die(f"{type(exc).__name__}: {exc}") from None
            try:
                return getattr(self.runner, method)(*args)
            except Exception as exc:
                if not self.runner.in_collectives:  # after the forward: the group is in step
                    raise
                self.runner.in_collectives = False
                raise self._die(f"{type(exc).__name__}: {exc}") from None

    def _die(self, cause: str) -> EngineDeadError:
        """Mark the group dead (a worker's own report wins over rank 0's view of it), stop the
        workers, tell the listeners; return the error to raise."""
        with self._die_lock:
            if self.dead_error is not None:
                return EngineDeadError(self.dead_error)
            # A dying worker may not be reaped yet when rank 0's collective fails.
            deadline = time.monotonic() + 1.0
            while all(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.02)
            worker_cause = self._root_cause()
            self.dead_error = "tensor-parallel group failed: " + (worker_cause or cause)
            parallel.abort(self.dead_error)  # a step waiting in shared memory stops waiting
            logger.error("%s", self.dead_error)
            self._stop_workers()
            for listener in list(self.on_dead):
                try:
                    listener(self.dead_error)
                except Exception:
                    logger.exception("on_dead listener failed")
        return EngineDeadError(self.dead_error)

    def _error_file(self, rank: int) -> str:
        return os.path.join(self._tmp.name, f"error-{rank}.txt")

    def _root_cause(self) -> str | None:
        """Which worker failed first. A worker killed by a signal is a root cause (workers
        that fail on their own exit with code 1 after writing their error); among written
        errors the earliest is, since the others are its peers losing their connection."""
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None and code < 0:
                name = signal.Signals(-code).name
                return f"worker rank {rank} (pid {p.pid}) was killed by {name}"
        written = []
        for rank, p in enumerate(self.procs, start=1):
            path = self._error_file(rank)
            try:
                with open(path) as f:
                    written.append((os.stat(path).st_mtime_ns, rank, p.pid, f.read().strip()))
            except OSError:
                continue
        if written:
            _, rank, pid, text = min(written)
            return f"worker rank {rank} (pid {pid}): {text}"
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                return f"worker rank {rank} (pid {p.pid}) exited with code {p.poll()}"
        return None

    def _watch(self, proc: subprocess.Popen) -> None:
        """Notice a worker's death between steps, not only at rank 0's next collective."""
        proc.wait()
        if self._closing or self.dead_error is not None:
            return
        cause = self._root_cause() or "a worker exited"
        # Not under self._lock: a step may be blocked on the dead peer right now; it fails on
        # its own (gloo sees the closed socket) and finds dead_error already set.
        self._die(cause)

    # ---- shutdown -----------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._shut:
            return
        self._shut = True
        stopping, self._closing = self._closing, True  # from here, worker exits are expected
        if self.dead_error is None and not stopping:
            try:
                with self._lock:
                    parallel.broadcast_message(("shutdown", ()))
            except Exception:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._stop_workers()
        parallel.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _stop_workers(self) -> None:
        self._closing = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                logger.error("tensor-parallel worker pid %d did not exit after SIGKILL", p.pid)


def _for_workers(args: tuple) -> tuple:
    """A call's arguments as the other ranks need them: only rank 0 samples, so a contract's
    token bitmask and its new requests' structured-output specs (up to 1 MiB each) stay here."""
    out = []
    for a in args:
        if isinstance(a, StepContract):
            new = [
                dataclasses.replace(
                    r, params=dataclasses.replace(r.params, structured_outputs=None)
                )
                if r.params.structured_outputs is not None
                else r
                for r in a.new
            ]
            a = dataclasses.replace(a, token_bitmask={}, new=new)
        out.append(a)
    return tuple(out)
