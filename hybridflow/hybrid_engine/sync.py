"""Moving the actor's fresh weights from its train engine to its rollout engine, every iteration.

Three cases, chosen by the train engine (``weight_sync``):

- **LoRA** (:func:`sync_adapters`): a torch engine training adapters (``adapter_config()``).
  The rollout engine holds the frozen base since its start and takes the adapters only:
  vLLM as a LoRA adapter, the transformers rollout by sharing the module; or, under
  ``rollout.lora_sync: merged`` (:func:`sync_merged`), vLLM takes the merged weights.
- **Same layout** (:func:`sync_weights`): the torch train engine and a rollout engine in one
  process. The transformers rollout engine generates from the train engine's own module:
  ``load_weights`` finds every tensor already in place and copies nothing. vLLM keeps its own copy
  and takes the weights through ``load_weights``.
- **Data-parallel shards** (:func:`sync_weights` too): an FSDP2 engine's ``named_weights``
  gathers the full tensors a bucket at a time (``train.sync_bucket_mb``), every rank, and the
  rollout engine copies each bucket before the next is gathered; the engine reports
  ``reshard/peak_bytes`` (the largest bucket), ``reshard/received_bytes`` and
  ``reshard/model_bytes``.
- **Sharded** (:class:`ReshardedSync`): a train engine whose parameters are views of a flat
  training shard (``TrainEngine.train_shard``: megatron-core, TP x PP). Each iteration the resharder gathers the generation
  shard from the micro-DP group (zero-redundancy path, or the naive one), the rollout engine
  takes it under HF names one tensor at a time, and the received buffers are dropped before
  training resumes. The measured bytes and peak memory go into the iteration's metrics, each the
  maximum over the model-parallel ranks (the worst rank: ranks of different pipeline stages hold
  and receive different amounts): ``reshard/received_bytes``, ``reshard/peak_bytes``,
  ``reshard/model_bytes`` (M), and vLLM's own copy, ``reshard/rollout_copy_bytes``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from hybridflow.engines.base import RolloutEngine, TrainEngine, TrainShard
from hybridflow.hybrid_engine.reshard import Mode, build_groups, reshard_to_generation
from hybridflow.spec.graph import RolloutSpec
from hybridflow.spec.layout import GenerationLayout

WeightSync = Callable[[RolloutEngine], dict[str, float]]  # one call per iteration; its metrics


def weight_sync(engine: TrainEngine, rollout: RolloutSpec) -> WeightSync:
    """How ``engine``'s weights reach its rollout engine each iteration: its adapters (or the
    weights with them merged in) when it trains LoRA, through the resharder when it holds a
    training shard, else as its full named weights. Building the resharded one is collective:
    every rank of the group calls this."""
    if engine.adapter_config() is not None:
        if rollout.merges_lora:  # an engine that shares the module has no such option
            return partial(sync_merged, engine)
        return partial(sync_adapters, engine)
    shard = engine.train_shard()
    if shard is None:
        return partial(sync_weights, engine)
    return ReshardedSync(shard, rollout.layout.tp, rollout.layout.pp, rollout.reshard)


def sync_path(engine: TrainEngine, rollout: RolloutSpec) -> str:
    """The name of the path ``weight_sync`` takes, as a failed verification names it
    (``hybridflow.hybrid_engine.verify``)."""
    if engine.adapter_config() is not None:
        return "merged" if rollout.merges_lora else "lora_adapter"
    return "full_weights" if engine.train_shard() is None else "resharded"


def sync_weights(train: TrainEngine, rollout: RolloutEngine) -> dict[str, float]:
    """Push ``train``'s current weights into ``rollout``; returns timing metrics and
    ``weight_sync/bytes``, the bytes of the copy the rollout engine took (0 when it shares the
    train engine's module)."""
    start = time.perf_counter()
    moved = rollout.load_weights(train.named_weights())
    metrics = {"timing/weight_sync": time.perf_counter() - start, "weight_sync/bytes": float(moved)}
    return {**metrics, **train.sync_metrics()}


def sync_merged(train: TrainEngine, rollout: RolloutEngine) -> dict[str, float]:
    """A LoRA actor under ``rollout.lora_sync: merged``: the weights with the adapters merged
    in, through ``load_weights`` (a rollout engine started without LoRA)."""
    start = time.perf_counter()
    moved = rollout.load_weights(train.merged_weights())
    return {"timing/weight_sync": time.perf_counter() - start, "weight_sync/bytes": float(moved)}


def sync_adapters(train: TrainEngine, rollout: RolloutEngine) -> dict[str, float]:
    """A LoRA actor's sync: the adapters only (the rollout engine holds the frozen base since
    its start); ``weight_sync/bytes``: the adapter bytes the rollout engine took."""
    start = time.perf_counter()
    moved = rollout.load_adapter(train.adapter_weights())
    return {"timing/weight_sync": time.perf_counter() - start, "weight_sync/bytes": float(moved)}


class ReshardedSync:
    """The train -> generate transition of a sharded actor, through the resharder.

    Built once per actor on every rank of its worker group (it creates the process groups,
    collectively); called once per iteration after the update.

    Args:
        shard: the train engine's training shard (``TrainEngine.train_shard()``).
        tp, pp: the generation layout (tg, pg); must divide the training tp, pp.
        mode: ``"zero_redundancy"`` (all-gather inside each micro-DP group) or ``"naive"``
            (gather the whole model-parallel group, then keep this rank's part).
    """

    def __init__(self, shard: TrainShard, tp: int = 1, pp: int = 1, mode: Mode = "zero_redundancy") -> None:
        self.shard = shard
        self.layout = GenerationLayout(train=shard.layout, tp=tp, pp=pp)
        self.mode = mode
        self.groups = build_groups(self.layout)

    def __call__(self, rollout: RolloutEngine) -> dict[str, float]:
        start = time.perf_counter()
        shards, stats = reshard_to_generation(
            self.shard.buffer, self.shard.specs, self.layout, self.groups, self.mode
        )
        weights = self.shard.to_hf(shards, self.layout.tp)
        moved = rollout.load_weights(_counting_copies(weights, shards, stats))
        shards.release()
        metrics = stats.as_metrics()
        metrics["weight_sync/bytes"] = float(moved)
        rollout_bytes = rollout.weight_bytes()
        if rollout_bytes is not None:
            metrics["reshard/rollout_copy_bytes"] = float(rollout_bytes)
        metrics = _max_over_ranks(metrics, self.groups.model_parallel_group, self.shard.buffer.flat.device)
        metrics["timing/weight_sync"] = time.perf_counter() - start
        return metrics


def _max_over_ranks(metrics: dict[str, float], group, device) -> dict[str, float]:
    """Every metric's maximum over ``group`` (collective; None: this rank alone). The
    controller logs one rank's metrics, and per-rank bytes differ between pipeline stages."""
    if group is None:
        return metrics
    names = sorted(metrics)
    values = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(names, values.tolist()))


def _counting_copies(weights: Iterator[tuple[str, Tensor]], shards, stats) -> Iterator[tuple[str, Tensor]]:
    """Pass ``weights`` through, adding to ``stats.materialized_bytes`` the bytes of each tensor
    that is not a view of the resharder's buffers (a concatenation of TP pieces, a q/k/v split):
    the transient copies the rollout engine is handed, one at a time."""
    buffers = {p.untyped_storage().data_ptr() for pieces in shards.values() for p in pieces}
    for name, tensor in weights:
        if tensor.untyped_storage().data_ptr() not in buffers:
            stats.materialized_bytes += tensor.numel() * tensor.element_size()
        yield name, tensor
