"""``filter``: dynamic sampling's filter (DAPO)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from hybridflow.algos import informative_groups
from hybridflow.data import keys as K
from hybridflow.graph.dag import Node
from hybridflow.graph.ops import graph_keys
from hybridflow.workers.context import WorkerContext


def filter_groups(ctx: WorkerContext, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    """This rank's rows (whole prompt groups) with the groups whose scores differ first, then
    the others; ``kept_rows`` counts the first ones (the controller takes prefixes,
    ``controller.executor.run_refilling``)."""
    scores = batch[graph_keys()[node.slots["score"]][0]].float()
    keep = informative_groups(scores, batch[K.UID])
    order = torch.cat([keep.nonzero()[:, 0], (~keep).nonzero()[:, 0]])
    return batch[order], {"kept_rows": int(keep.sum())}
