"""Parallel layouts as plain data: tensor (tp), pipeline (pp) and data (dp) parallel sizes.

Ranks are numbered as in megatron-core's ``parallel_state`` default order ``tp-cp-ep-dp-pp``
with cp = ep = 1: tensor-parallel rank fastest, then data-parallel, then pipeline stage::

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

``ParallelLayout.coords(rank)`` and ``ParallelLayout.rank(coords)`` convert; the workers' 3D
protocol, the 3D-HybridEngine's grouping, the megatron weight conversion and the auto-mapper's
simulator all use this one numbering.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ParallelLayout(BaseModel):
    """A TP x PP x DP layout. ``dp`` left unset is derived from the pool it is placed on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tp: int = Field(1, ge=1, description="Tensor-parallel size.")
    pp: int = Field(1, ge=1, description="Pipeline-parallel size.")
    dp: int | None = Field(
        None, ge=1, description="Data-parallel size; unset means pool devices / (tp * pp)."
    )

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def resolve(self, num_devices: int) -> "ParallelLayout":
        """The layout with ``dp`` filled in for a pool of ``num_devices``.

        Raises ValueError (message without location; the caller adds it) when it does not fit.
        """
        if num_devices % self.model_parallel_size:
            raise ValueError(
                f"tp*pp = {self.model_parallel_size} does not divide the pool's {num_devices} devices"
            )
        dp = num_devices // self.model_parallel_size
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"tp*pp*dp = {self.model_parallel_size * self.dp} but the pool has {num_devices} devices"
            )
        return self.model_copy(update={"dp": dp})

    @property
    def world_size(self) -> int:
        assert self.dp is not None, "resolve() the layout against its pool first"
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> "RankCoords":
        """``rank``'s place in this (resolved) layout."""
        if self.dp is None:
            raise ValueError("coords: resolve() the layout against its pool first")
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} out of range for a layout of {self.world_size} ranks")
        return RankCoords(
            self,
            tp_rank=rank % self.tp,
            pp_rank=rank // (self.tp * self.dp),
            dp_rank=(rank // self.tp) % self.dp,
        )

    def rank(self, coords: "RankCoords") -> int:
        """The global rank at ``coords`` (the inverse of :meth:`coords`)."""
        assert self.dp is not None, "resolve() the layout against its pool first"
        return coords.tp_rank + self.tp * (coords.dp_rank + self.dp * coords.pp_rank)


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in a layout: its tensor-, pipeline- and data-parallel ranks.

    ``layout.dp`` may be unset for code that only needs a model-parallel position (the megatron
    weight conversion of one stage).
    """

    layout: ParallelLayout
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0

    def __post_init__(self) -> None:
        layout = self.layout
        if not (0 <= self.tp_rank < layout.tp and 0 <= self.pp_rank < layout.pp):
            raise IndexError(f"coords tp_rank={self.tp_rank} pp_rank={self.pp_rank} outside {layout}")
        if layout.dp is not None and not 0 <= self.dp_rank < layout.dp:
            raise IndexError(f"coords dp_rank={self.dp_rank} outside {layout}")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def rank(self) -> int:
        return self.layout.rank(self)


class GenerationLayout(BaseModel):
    """The actor's generation layout pg-tg-dg-d inside its resolved training layout p-t-d.

    Generation runs ``tp``-way tensor- and ``pp``-way pipeline-parallel; each training
    model-parallel group of ``p*t`` ranks splits into ``micro_dp = p*t / (pp*tp)`` generation
    replicas (the micro-DP groups of HybridFlow's 3D-HybridEngine). Rank grouping:
    ``hybridflow/hybrid_engine/groups.py``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    train: ParallelLayout = Field(description="The training layout, resolved (dp set).")
    tp: int = Field(1, ge=1, description="Generation tensor-parallel size tg; divides train.tp.")
    pp: int = Field(1, ge=1, description="Generation pipeline-parallel size pg; divides train.pp.")

    @model_validator(mode="after")
    def _fits_training(self) -> "GenerationLayout":
        if self.train.dp is None:
            raise ValueError("the training layout must be resolved (dp set) first")
        if self.train.tp % self.tp:
            raise ValueError(f"generation tp = {self.tp} does not divide training tp = {self.train.tp}")
        if self.train.pp % self.pp:
            raise ValueError(f"generation pp = {self.pp} does not divide training pp = {self.train.pp}")
        return self

    @property
    def micro_dp(self) -> int:
        """dg = p*t / (pg*tg): generation replicas per training model-parallel group."""
        return self.train.model_parallel_size // (self.tp * self.pp)

    @property
    def dp(self) -> int:
        """Generation replicas in all: dg * d."""
        return self.micro_dp * self.train.world_size // self.train.model_parallel_size

    def __str__(self) -> str:
        train = self.train
        same = (self.tp, self.pp) == (train.tp, train.pp)
        return f"{train}" + ("" if same else f" gen tp={self.tp} pp={self.pp}")
