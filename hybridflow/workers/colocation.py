"""Colocated models in one worker process: keep only the active model's state on the device.

A pool hosting several models (actor + ref, critic + reward ...) runs one op at a time per
process. Before an op on model ``m``, ``Colocation.activate(m)`` offloads every *other* train
engine (``TrainEngine.offload``: parameters, gradients and optimizer state to CPU memory) and
reloads ``m``'s to its home device. On a CPU pool home is the CPU: every move is a no-op, but
the same path runs and is counted (``stats()``), so the bookkeeping is tested without a GPU.

Rollout engines sharing a module with a train engine (the HF rollout) move with it; engines with
their own memory (vLLM) free it through ``RolloutEngine.offload/reload``.
"""

from __future__ import annotations

from typing import Any

from hybridflow.engines.base import TrainEngine


class Colocation:
    """Which of a process's train engines is on its device; offloads the idle ones."""

    def __init__(self, engines: dict[str, TrainEngine]) -> None:
        self.engines = engines
        self.active: str | None = None
        self._stats = {"activations": 0, "offloads": 0, "bytes_offloaded": 0, "bytes_reloaded": 0}

    def activate(self, model: str | None) -> None:
        """Make ``model`` resident (``None`` or a non-engine model such as a rule: offload all)."""
        if model == self.active:
            return
        self._stats["activations"] += 1
        for name, engine in self.engines.items():
            if name != model:
                self._stats["offloads"] += 1
                self._stats["bytes_offloaded"] += engine.offload()
        if model in self.engines:
            self._stats["bytes_reloaded"] += self.engines[model].reload()
        self.active = model

    def stats(self) -> dict[str, Any]:
        return {**self._stats, "active": self.active, "models": sorted(self.engines)}
