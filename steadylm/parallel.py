"""Tensor-parallel process state and the collectives the model uses.

One process per rank. `init_tensor_parallel` joins a torch.distributed group (gloo on CPU,
NCCL on CUDA) with a timeout on every collective, plus a gloo control group on which rank 0
broadcasts each step's contract to the workers (its timeout is long: a worker waits there while
the engine is idle). At tp=1 nothing is initialised and every collective is the identity.

Layers ask `rank()` and `world_size()` while they are built (to size their shards) and call
`all_reduce` / `gather_to_first` in their forward. Time spent inside each kind of collective is
summed (`comm_seconds`; benchmarks read it).
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

CONTROL_TIMEOUT = datetime.timedelta(days=365)  # a worker waits here while the engine idles


@dataclass
class _State:
    rank: int = 0
    world_size: int = 1
    group: object = None  # the data group (all-reduce, gather); None at tp=1
    control: object = None  # the gloo group for control messages
    comm_seconds: dict = field(default_factory=dict)  # collective name -> seconds inside it


_state = _State()


def under_torchrun() -> bool:
    """Launched by torchrun (or any launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_rank() -> int | None:
    return int(os.environ["RANK"]) if under_torchrun() else None


def local_ranks(tp: int) -> int:
    """Ranks of a tp group sharing this machine: torchrun's LOCAL_WORLD_SIZE, else all."""
    return min(tp, int(os.environ.get("LOCAL_WORLD_SIZE", tp)))


def rank() -> int:
    return _state.rank


def world_size() -> int:
    return _state.world_size


def comm_seconds() -> dict[str, float]:
    """Seconds this process has spent inside each kind of collective so far."""
    return dict(_state.comm_seconds)


def init_tensor_parallel(rank_: int, world: int, init_method: str) -> None:
    """Join the tp group (gloo) and its control group. `init_method` is a torch.distributed
    URL: file:// for workers spawned on this machine, env:// under torchrun."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, rank=rank_, world_size=world)
    _state.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _state.rank, _state.world_size = rank_, world


def init_data_group(device: torch.device, timeout_s: float) -> None:
    """The group the model's collectives run on: NCCL on CUDA, gloo on CPU, each collective
    failing after `timeout_s`. Every rank calls this after the setup message."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    _state.group = dist.new_group(backend=backend, timeout=timeout)


def control_group():
    return _state.control


def set_local_state(rank_: int, world: int) -> None:
    """Set the rank and size without a process group: layers build rank `rank_`'s shard (tests
    that check sharded loading, `steadylm plan`)."""
    _state.rank, _state.world_size = rank_, world
    _state.group = _state.control = None


def shutdown() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peer died cannot always be torn down cleanly
            pass
    _state.rank, _state.world_size = 0, 1
    _state.group = _state.control = None


def _timed(name: str, fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    _state.comm_seconds[name] = _state.comm_seconds.get(name, 0.0) + time.perf_counter() - t0
    return out


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place."""
    if _state.group is None:
        return x
    _timed("all_reduce", dist.all_reduce, x, group=_state.group)
    return x


def gather_to_first(x: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Concatenate every rank's `x` along `dim` on rank 0 (None on the others)."""
    if _state.group is None:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_state.world_size)] if _state.rank == 0 else None
    _timed("gather", dist.gather, x, parts, dst=0, group=_state.group)
    return torch.cat(parts, dim) if parts is not None else None


def broadcast_message(message: object = None) -> object:
    """Rank 0 sends `message` to every rank; each rank returns it."""
    box = [message]
    _timed("broadcast", dist.broadcast_object_list, box, src=0, group=_state.control)
    return box[0]
