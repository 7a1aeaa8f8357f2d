"""A rollout engine registered from outside the package, as a user's module would: a graph
names it (``rollout.engine: counting``) with an option of its own config (``label``)."""

from __future__ import annotations

from pydantic import Field

from hybridflow.engines.hf_rollout import HFRolloutEngine
from hybridflow.spec.engines import EngineCaps, EngineRecord, register_engine
from hybridflow.spec.graph import RolloutSpec


class CountingRolloutSpec(RolloutSpec):
    label: str = Field("plain", description="Recorded by the engine, to show its config reached it.")


class CountingRollout(HFRolloutEngine):
    """The transformers rollout, counting its generate calls."""

    calls = 0

    def generate(self, prompts, params, updates=None):
        self.calls += 1
        return super().generate(prompts, params, updates)


NAME = "counting"
register_engine(EngineRecord(
    NAME, "rollout", f"{__name__}:CountingRollout", CountingRolloutSpec, EngineCaps(shares_weights=True)
))
