"""``advantage``: the node's registered estimator (``hybridflow.algos``) on this rank's whole
prompt groups; batch statistics the estimator needs all-reduced over the data-parallel group,
logged means sent to the controller as sums (``algo_steps.Ratios``)."""

from __future__ import annotations

from tensordict import TensorDict

from hybridflow.graph.dag import Node
from hybridflow.workers import algo_steps
from hybridflow.workers.context import WorkerContext


def advantage(ctx: WorkerContext, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    reduce_sum = algo_steps.dp_sum(ctx.dp_group(node.model))
    result, metrics, ratios = algo_steps.compute_advantages(batch, node, ctx.extra_state, reduce_sum)
    return result, {"metrics": metrics, "ratios": dict(ratios)}
