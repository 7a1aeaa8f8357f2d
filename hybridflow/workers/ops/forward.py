"""``log_prob`` and ``values``: one forward pass of a train engine over the responses."""

from __future__ import annotations

from tensordict import TensorDict

from hybridflow.algos import masked_mean
from hybridflow.data import keys as K
from hybridflow.graph.dag import Node
from hybridflow.workers.context import WorkerContext


def log_prob(ctx: WorkerContext, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    """The responses' (B, R) log-probs under the node's model (actor: ``old_log_probs``, ref:
    ``ref_log_probs``, teacher: ``teacher_log_probs``), at the actor's sampling temperature: the
    distribution the student sampled from is the one a teacher is compared with."""
    out = ctx.train_engines[node.model].forward(batch, ctx.temperature())
    result = TensorDict({node.outputs[0]: out["log_probs"]}, batch_size=batch.batch_size)
    metrics = {}
    if node.role == "actor":  # the policy's entropy; a reference model's is not reported
        metrics["actor/entropy"] = float(masked_mean(out["entropy"], batch[K.RESPONSE_MASK]))
    return result, {"metrics": metrics}


def values(ctx: WorkerContext, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    """The critic's (B, R) value estimates."""
    estimates = ctx.train_engines[node.model].forward(batch)[K.VALUES]
    result = TensorDict({node.outputs[0]: estimates}, batch_size=batch.batch_size)
    metrics = {f"{node.model}/values_mean": float(masked_mean(estimates, batch[K.RESPONSE_MASK]))}
    return result, {"metrics": metrics}
