"""Resource-pool files: named pools of devices a graph's models are placed on."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PoolSpec(BaseModel):
    """One resource pool: ``nodes`` x ``devices_per_node`` devices of one kind."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    nodes: int = Field(1, ge=1, description="Ray nodes the pool spans.")
    devices_per_node: int = Field(1, ge=1, description="Devices (worker processes) per node.")
    device: Literal["cpu", "gpu"] = Field("cpu", description="Device kind of every rank.")
    cpus_per_device: float = Field(
        1.0, gt=0, description="Logical Ray CPUs reserved per rank (bundle size)."
    )
    threads_per_device: int = Field(
        1, ge=1, description="torch intra-op threads per rank; keep cores >= ranks x threads."
    )
    profile: str | None = Field(None, description="Hardware profile name for the cost simulator.")
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Ray node labels every node of the pool must carry (`ray start --labels`); "
        "pins a pool to chosen nodes, e.g. {hybridflow-node: second}.",
    )

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node


class PoolsFile(BaseModel):
    """A pool file: ``pools`` maps a pool name to its devices."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    pools: dict[str, PoolSpec] = Field(description="Pool name -> pool.")
