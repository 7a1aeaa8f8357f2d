"""A train engine's weights as the resharder sees them: one :class:`ShardSpec` per tensor, and
the rank's training shard in one flat :class:`TrainShardBuffer`.

A tensor is either replicated on every TP rank (``tp_dim`` None) or split into ``t`` equal
contiguous chunks along ``tp_dim`` (0: column-parallel and vocabulary tensors, 1: row-parallel),
TP rank ``r`` holding chunk ``r``; it lives on training pipeline stage ``pp_stage`` (0 .. p-1).
``full_shape`` is the unsplit shape (vocabulary padded to a multiple of t, as the engine holds
it). Names are the engine's choice (the megatron engine's are listed in
``hybridflow.engines.megatron.convert``).

Every rank knows the specs of the *whole* model (all stages), in the same order: a rank's
training shard is laid out in that order, and each rank must know the layout of what its
micro-DP peers send. The engine keeps its parameters as views of its buffer (as megatron's DDP
keeps parameters in contiguous buffers), so the resharder (``hybridflow.hybrid_engine.reshard``)
sends and keeps the training shard without a copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ShardSpec:
    """One tensor: full shape, TP split dim (None: replicated), training PP stage."""

    name: str
    full_shape: tuple[int, ...]
    tp_dim: int | None
    pp_stage: int = 0

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one TP rank's chunk under ``tp``-way tensor parallelism."""
        if self.tp_dim is None:
            return self.full_shape
        size = self.full_shape[self.tp_dim]
        if size % tp:
            raise ValueError(f"{self.name}: dim {self.tp_dim} of {self.full_shape} is not divisible by tp={tp}")
        shape = list(self.full_shape)
        shape[self.tp_dim] = size // tp
        return tuple(shape)

    def shard_numel(self, tp: int) -> int:
        return math.prod(self.shard_shape(tp))

    def slice_full(self, full: Tensor, tp: int, tp_rank: int) -> Tensor:
        """Chunk ``tp_rank`` of ``tp`` of the full tensor (a view)."""
        if self.tp_dim is None:
            return full
        return full.chunk(tp, dim=self.tp_dim)[tp_rank]


def model_bytes(specs: Iterable[ShardSpec], dtype: torch.dtype) -> int:
    """M: bytes of the full (unsharded) model."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(s.full_shape) for s in specs) * itemsize


@dataclass(frozen=True)
class Slot:
    """Where one tensor sits in a flat training shard."""

    spec: ShardSpec
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def stage_layout(specs: Sequence[ShardSpec], pp_stage: int, tp: int) -> tuple[list[Slot], int]:
    """Where each tensor of stage ``pp_stage`` sits in a TP rank's flat training shard (the same
    for every TP rank of the stage), and the shard's numel."""
    slots, offset = [], 0
    for spec in specs:
        if spec.pp_stage == pp_stage:
            shape = spec.shard_shape(tp)
            slots.append(Slot(spec, offset, shape))
            offset += math.prod(shape)
    return slots, offset


def slot_views(flat: Tensor, slots: list[Slot]) -> dict[str, Tensor]:
    return {s.spec.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in slots}


class TrainShardBuffer:
    """One rank's training shard in one flat tensor; ``views`` are its tensors, in spec order."""

    def __init__(self, flat: Tensor, slots: list[Slot], rank: int) -> None:
        self.flat = flat
        self.rank = rank
        self.slots = {s.spec.name: s for s in slots}
        self.views = slot_views(flat, slots)

    @classmethod
    def allocate(
        cls,
        specs: Sequence[ShardSpec],
        pp_stage: int,
        tp: int,
        rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "TrainShardBuffer":
        """An uninitialised buffer for a rank on stage ``pp_stage`` of a ``tp``-way TP layout."""
        slots, numel = stage_layout(specs, pp_stage, tp)
        return cls(torch.empty(numel, dtype=dtype, device=device), slots, rank)

    @classmethod
    def pack(
        cls, named: Mapping[str, Tensor], specs: Sequence[ShardSpec], pp_stage: int, tp: int, rank: int
    ) -> "TrainShardBuffer":
        """A buffer holding a copy of ``named`` (this rank's shards, any storage)."""
        first = next(iter(named.values()))
        buf = cls.allocate(specs, pp_stage, tp, rank, first.dtype, first.device)
        missing = set(buf.views) - set(named)
        if missing:
            raise ValueError(f"rank {rank}: shards missing for {sorted(missing)[:5]}")
        with torch.no_grad():
            for name, view in buf.views.items():
                if tuple(named[name].shape) != tuple(view.shape):
                    raise ValueError(
                        f"rank {rank}: {name} has shape {tuple(named[name].shape)}, "
                        f"its spec says {tuple(view.shape)}"
                    )
                view.copy_(named[name])
        return buf

    def span(self, names: Sequence[str], shape: tuple[int, ...]) -> Tensor:
        """One view over the consecutive slots ``names`` (e.g. a fused parameter made of two
        specs), shaped ``shape``."""
        slots = [self.slots[n] for n in names]
        for before, after in zip(slots, slots[1:]):
            if before.offset + before.numel != after.offset:
                raise ValueError(f"{before.spec.name} and {after.spec.name} are not adjacent")
        start, end = slots[0].offset, slots[-1].offset + slots[-1].numel
        return self.flat[start:end].view(shape)


def checkpoint_piece(
    spec: ShardSpec, shard: Tensor, tp: int, tp_rank: int, mesh=None, full_rows: int | None = None
) -> Tensor:
    """``shard`` (TP chunk ``tp_rank`` of ``spec``'s full tensor, or anything shaped like it: an
    Adam moment, a gradient) as what ``torch.distributed.checkpoint`` saves and loads: a DTensor
    sharded over the TP group ``mesh`` with the *full* tensor's shape, or the tensor itself when
    it is whole (``tp`` = 1 or replicated). The checkpoint then indexes it by full-tensor offsets
    and loads it under any ``tp``. A view of ``shard``: loading into it fills ``shard``.

    ``full_rows`` drops dim-0 padding (a vocabulary padded to a multiple of ``tp``): the
    checkpoint holds the first ``full_rows`` rows, each rank its part of them (torch.chunk's
    split of ``full_rows``, the same rows as the padded split minus the padding).
    """
    shape = list(spec.full_shape)
    if full_rows is not None:
        chunk = shard.shape[0] if spec.tp_dim == 0 else full_rows
        start = tp_rank * chunk if spec.tp_dim == 0 else 0
        shard = shard[: max(0, min(chunk, full_rows - start))]
        shape[0] = full_rows
    if spec.tp_dim is None or tp == 1:
        return shard
    from torch.distributed.tensor import DTensor, Shard

    stride = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    return DTensor.from_local(
        shard, mesh, [Shard(spec.tp_dim)], run_check=False, shape=torch.Size(shape), stride=tuple(stride)
    )
