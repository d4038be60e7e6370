"""One tensor-parallel rank: join the group, load this rank's shard, allocate its KV cache,
then (workers) run every call rank 0 broadcasts until told to stop.

Startup is the same for spawned workers and `torchrun` ranks: rank 0 broadcasts the model
directory, the engine config and its memory plan (so every rank allocates exactly the plan's
blocks), each rank loads only its shard, and all ranks exchange a report (weight and KV bytes,
or the error that stopped them) before the first step.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from steadylm import parallel, platform
from steadylm.config import EngineConfig, ModelConfig
from steadylm.engine.model_runner import ModelRunner
from steadylm.errors import ModelLoadError
from steadylm.memory import MemoryPlan

logger = logging.getLogger("steadylm")


@dataclass(frozen=True)
class RankReport:
    rank: int
    pid: int
    weight_bytes: int = 0
    kv_cache_bytes: int = 0
    error: str | None = None


def threads_per_rank(tp: int) -> int:
    """CPU threads for each rank: the machine's cores shared by its ranks."""
    return max(1, (os.cpu_count() or 1) // parallel.local_ranks(tp))


def _same_host(tp: int) -> bool:
    """Every rank on this machine (spawned workers, or a one-node torchrun)."""
    return parallel.local_ranks(tp) == tp


def _device(config: EngineConfig, rank: int) -> torch.device:
    device = platform.resolve_device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return device


def _build(model_dir: str, mc: ModelConfig, config: EngineConfig, plan: MemoryPlan, rank: int):
    """Load this rank's shard and its KV cache; return (runner, report)."""
    from steadylm.loader import load_model, model_weight_bytes

    device = _device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = platform.resolve_dtype(config.dtype, mc, device)
    model = load_model(model_dir, mc, dtype, device)
    runner = ModelRunner.create(model, config, plan, device, dtype)
    kv = runner.kv_cache.num_bytes
    return runner, RankReport(rank, os.getpid(), model_weight_bytes(model), kv)


def _exchange(report: RankReport) -> list[RankReport]:
    reports: list = [None] * parallel.world_size()
    torch.distributed.all_gather_object(reports, report, group=parallel.control_group())
    return reports


def start_rank0(
    model_dir: str,
    mc: ModelConfig,
    config: EngineConfig,
    plan: MemoryPlan,
    init_method: str,
    threads: int,
) -> ModelRunner:
    """Rank 0 (in the engine's process): start the group, send the setup, build its shard,
    and check every rank's report."""
    device = _device(config, 0)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    parallel.init_tensor_parallel(0, config.tp, init_method)
    parallel.broadcast_message((model_dir, mc, config, plan))
    parallel.init_data_group(device, config.dist_timeout_s, _same_host(config.tp))
    try:
        runner, mine = _build(model_dir, mc, config, plan, 0)
    except Exception as exc:
        _exchange(RankReport(0, os.getpid(), error=f"{type(exc).__name__}: {exc}"))
        raise
    reports = _exchange(mine)
    failed = [r for r in reports if r.error]
    if failed:
        raise ModelLoadError("; ".join(f"rank {r.rank} (pid {r.pid}): {r.error}" for r in failed))
    runner.rank_reports = reports
    for r in reports:
        logger.info(
            "tp rank %d (pid %d): weights %d bytes, KV cache %d bytes",
            r.rank,
            r.pid,
            r.weight_bytes,
            r.kv_cache_bytes,
        )
    return runner


def serve(rank: int, world: int, init_method: str, error_file: str | None, threads: int) -> None:
    """A worker's whole life: setup, then the step loop. Any exception is written to
    `error_file` (rank 0 names it in its error) and to stderr, and ends the process, which
    closes its sockets so rank 0's pending collective fails at once instead of waiting."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rank} %(message)s")
    try:
        torch.set_num_threads(threads)
        parallel.init_tensor_parallel(rank, world, init_method)
        model_dir, mc, config, plan = parallel.broadcast_message()
        parallel.init_data_group(_device(config, rank), config.dist_timeout_s, _same_host(world))
        try:
            runner, report = _build(model_dir, mc, config, plan, rank)
        except Exception as exc:
            _exchange(RankReport(rank, os.getpid(), error=f"{type(exc).__name__}: {exc}"))
            return
        _exchange(report)
        _loop(runner)
    except BaseException as exc:
        traceback.print_exc()
        if error_file:
            try:
                with open(error_file, "w") as f:
                    f.write(f"{type(exc).__name__}: {exc}")
            except OSError:
                pass
        sys.stderr.flush()
        os._exit(1)
    parallel.shutdown()


def _exit_with_parent() -> None:
    """End this worker when the process that started it is gone (before the group exists,
    nothing else would tell it)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _loop(runner: ModelRunner) -> None:
    while True:
        method, args = parallel.broadcast_message()
        if method == "shutdown":
            return
        getattr(runner, method)(*args)


def serve_torchrun() -> int:
    """A torchrun rank other than 0: a worker of rank 0's engine (RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT come from torchrun)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    serve(rank, world, "env://", None, threads_per_rank(world))
    return 0


def main(argv: list[str] | None = None) -> None:
    """`python -m steadylm.engine.worker`: a worker rank the executor started on this machine."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--error-file")
    args = p.parse_args(argv)
    _exit_with_parent()
    serve(args.rank, args.world_size, args.init_method, args.error_file, args.threads)


if __name__ == "__main__":
    # Run from the imported module, not `__main__`: what a worker pickles (its report) must
    # name steadylm.engine.worker's classes.
    from steadylm.engine import worker

    worker.main()
