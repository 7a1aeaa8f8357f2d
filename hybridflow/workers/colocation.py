"""Colocated models in one worker process: keep only what the running op needs on the device.

A pool hosting several models (actor + ref, critic + reward ...) runs one op at a time per
process. Before an op on model ``m``, ``Colocation.activate(m, generates)`` offloads every
*other* train engine (``TrainEngine.offload``: parameters, gradients and optimizer state to CPU
memory) and reloads ``m``'s to its home device. Rollout engines follow the op record's
``generates`` flag: ``m``'s rollout engine is reloaded before an op that generates with it
(generate, multi-turn generate, a judge's score), and every rollout engine is offloaded before
any other op (``RolloutEngine.offload``: vLLM's sleep mode on CUDA), so the rollout's weights and
KV cache do not sit in device memory through the updates.

On a CPU pool home is the CPU: every move is a no-op (vLLM has no sleep mode on CPU; the
transformers rollout shares its train engine's module), but the same path runs and is counted
(``stats()``; ``rollout_offloads`` / ``rollout_reloads`` per op, which the controller logs as
``colocation/rollout_offloads`` / ``colocation/rollout_reloads``), so the bookkeeping is tested
without a GPU.
"""

from __future__ import annotations

from typing import Any

from hybridflow.engines.base import RolloutEngine, TrainEngine

ROLLOUT_MOVES = ("rollout_offloads", "rollout_reloads")  # meta keys of an op's rollout moves


class Colocation:
    """Which of a process's engines are on its device; offloads the idle ones."""

    def __init__(self, engines: dict[str, TrainEngine], rollouts: dict[str, RolloutEngine] | None = None) -> None:
        self.engines = engines
        self.rollouts = rollouts if rollouts is not None else {}
        self.active: str | None = None
        self.offloaded_rollouts: set[str] = set()  # rollout engines start resident
        self._stats = {"activations": 0, "offloads": 0, "bytes_offloaded": 0, "bytes_reloaded": 0,
                       "rollout_offloads": 0, "rollout_reloads": 0}

    def activate(self, model: str | None, generates: bool = False) -> dict[str, int]:
        """Make ``model`` resident (``None`` or a non-engine model such as a rule: offload all),
        and its rollout engine too when the op ``generates``; returns the rollout engines
        offloaded and reloaded for it."""
        moves = dict.fromkeys(ROLLOUT_MOVES, 0)
        wanted = model if generates else None
        for name, rollout in self.rollouts.items():  # first: free memory before reloading any
            if name != wanted and name not in self.offloaded_rollouts:
                rollout.offload()
                self.offloaded_rollouts.add(name)
                moves["rollout_offloads"] += 1
        self._activate_train(model)
        if wanted in self.offloaded_rollouts:
            self.rollouts[wanted].reload()
            self.offloaded_rollouts.discard(wanted)
            moves["rollout_reloads"] += 1
        for key, count in moves.items():
            self._stats[key] += count
        return moves

    def _activate_train(self, model: str | None) -> None:
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
        return {**self._stats, "active": self.active, "models": sorted(self.engines),
                "rollouts_offloaded": sorted(self.offloaded_rollouts)}
