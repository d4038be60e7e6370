"""Which part of each checkpoint tensor this rank holds, and reading only that part.

A `Split` says, for one linear layer, which rows of each checkpoint output shard (q, k, v;
gate, up) and which input columns (row-parallel layers) this rank holds. Weight loaders narrow a
`CheckpointTensor` (a lazy safetensors slice) to their part before anything is read, so a rank
reads only its own shard from disk; plain tensors narrow the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from steadylm import parallel
from steadylm.errors import ModelLoadError


@dataclass(frozen=True)
class Shard:
    start: int  # first checkpoint row (or column) this rank holds
    size: int  # how many it holds (rows past the checkpoint's end are zero padding)
    full: int  # the checkpoint's size along that dim

    @property
    def real(self) -> int:
        """How many of the held rows exist in the checkpoint (the rest are padding)."""
        return max(0, min(self.size, self.full - self.start))


@dataclass(frozen=True)
class Split:
    out: tuple[Shard, ...]  # per checkpoint output shard: the rows this rank holds
    inp: Shard | None = None  # row-parallel: the input columns this rank holds

    @property
    def out_features(self) -> int:
        return sum(s.size for s in self.out)

    def out_shard(self, shard_id: object) -> tuple[int, Shard]:
        """(index, rows) of the checkpoint output shard a loader was handed: `shard_id` of a
        merged layer, None for a single one."""
        if (shard_id is None) != (len(self.out) == 1):
            raise ModelLoadError(f"shard {shard_id!r} does not match this layer's shards")
        i = shard_id or 0
        return i, self.out[i]

    @staticmethod
    def whole(output_sizes: list[int]) -> Split:
        """Every rank holds everything (tp=1, or a replicated layer)."""
        return Split(tuple(Shard(0, n, n) for n in output_sizes))

    @staticmethod
    def column(output_sizes: list[int]) -> Split:
        """Each output shard split evenly over the ranks (column-parallel)."""
        r, tp = parallel.rank(), parallel.world_size()
        return Split(tuple(Shard(r * (n // tp), n // tp, n) for n in output_sizes))

    @staticmethod
    def row(in_features: int, out_features: int) -> Split:
        """The input dim split evenly over the ranks; the outputs are summed (row-parallel)."""
        r, tp = parallel.rank(), parallel.world_size()
        k = in_features // tp
        inp = Shard(r * k, k, in_features) if tp > 1 else None
        return Split((Shard(0, out_features, out_features),), inp)

    @staticmethod
    def vocab(vocab_size: int) -> Split:
        """Vocab rows in equal blocks of ceil(V / tp); the last rank's block is zero-padded."""
        r, tp = parallel.rank(), parallel.world_size()
        per = -(-vocab_size // tp)
        return Split((Shard(r * per, per, vocab_size),))


class CheckpointTensor:
    """A tensor in a safetensors file, read only when materialised, after narrowing."""

    def __init__(self, source, shape: tuple[int, ...], box: tuple[tuple[int, int], ...] = ()):
        self.source = source  # safetensors' PySafeSlice
        self.shape = torch.Size(shape)
        self.box = box or tuple((0, n) for n in shape)

    def narrow(self, dim: int, start: int, size: int) -> CheckpointTensor:
        lo, n = self.box[dim]
        if start < 0 or start + size > n:
            raise IndexError(f"narrow({dim}, {start}, {size}) past dim size {n}")
        box = list(self.box)
        box[dim] = (lo + start, size)
        shape = list(self.shape)
        shape[dim] = size
        return CheckpointTensor(self.source, tuple(shape), tuple(box))

    def materialize(self) -> torch.Tensor:
        if not self.box:  # a 0-d tensor
            return self.source[:]
        return self.source[tuple(slice(lo, lo + n) for lo, n in self.box)]


def materialize(t) -> torch.Tensor:
    return t.materialize() if isinstance(t, CheckpointTensor) else t


def check_shape(loaded, expected) -> None:
    """The checkpoint tensor has the shape the layer expects of the whole tensor."""
    if tuple(loaded.shape) != tuple(expected):
        raise ModelLoadError(
            f"shape mismatch: expected {tuple(expected)}, got {tuple(loaded.shape)}"
        )


def copy_rows(target: torch.Tensor, loaded, rows: Shard) -> None:
    """Copy checkpoint rows `rows` of `loaded` into `target` (rows.size rows), zeroing the
    padding rows past the checkpoint's end (a vocab block)."""
    if rows.real < rows.size:
        target.zero_()
    target.narrow(0, 0, rows.real).copy_(materialize(loaded.narrow(0, rows.start, rows.real)))
