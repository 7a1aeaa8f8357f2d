"""Weights for a standalone rollout (``rollout.pool``): the actor trains on one pool and its
rollout engine generates on another, so each sync goes through the object store.

Rank 0 of the training pool ``publish``es the weights in buckets; every rank of the rollout pool
``receive``s them. With partial rollouts (``trainer.async.partial_rollout``) the receive runs on
the rollout actor's side thread, beside a generation: it only fetches the buckets and stages
them (``StagedWeights``); the generation in progress loads them between two decoding steps
(``StagedWeights.updates``), or the next one loads them first (``StagedWeights.load``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import ray
import torch

from hybridflow.engines.base import RolloutEngine, TrainEngine, WeightUpdates


# A rollout engine's check after a load (``hybridflow.hybrid_engine.verify``): it takes the
# engine, the trainer's probe log-probs, the weight version and a way to go over the weights
# sent again (to name the first one that differs); returns its metrics.
SyncCheck = Callable[[RolloutEngine, torch.Tensor, int, Callable | None], dict[str, float]]


def publish(engine: TrainEngine, version: int, bucket_mb: float, probe: torch.Tensor | None = None) -> dict:
    """Put ``engine``'s current weights (a LoRA engine's with the adapters merged in) into the
    object store in buckets of about ``bucket_mb`` MiB; returns their refs with the weight version, the bytes, and ``probe``
    (the trainer's fingerprint of these weights, checked by the receiving ranks)."""
    start = time.perf_counter()
    buckets, bucket, size, total = [], {}, 0, 0
    limit = bucket_mb * 2**20
    # A LoRA actor's rollout pool holds a plain model: it takes the adapters merged in.
    weights = engine.merged_weights() if engine.adapter_config() is not None else engine.named_weights()
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            buckets.append(ray.put(bucket))
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
        total += nbytes
    if bucket:
        buckets.append(ray.put(bucket))
    return {
        "buckets": buckets,
        "version": version,
        "probe": probe,
        "metrics": {"weight_sync/bytes": float(total), "weight_sync/buckets": float(len(buckets)),
                    "timing/weight_publish": time.perf_counter() - start,
                    **engine.sync_metrics()},  # a sharded engine's gathers
    }


def bucket_items(buckets: list[dict]) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of published weight buckets, as one set for one load."""
    return (item for bucket in buckets for item in bucket.items())


class StagedWeights:
    """Per model, the newest weights received and not loaded yet: ``(version, buckets, check)``
    (``check``: the verification of the load, or None). Newer weights replace ones not loaded
    yet. ``versions`` is the worker's map of the weight version each rollout engine holds,
    updated at each load."""

    def __init__(self, versions: dict[str, int]) -> None:
        self.versions = versions
        self._staged: dict[str, tuple[int, list[dict], Callable | None]] = {}
        self._lock = threading.Lock()

    def stage(self, model: str, version: int, buckets: list[dict], check: Callable | None = None) -> None:
        with self._lock:
            self._staged[model] = (version, buckets, check)

    def take(self, model: str) -> tuple[int, list[dict], Callable | None] | None:
        with self._lock:
            return self._staged.pop(model, None)

    def load(self, model: str, engine: RolloutEngine) -> None:
        """Load weights staged since the last generation (and verify them)."""
        staged = self.take(model)
        if staged is not None:
            version, buckets, check = staged
            engine.load_weights(bucket_items(buckets))
            self.versions[model] = version
            if check is not None:
                check(engine)

    def updates(self, model: str, mode: str, versions: list[int]) -> WeightUpdates:
        """The staged weights, polled between decoding steps by the engine; each load appends
        its version to ``versions`` and becomes the rollout's version. A load between two
        decoding steps is not verified (the engine is mid-generation): the next load between
        generations is."""

        def poll():
            staged = self.take(model)
            if staged is None:
                return None
            version, buckets, _ = staged
            versions.append(version)
            self.versions[model] = version
            return bucket_items(buckets)

        return WeightUpdates(poll=poll, mode=mode)


def receive(
    model: str, published: list, engine: RolloutEngine, staged: StagedWeights, partial: bool,
    check: SyncCheck | None = None,
) -> dict[str, float]:
    """Load what rank 0 of the training pool published (``published``: ``[ref]``, the ref of its
    ``publish`` result) into ``engine``, fetching one bucket at a time into one load (a vLLM
    engine takes whole weight sets); later samples carry the published version. ``partial``:
    fetch all buckets and stage them for the generation to load. ``check``: verify the load
    against the published probe (``rollout.verify_sync``)."""
    start = time.perf_counter()
    (offer,) = ray.get(published)
    verify = None

    def fetched():  # one bucket in memory at a time, all in one load (vLLM needs whole sets)
        for ref in offer["buckets"]:
            yield from ray.get(ref).items()

    if check is not None and offer["probe"] is not None:
        probe, version = offer["probe"], offer["version"]
        verify = lambda loaded: check(loaded, probe, version, fetched)  # noqa: E731
    if partial:
        staged.stage(model, offer["version"], ray.get(list(offer["buckets"])), verify)
        return {**offer["metrics"], "timing/weight_sync": time.perf_counter() - start}

    engine.load_weights(fetched())
    staged.versions[model] = offer["version"]
    metrics = {**offer["metrics"], "timing/weight_sync": time.perf_counter() - start}
    if verify is not None:
        metrics.update(verify(engine))
    return metrics
