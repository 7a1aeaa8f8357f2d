"""``update``: the actor's policy update (then its rollout engine takes the new weights) and the
critic's value update. The losses are on the algorithm side: ``hybridflow.algos.actor_loss``
and ``hybridflow.workers.algo_steps``; this module is the plumbing around them."""

from __future__ import annotations

import resource

import psutil
from tensordict import TensorDict

from hybridflow.algos.actor_loss import LossFn, policy_loss_fn
from hybridflow.data import keys as K
from hybridflow.graph.dag import Node
from hybridflow.hybrid_engine.consistency import ConsistencyStats, check_consistency
from hybridflow.spec.graph import UpdateOptions
from hybridflow.workers import algo_steps
from hybridflow.workers.context import WorkerContext


def memory_metrics() -> dict[str, float]:
    """This worker process's resident memory now and at its peak (bytes; averaged over the
    ranks in the iteration's metrics): what a pool's hosts must hold per device."""
    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the kernel's high-water mark
    return {"memory/rss_bytes": float(rss), "memory/peak_rss_bytes": float(max(peak, rss))}


def update_policy(ctx: WorkerContext, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    """The actor's update; then its rollout engine takes the new weights."""
    opts: UpdateOptions = node.spec.options
    model, spec = node.model, ctx.spec
    dp_group = ctx.dp_group(model)
    extra: dict[str, float] = {}
    if opts.mask_truncated:  # DAPO's overlong filtering: truncated rows leave the loss
        kept = ~batch[K.TRUNCATED].bool()
        batch[K.RESPONSE_MASK] = batch[K.RESPONSE_MASK] * kept.unsqueeze(-1).to(batch[K.RESPONSE_MASK].dtype)
        extra["actor/masked_truncated_frac"] = float((~kept).float().mean())
    if opts.safety is not None:
        lagrange = ctx.extra_state[f"lagrange/{node.name}"]
        extra.update(algo_steps.apply_safety(batch, opts, lagrange, algo_steps.dp_sum(dp_group)))
    algo_steps.check_rollout_log_probs_recorded(batch, opts, node.name)
    if opts.rollout_correction is not None:
        extra.update(algo_steps.apply_rollout_correction(batch, opts, dp_group))
    if model in ctx.train_versions and K.WEIGHT_VERSION in batch.keys():
        extra.update(algo_steps.staleness(batch, ctx.train_versions[model], dp_group))
        bound = spec.trainer.async_
        assert bound.mode == "sync" or extra["async/staleness_max"] <= bound.max_staleness, (
            f"samples {extra['async/staleness_max']:g} updates old > trainer.async.max_staleness"
        )
    rollout_stats = ConsistencyStats()
    metrics = train(ctx, batch, node, policy_loss_fn(opts, rollout_stats), rollout_stats)
    metrics.update(extra)
    # Same numbers on every rank (reduced over the DP group): all ranks stop together.
    consistency = rollout_stats.reduce(dp_group)
    metrics.update({f"actor/{k}": v for k, v in consistency.items()})
    rollout = spec.models[model].rollout
    # Off-policy modes train on samples of older weights by design: report, do not stop.
    if rollout is not None and spec.trainer.async_.synchronous:
        check_consistency(consistency, rollout.log_prob_tolerance, model=model, engine=rollout.engine)
    if model in ctx.train_versions:
        ctx.train_versions[model] += 1
    if model in ctx.rollout_engines:
        metrics.update(ctx.sync_rollout(model))
    metrics.update(memory_metrics())
    return TensorDict({}, batch_size=batch.batch_size), {"metrics": metrics}


def update_critic(ctx: WorkerContext, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    opts: UpdateOptions = node.spec.options
    values_field, returns_field = algo_steps.critic_fields(node)
    loss_fn = algo_steps.critic_loss(opts, values_field, returns_field)
    metrics = train(ctx, batch, node, loss_fn)
    metrics[f"{node.model}/explained_var"] = algo_steps.critic_explained_variance(
        batch, values_field, returns_field, algo_steps.dp_sum(ctx.dp_group(node.model))
    )
    return TensorDict({}, batch_size=batch.batch_size), {"metrics": metrics}


def train(
    ctx: WorkerContext, batch: TensorDict, node: Node, loss_fn: LossFn, rollout_stats: ConsistencyStats | None = None
) -> dict[str, float]:
    """``epochs`` passes of ``mini_batches`` optimizer steps; the steps' metrics averaged,
    under ``actor/`` for the actor and ``<model>/`` otherwise."""
    opts: UpdateOptions = node.spec.options
    engine = ctx.train_engines[node.model]
    steps = []
    for _ in range(opts.epochs):
        for mini_batch in batch.chunk(opts.mini_batches):
            steps.append(engine.train_step(mini_batch, loss_fn, ctx.temperature()))
            if rollout_stats is not None:
                rollout_stats.frozen = True  # later forwards come after an optimizer step
    prefix = "actor" if node.role == "actor" else node.model
    return {f"{prefix}/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]}
