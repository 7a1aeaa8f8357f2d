"""Fault hooks for tests: a worker host that can be told to fail, and a Trainer that runs it.

The production host (``hybridflow.workers.model_worker.ModelWorker``) has no such methods; a
test runs ``FaultyTrainer`` (or sets ``worker_cls = FaultyWorker`` on its own Trainer
subclass) and calls the hooks through the worker group:
``ray.get(trainer.groups["default"].call("inject_nonfinite", model="actor", target="loss"))``.
"""

from __future__ import annotations

import math
import sys
import time

from ray import cloudpickle

from hybridflow.controller.trainer import Trainer
from hybridflow.workers.model_worker import ModelWorker
from hybridflow.workers.protocols import Dispatch, register

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import tests/


class FaultyWorker(ModelWorker):
    def run_op(self, batch, *, node: str, **kwargs):
        """The host's ``run_op``; an update of a model told to (``inject_nonfinite``) runs
        with a NaN loss, and a node told to (``inject_op_delay``) starts late."""
        if (delay := getattr(self, "_op_delays", {}).get(node)) is not None:
            time.sleep(delay)
        resolved = self.graph.node(node)
        left = getattr(self, "_nan_updates", {})
        if not (self.graph.op(resolved).trains and left.get(resolved.model, 0) > 0):
            return super().run_op(batch, node=node, **kwargs)
        left[resolved.model] -= 1
        engine = self.train_engines[resolved.model]
        train_step = engine.train_step

        def poisoned_step(mini_batch, loss_fn, *args, **step_kwargs):
            def poisoned(mb, out):
                loss, metrics = loss_fn(mb, out)
                return loss * math.nan, metrics

            return train_step(mini_batch, poisoned, *args, **step_kwargs)

        engine.train_step = poisoned_step
        try:
            return super().run_op(batch, node=node, **kwargs)
        finally:
            del engine.train_step  # the class's method again

    @register(Dispatch.ONE_TO_ALL)
    def inject_nonfinite(self, *, model: str, target: str, count: int = 1) -> None:
        """``target="loss"``: the next ``count`` updates of ``model`` have a NaN loss (every
        optimizer step of them); ``target="weight"``: one of its weights is NaN now."""
        if target == "loss":
            self._nan_updates = {**getattr(self, "_nan_updates", {}), model: count}
        else:
            next(iter(self.train_engines[model].named_weights()))[1].view(-1)[0] = math.nan

    @register(Dispatch.ONE_TO_ALL)
    def inject_op_delay(self, *, node: str, seconds: float) -> None:
        """Every call of graph node ``node`` waits ``seconds`` before its body runs, so that
        the controller can be stopped while the node is surely unfinished."""
        self._op_delays = {**getattr(self, "_op_delays", {}), node: seconds}

    @register(Dispatch.ONE_TO_ALL)
    def inject_stale_rollout(self, *, model: str, count: int = 1) -> None:
        """Skip the weight sync of the next ``count`` updates of ``model``, so its rollout
        engine (if it holds its own copy, as vLLM does) generates from stale weights."""
        left = {"syncs": count}
        sync_rollout = self.ctx.sync_rollout

        def skipping(name: str) -> dict[str, float]:
            if name == model and left["syncs"] > 0:
                left["syncs"] -= 1
                return {}
            return sync_rollout(name)

        self.ctx.sync_rollout = skipping

    @register(Dispatch.ONE_TO_ALL)
    def corrupt_sync(self, *, model: str, target: str = "tensor", count: int = 1) -> None:
        """The next ``count`` weight loads of ``model``'s rollout engine on this worker go
        wrong: ``target="tensor"``: the first tensor given arrives corrupted (its rows reversed
        and scaled, shape kept); ``target="adapter"``: the LoRA adapters are dropped before
        loading (``load_adapter`` takes nothing). Either way the sync itself reports success."""
        engine = self.rollout_engines[model]
        left = {"loads": count}

        def corrupted(weights):
            for k, (name, tensor) in enumerate(weights):
                yield name, (tensor.flip(0) * 4.0 if k == 0 else tensor)

        if target == "tensor":
            load_weights = engine.load_weights

            def faulty_load(weights):
                if left["loads"] <= 0:
                    return load_weights(weights)
                left["loads"] -= 1
                return load_weights(corrupted(weights))

            engine.load_weights = faulty_load
        else:
            load_adapter = engine.load_adapter

            def dropping(weights, *args, **kwargs):
                if left["loads"] <= 0:
                    return load_adapter(weights, *args, **kwargs)
                left["loads"] -= 1
                return sum(t.numel() * t.element_size() for t in weights.values())  # as if taken

            engine.load_adapter = dropping

    @register(Dispatch.ONE_TO_ALL)
    def inject_step_delay(self, *, model: str, seconds: float, hold_for_weights: bool = False) -> None:
        """With partial rollouts, every decoding step of ``model``'s generations takes
        ``seconds`` longer, so that updates finish while a generation is in flight.
        ``hold_for_weights``: from the second generation on, its second decoding step also
        waits (up to a minute) until new weights are staged, unless the generation has taken
        new weights already, so a load mid-generation does not depend on how fast the update
        ran. (Weights staged only after this generation ended never come while it waits: the
        next update trains on its samples.)"""
        staged = self.ctx.staged
        updates = staged.updates
        generations = {"count": 0}

        def slow_updates(name: str, mode: str, versions: list[int]):
            weight_updates = updates(name, mode, versions)
            if name != model:
                return weight_updates
            generations["count"] += 1
            poll, polls, taken = weight_updates.poll, {"count": 0}, {"any": False}

            def slow_poll():
                time.sleep(seconds)
                polls["count"] += 1
                if hold_for_weights and generations["count"] >= 2 and polls["count"] == 2 and not taken["any"]:
                    deadline = time.monotonic() + 60.0
                    while time.monotonic() < deadline and model not in staged._staged:
                        time.sleep(0.02)
                weights = poll()
                taken["any"] = taken["any"] or weights is not None
                return weights

            weight_updates.poll = slow_poll
            return weight_updates

        staged.updates = slow_updates


class FaultyTrainer(Trainer):
    worker_cls = FaultyWorker
