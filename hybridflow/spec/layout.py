"""Parallel layouts as plain data: tensor (tp), pipeline (pp) and data (dp) parallel sizes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
