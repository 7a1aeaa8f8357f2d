"""What the resharder needs to know about a model: one :class:`ShardSpec` per parameter.

A parameter is either replicated on every TP rank (``tp_dim`` None) or split into ``t`` equal
contiguous chunks along ``tp_dim`` (0: column-parallel and vocabulary tensors, 1: row-parallel),
TP rank ``r`` holding chunk ``r``; it lives on training pipeline stage ``pp_stage`` (0 .. p-1).
``full_shape`` is the unsplit shape (vocabulary padded to a multiple of t, as the train engine
holds it). Names are the train engine's choice; the megatron engine reports HF names
(``hybridflow.engines.megatron.convert.hf_shards``), so generation shards come out HF-named.

Every rank passes the specs of the *whole* model (all stages), in the same order: a rank's
training shard is laid out in that order, and each rank must know the layout of what its
micro-DP peers send. The seam itself, ``reshard_to_generation``, is in ``reshard.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """One parameter: full shape, TP split dim (None: replicated), training PP stage."""

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

    def slice_full(self, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
        """Chunk ``tp_rank`` of ``tp`` of the full tensor (a view)."""
        if self.tp_dim is None:
            return full
        return full.chunk(tp, dim=self.tp_dim)[tp_rank]


def specs_from(shards: Iterable) -> list[ShardSpec]:
    """ShardSpecs from any objects with ``name, full_shape, tp_dim, pp_stage`` (e.g. HFShard)."""
    return [ShardSpec(s.name, tuple(s.full_shape), s.tp_dim, s.pp_stage) for s in shards]


def model_bytes(specs: Iterable[ShardSpec], dtype: torch.dtype) -> int:
    """M: bytes of the full (unsharded) model."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(s.full_shape) for s in specs) * itemsize
