"""Tensor-parallel process state and the collectives the model uses.

One process per rank. `init_tensor_parallel` joins a torch.distributed group (gloo on CPU,
NCCL on CUDA) with a timeout on every collective, plus a gloo control group on which rank 0
broadcasts each step's contract to the workers (its timeout is long: a worker waits there while
the engine is idle). At tp=1 nothing is initialised and every collective is the identity.

Layers ask `rank()` and `world_size()` while they are built (to size their shards) and call
`all_reduce` / `gather_to_first` in their forward. Time spent inside each kind of collective is
summed (`comm_seconds`; benchmarks read it).

When every rank is on one x86 CPU machine, all-reduces up to `SHM_SLOT_BYTES` go through shared
memory (`ShmAllReduce`) instead of gloo: one gloo all-reduce over loopback TCP took 1.7-1.9 ms
on the 2-vCPU VM whatever its size, the shared-memory one 54 us at 3 KB (docs/benchmarks.md).
"""

from __future__ import annotations

import datetime
import os
import platform as host
import time
import uuid
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
    shm: ShmAllReduce | None = None
    aborted: str | None = None  # set by abort(): a waiting shared-memory collective raises


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


def init_data_group(device: torch.device, timeout_s: float, same_host: bool) -> None:
    """The group the model's collectives run on: NCCL on CUDA, gloo on CPU, each collective
    failing after `timeout_s`; on one x86 CPU machine, shared memory for the all-reduces.
    Every rank calls this after the setup message."""
    from steadylm import platform

    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    _state.group = dist.new_group(backend=backend, timeout=timeout)
    _state.aborted = None
    use_shm = (
        device.type == "cpu"
        and same_host
        and host.machine() in ("x86_64", "AMD64")  # the flag protocol relies on x86 store order
        and platform.cpu_allreduce() == "shm"
    )
    if use_shm:
        shm = ShmAllReduce(_state.rank, _state.world_size, timeout_s)
        _state.shm = shm if shm.slot_bytes else None  # /dev/shm too small: gloo


def abort(reason: str) -> None:
    """Make every shared-memory collective this process is waiting in (or enters) raise: the
    group is dead, and a dead peer never sets its flag."""
    _state.aborted = reason


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
    _state.group = _state.control = _state.shm = None


def _timed(name: str, fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    _state.comm_seconds[name] = _state.comm_seconds.get(name, 0.0) + time.perf_counter() - t0
    return out


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place."""
    if _state.group is None:
        return x
    shm = _state.shm
    if shm is not None and x.is_contiguous() and x.numel() * x.element_size() <= shm.slot_bytes:
        return _timed("all_reduce", shm.all_reduce, x)
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


SHM_SLOT_BYTES = 16 << 20  # larger all-reduces (long prefill chunks) go through gloo


def _slot_bytes(world: int) -> int:
    """Slot size that fits /dev/shm's free space (a container's is often 64 MiB): at most
    SHM_SLOT_BYTES, 0 (use gloo) below 256 KiB."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    fit = (st.f_bavail * st.f_frsize // 2 - 8 * world) // (2 * world)  # half of what is free
    slot = min(SHM_SLOT_BYTES, fit) // 4096 * 4096
    return slot if slot >= 256 << 10 else 0


class ShmAllReduce:
    """All-reduce through one shared-memory segment: each rank copies its tensor into its slot,
    publishes the call's sequence number in its flag, waits until every flag has it, then sums
    the slots in rank order, so every rank computes the same bits. Two slot sets alternate: a
    rank can be at most one call ahead (it cannot pass the next wait alone), so it never
    overwrites a slot a slower rank is still reading.

    Rank 0 creates the segment, every rank maps it, and rank 0 unlinks the file once all have
    (the mappings stay): nothing is left in /dev/shm even if a process is killed."""

    def __init__(self, rank_: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank_, world, timeout_s
        path, slot = None, 0
        if rank_ == 0:
            slot = _slot_bytes(world)
            if slot:
                path = f"/dev/shm/steadylm-allreduce-{uuid.uuid4().hex}"
                with open(path, "wb") as f:
                    f.truncate(self._segment_bytes(world, slot))
        path, slot = broadcast_message((path, slot))  # rank 0 decides for every rank
        self.slot_bytes = slot
        if not slot:
            return
        nbytes = self._segment_bytes(world, slot)
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier(group=_state.control)  # every rank has mapped it
        if rank_ == 0:
            os.unlink(path)
        self.slots = raw[: 2 * world * slot].view(2, world, slot)
        self.flags = raw[2 * world * slot :].view(torch.int64)
        self.seq = 0

    @staticmethod
    def _segment_bytes(world: int, slot: int) -> int:
        """Two sets of `world` slots, then one int64 flag per rank."""
        return 2 * world * slot + 8 * world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.seq += 1
        nbytes = x.numel() * x.element_size()
        slots = self.slots[self.seq % 2, :, :nbytes].view(x.dtype)  # (world, numel)
        slots[self.rank].copy_(x.view(-1))
        self.flags[self.rank] = self.seq  # after the copy in program order (x86: visible after)
        self._wait()
        torch.sum(slots, 0, out=x.view(-1))
        return x

    def _wait(self) -> None:
        spins, deadline = 0, None
        while int(self.flags.min()) < self.seq:
            spins += 1
            if spins < 2000:
                continue
            time.sleep(0)  # let this process's other threads (the server) run
            if _state.aborted is not None:
                raise RuntimeError(f"all-reduce aborted: {_state.aborted}")
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            if now > deadline:
                raise RuntimeError(
                    f"all-reduce timed out after {self.timeout_s:g} s waiting for ranks "
                    f"{[r for r in range(self.world) if int(self.flags[r]) < self.seq]}"
                )
