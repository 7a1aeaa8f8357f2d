"""Moving the actor's fresh weights from its train engine to its rollout engine.

With the torch train engine and the transformers rollout engine in one process under the same
layout, the rollout engine generates from the train engine's own module: ``load_weights`` finds
every tensor already in place and copies nothing, so no weight is held twice. Engines that keep
their own copy (vLLM) or another layout (megatron TP -> generation TP) take the weights through
``load_weights``; resharding between layouts lives beside this module.
"""

from __future__ import annotations

import time

from hybridflow.engines.base import RolloutEngine, TrainEngine


def sync_weights(train: TrainEngine, rollout: RolloutEngine) -> dict[str, float]:
    """Push ``train``'s current weights into ``rollout``; returns timing metrics."""
    start = time.perf_counter()
    rollout.load_weights(train.named_weights())
    return {"timing/weight_sync": time.perf_counter() - start}
