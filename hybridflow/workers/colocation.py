"""Colocated models in one worker process: keep only the active model's state on the device.

A pool hosting several models (actor + ref, critic + reward ...) runs one op at a time per
process. Before an op on model ``m``, ``Colocation.activate(m)`` moves every *other* train
engine's parameters, gradients and optimizer state to CPU memory and brings ``m``'s back to its
home device (where it was built). On a CPU pool home is the CPU: every move is a no-op, but the
same path runs and is counted (``stats()``), so the bookkeeping is tested without a GPU.

Rollout engines sharing a module with a train engine (the HF rollout) move with it; engines with
their own memory (vLLM) free it through ``RolloutEngine.offload/reload``.
"""

from __future__ import annotations

from typing import Any

import torch


def _state_tensors(engine: Any) -> list[torch.Tensor]:
    tensors = [p for p in engine.module.parameters()]
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None:
        for state in optimizer.state.values():
            # "step" stays where torch keeps it (a CPU scalar unless capturable).
            tensors.extend(v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step")
    return tensors


def _move(engine: Any, device: torch.device) -> int:
    """Move an engine's module (with grads) and optimizer state to ``device``; bytes moved."""
    moved = sum(
        t.numel() * t.element_size() for t in _state_tensors(engine) if t.device != device
    )
    if moved == 0:
        return 0
    engine.module.to(device)
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
    return moved


class Colocation:
    """Which of a process's train engines is on its device; moves the idle ones to CPU."""

    def __init__(self, engines: dict[str, Any]) -> None:
        # Engines that manage their own memory (no plain ``module``) are left alone.
        self.engines = {
            name: engine
            for name, engine in engines.items()
            if isinstance(getattr(engine, "module", None), torch.nn.Module)
            and next(engine.module.parameters(), None) is not None
        }
        self.home = {
            name: next(engine.module.parameters()).device for name, engine in self.engines.items()
        }
        self.active: str | None = None
        self._stats = {"activations": 0, "offloads": 0, "bytes_offloaded": 0, "bytes_reloaded": 0}

    def activate(self, model: str | None) -> None:
        """Make ``model`` resident (``None`` or a non-engine model such as a rule: offload all)."""
        if model == self.active:
            return
        self._stats["activations"] += 1
        cpu = torch.device("cpu")
        for name, engine in self.engines.items():
            if name != model:
                self._stats["offloads"] += 1
                self._stats["bytes_offloaded"] += _move(engine, cpu)
        if model in self.engines:
            self._stats["bytes_reloaded"] += _move(self.engines[model], self.home[model])
        self.active = model

    def stats(self) -> dict[str, Any]:
        return {**self._stats, "active": self.active, "models": sorted(self.engines)}
