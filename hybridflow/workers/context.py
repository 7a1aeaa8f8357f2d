"""What an op body gets from the worker that hosts it: ``WorkerContext``.

One per worker process (one per device), holding every model placed on its pool; the host
(``hybridflow.workers.model_worker``) builds the engines and fills it, and every op body,
built-in or a user's, is ``body(ctx, batch, node) -> (TensorDict, meta)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hybridflow.data import keys
from hybridflow.engines.base import RolloutEngine, TrainEngine
from hybridflow.graph.dag import Graph
from hybridflow.hybrid_engine.publish import StagedWeights
from hybridflow.hybrid_engine import verify
from hybridflow.hybrid_engine.sync import WeightSync, sync_path
from hybridflow.rewards.remote import RewardSources
from hybridflow.spec.graph import GraphSpec


@dataclass
class WorkerContext:
    """``train_engines`` / ``rollout_engines``: this process's engines by model name;
    ``rules``: the rule/compute_score/remote scorers of reward models without weights;
    ``extra_state``: state ops keep across iterations (a KL controller, a Lagrange multiplier),
    checkpointed with the engines: anything with ``state_dict()``/``load_state_dict()`` may
    register here. Policy versions: ``train_versions`` counts the actor updates applied to a
    model's train engine, ``rollout_versions`` the one its rollout engine last took (a weight
    sync); every generated sample is tagged with the latter (``weight_version``), and an
    update's staleness is the difference. A standalone rollout's train engine is on another
    pool: its versions are counted there, and its weights arrive in ``staged``."""

    rank: int
    world_size: int
    graph: Graph
    tokenizer: Any
    train_engines: dict[str, TrainEngine] = field(default_factory=dict)
    rollout_engines: dict[str, RolloutEngine] = field(default_factory=dict)
    weight_syncs: dict[str, WeightSync] = field(default_factory=dict)
    rules: dict[str, RewardSources] = field(default_factory=dict)
    extra_state: dict[str, Any] = field(default_factory=dict)
    train_versions: dict[str, int] = field(default_factory=dict)
    rollout_versions: dict[str, int] = field(default_factory=dict)
    staged: StagedWeights | None = None

    def __post_init__(self) -> None:
        if self.staged is None:
            self.staged = StagedWeights(self.rollout_versions)

    @property
    def spec(self) -> GraphSpec:
        return self.graph.spec

    def dp_group(self, model: str):
        """The ranks that split ``model``'s batches between them (a rule model's: all)."""
        return self.train_engines[model].dp_group if model in self.train_engines else None

    def temperature(self) -> float:
        """The actor's sampling temperature: forwards score the responses under it."""
        actor = self.graph.actor
        rollout = self.spec.models[actor].rollout if actor is not None else None
        return rollout.temperature if rollout is not None else 1.0

    def trained_engines(self) -> dict[str, TrainEngine]:
        """The engines an op trains (checkpointed; frozen ones are rebuilt from their source)."""
        trained = {n.model for n in self.graph.nodes if self.graph.op(n).trains}
        return {name: e for name, e in self.train_engines.items() if name in trained}

    def sync_rollout(self, model: str) -> dict[str, float]:
        """The rollout engine of ``model`` takes its train engine's current weights (and their
        version: samples it generates from now on are tagged with it); under
        ``rollout.verify_sync: every`` the probe of what was sent must match what arrived
        (``hybridflow.hybrid_engine.verify``), else WeightSyncError stops the run."""
        self.rollout_versions[model] = self.train_versions[model]
        train, rollout = self.train_engines[model], self.rollout_engines[model]
        spec = self.spec.models[model]
        if spec.rollout.verify_sync == "off":
            return self.weight_syncs[model](rollout)
        start = time.perf_counter()
        expected = verify.trainer_probe(train, self.tokenizer)  # the weights about to be sent
        trainer_seconds = time.perf_counter() - start
        metrics = self.weight_syncs[model](rollout)
        checked = verify.verify(
            expected, rollout, self.tokenizer, path=sync_path(train, spec.rollout), model=model,
            engine=spec.rollout.engine, version=self.rollout_versions[model], dtype=spec.train.dtype,
        )
        checked["timing/weight_verify"] += trainer_seconds
        return {**metrics, **checked}


def trained_uids(op, batch) -> dict[str, list[int]]:
    """The prompts (or pairs) a training op ran on this rank, for the controller's
    prompts.jsonl (a padded rank's copied group is another rank's too: the controller takes
    the union)."""
    if not (op.trains and keys.UID in batch.keys()):
        return {}
    return {"trained_uids": sorted(set(batch[keys.UID].tolist()))}
