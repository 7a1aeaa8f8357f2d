"""``pair_update``: a reward or cost model trained on preference pairs. The loss is on the
algorithm side (``hybridflow.algos.preference``), the pair layout in
``hybridflow.data.preferences``; this is the plumbing around them."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from hybridflow.algos.preference import pairwise_metrics
from hybridflow.algos.registry import PAIR_LOSSES
from hybridflow.data.preferences import pair_forward_batch, pair_loss_inputs, split_pair_scores
from hybridflow.graph.dag import Node
from hybridflow.spec.graph import PairUpdateOptions
from hybridflow.workers import algo_steps
from hybridflow.workers.context import WorkerContext


def pair_update(ctx: WorkerContext, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    """``epochs`` passes of ``mini_batches`` optimizer steps over this rank's pairs (kept whole:
    pairs are the batch dimension), or one scoring forward with ``train: false``. Metrics:
    ``rm/accuracy``, ``rm/margin_mean``, ``rm/chosen_mean``, ``rm/rejected_mean`` over every
    rank's pairs, from the scores the steps saw (before each step), and the loss terms."""
    opts: PairUpdateOptions = node.spec.options
    engine = ctx.train_engines[node.model]
    reduce_sum = algo_steps.dp_sum(ctx.dp_group(node.model))
    if not opts.train:
        chosen, rejected = split_pair_scores(engine.forward(pair_forward_batch(batch))["last_values"])
        return TensorDict({}, batch_size=batch.batch_size), {"metrics": pairwise_metrics(chosen, rejected, reduce_sum)}
    loss = PAIR_LOSSES.get(opts.loss)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def loss_fn(mb: TensorDict, out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        inputs = pair_loss_inputs(mb, out["last_values"])
        if opts.loss == "safe_rlhf_cost" and "chosen_signs" not in inputs:
            raise ValueError(f"node {node.name!r}: loss safe_rlhf_cost needs safety labels (PKU-SafeRLHF cost pairs)")
        inputs["margin"] = inputs["margin"] + opts.margin
        seen.append((inputs["chosen_scores"].detach(), inputs["rejected_scores"].detach()))
        # every rank's pairs of the mini-batch: the engine's sum over micro-batches and ranks
        # is then the mini-batch mean
        num_pairs = out["num_global_seqs"] / 2
        value, metrics = loss(**inputs, center_coef=opts.center_coef, num_pairs=num_pairs)
        # The loss terms come as this micro-batch's share of the mini-batch loss; the engine
        # averages metrics over micro-batches and ranks, so report each as a mean per pair.
        scale = float(num_pairs) / max(inputs["chosen_scores"].shape[0], 1)
        return value, {k: v * scale if k.endswith("_loss") else v for k, v in metrics.items()}

    steps = []
    for _ in range(opts.epochs):
        for pairs in batch.chunk(opts.mini_batches):  # whole pairs in each mini-batch
            steps.append(engine.train_step(pair_forward_batch(pairs), loss_fn))
    # the loss's own terms keep their rm/ names; the engine's (loss, grad_norm, lr) the model's
    metrics = {k if k.startswith("rm/") else f"{node.model}/{k}": sum(s[k] for s in steps) / len(steps)
               for k in steps[0]}
    chosen = torch.cat([c for c, _ in seen])
    rejected = torch.cat([r for _, r in seen])
    metrics.update(pairwise_metrics(chosen, rejected, reduce_sum))
    return TensorDict({}, batch_size=batch.batch_size), {"metrics": metrics}
