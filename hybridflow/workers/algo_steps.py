"""The algorithm side of the worker ops: which batch fields feed which estimator or loss.

The ``advantage`` and ``update`` op bodies (``hybridflow.workers.ops``) call these; the math itself is
in ``hybridflow.algos``. Graph keys decide the fields: an advantage node reading ``costs`` and
``cost_values`` and writing ``cost_advantages`` runs the same estimator as one reading
``scores`` and ``values`` and writing ``advantages``, on the cost fields. Which key fills which
role is the op record's ``slots`` (``hybridflow.graph.ops``), checked when the graph is
validated; ``graph_keys()`` gives each key's batch fields.

Each rank holds whole prompt groups (the DP split keeps them together), so group statistics
are local. Batch-wide statistics that the math needs (whitening, ``scope: batch``, the adaptive
KL-in-reward mean, the mean cost of the Lagrangian) and the critic's explained variance (a
logged ratio of variances, not yet sent as sums) all-reduce their partial sums over the data-parallel group (``dp_sum``): no rank gathers the batch, and the
result does not depend on the number of ranks (up to float rounding of the sums). A statistic
that is only logged takes no collective: it leaves the rank as a ``Ratios`` entry (numerator and
denominator), which the controller adds over the ranks and divides.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from hybridflow.algos import (
    ADV_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    LagrangeMultiplier,
    agg_loss,
    clipped_value_loss,
    correction_metrics,
    correction_stats,
    explained_variance,
    kl_penalty,
    local_sum,
    masked_mean,
    rollout_correction,
    safe_rlhf_advantage,
)
from hybridflow.algos.losses import ReduceSum
from hybridflow.algos.running_moments import RunningMoments
from hybridflow.data import keys as K
from hybridflow.data.batch import place_sequence_reward
from hybridflow.graph.dag import Node
from hybridflow.graph.ops import graph_keys
from hybridflow.spec.graph import AdvantageOptions, GraphSpec, ScoreOptions, UpdateOptions


def _fields(node: Node, slot: str) -> tuple[str, ...] | None:
    """The batch fields of the node's key in ``slot`` (None: an optional slot it left empty)."""
    key = node.slots[slot]
    return None if key is None else graph_keys()[key]


def dp_sum(group: dist.ProcessGroup | None = None) -> ReduceSum:
    """The ``reduce_sum`` of a batch split over the data-parallel ranks ``group``: an all-reduce
    of the statistic's partial sums (``local_sum`` without a process group or with one rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return local_sum

    def reduce_sum(sums: torch.Tensor) -> torch.Tensor:
        sums = sums.detach().clone()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        return sums

    return reduce_sum


def build_controllers(spec: GraphSpec, models: list[str]) -> dict[str, Any]:
    """The state the algorithm keeps across iterations, for the nodes these workers run.

    ``kl_ctrl/<node>``: KL-in-reward coefficient of an advantage node with ``kl_coef > 0``;
    ``lagrange/<node>``: the Lagrange multiplier of a Safe-RLHF actor update;
    ``score_moments/<node>``: the running moments a score node normalises by. Each object has
    ``state_dict``/``load_state_dict`` (the worker checkpoints them).
    """
    state: dict[str, Any] = {}
    for node in spec.nodes:
        if node.model not in models:
            continue
        opts = node.options
        if isinstance(opts, AdvantageOptions) and opts.kl_coef > 0:
            if opts.kl_target is None:
                state[f"kl_ctrl/{node.name}"] = FixedKLController(opts.kl_coef)
            else:
                state[f"kl_ctrl/{node.name}"] = AdaptiveKLController(
                    opts.kl_coef, opts.kl_target, opts.kl_horizon
                )
        if isinstance(opts, ScoreOptions) and opts.normalize:
            state[f"score_moments/{node.name}"] = RunningMoments()
        if isinstance(opts, UpdateOptions) and opts.safety is not None:
            safety = opts.safety
            state[f"lagrange/{node.name}"] = LagrangeMultiplier(
                safety.lambda_init, safety.lambda_lr, safety.cost_threshold, safety.lambda_max
            )
    return state


class Ratios(dict):
    """Metrics that leave a rank as partial sums (``name -> [numerator, denominator]``), for the
    controller to add over the ranks and divide (``controller.metrics.reduce_metas``): a mean
    over a batch split across ranks, without a collective."""

    def masked_mean(self, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Add ``values`` (B, R) where ``mask`` is 1 to the mean ``name``."""
        mask = mask.to(torch.float64)
        total, count = float((values.to(torch.float64) * mask).sum()), float(mask.sum())
        numerator, denominator = self.get(name, (0.0, 0.0))
        self[name] = [numerator + total, denominator + count]

    def means(self) -> dict[str, float]:
        """The means of this rank's part alone (0 where the denominator is 0)."""
        return {name: num / den if den else 0.0 for name, (num, den) in self.items()}


def compute_advantages(
    batch: TensorDict, node: Node, state: dict[str, Any], reduce_sum: ReduceSum = local_sum
) -> tuple[TensorDict, dict[str, float], Ratios]:
    """Run the advantage node's estimator on this rank's part of the batch (whole prompt
    groups; batch statistics through ``reduce_sum``); returns its advantages and returns, the
    metrics that are the same on every rank, and the logged means as this rank's ``Ratios``."""
    opts: AdvantageOptions = node.spec.options
    score_field = _fields(node, "score")[0]
    values_field = _fields(node, "values")
    out_fields = _fields(node, "advantages")
    fields = {"scores": batch[score_field].float(), "response_mask": batch[K.RESPONSE_MASK]}
    if K.UID in batch.keys():
        fields["uid"] = batch[K.UID]
    if values_field is not None:
        fields["values"] = batch[values_field[0]]
    if "baseline_scores" in node.inputs:
        fields["baseline_scores"] = batch[K.BASELINE_SCORES].float()
    if opts.kl_coef > 0:
        missing = [k for k in ("old_log_probs", "ref_log_probs") if k not in node.inputs]
        if missing:
            raise ValueError(f"advantage node {node.name!r}: kl_coef > 0 (KL in the reward) needs inputs {missing}")
        fields["old_log_probs"] = batch[K.OLD_LOG_PROBS]
        fields["ref_log_probs"] = batch[K.REF_LOG_PROBS]
    mask = fields["response_mask"]
    token_rewards = place_sequence_reward(fields["scores"], mask)
    prefix = "cost_" if out_fields[0] == K.COST_ADVANTAGES else ""
    metrics: dict[str, float] = {}
    ratios = Ratios()
    if "teacher_log_probs" in node.inputs:
        teacher, student = batch[K.TEACHER_LOG_PROBS].float(), _student_log_probs(batch, node)
        fields["teacher_log_probs"], fields["student_log_probs"] = teacher, student
        ratios.masked_mean("distill/reverse_kl", student - teacher, mask)
        ratios.masked_mean("distill/teacher_log_prob", teacher, mask)
        ratios.masked_mean("distill/student_log_prob", student, mask)
    if opts.kl_coef > 0:
        controller = state[f"kl_ctrl/{node.name}"]
        kl = kl_penalty(
            fields.pop("old_log_probs"), fields.pop("ref_log_probs"), opts.kl_estimator, opts.kl_bound
        )
        kl = kl * mask
        token_rewards = token_rewards - controller.value * kl
        ratios.masked_mean(f"{prefix}reward_kl/mean", kl, mask)
        metrics[f"{prefix}reward_kl/coef"] = controller.value
        if isinstance(controller, AdaptiveKLController):  # its step needs the whole batch's KL
            mean_kl = float(masked_mean(kl, mask, reduce_sum))
            num_samples = int(reduce_sum(torch.tensor(float(mask.shape[0]))))
            controller.update(mean_kl, num_steps=num_samples)
    estimator_options = opts.model_dump(
        exclude={"estimator", "kl_coef", "kl_estimator", "kl_bound", "kl_target", "kl_horizon", "student_log_probs"}
    )
    advantages, returns = ADV_ESTIMATORS.get(opts.estimator)(
        **fields, token_rewards=token_rewards, reduce_sum=reduce_sum, **estimator_options
    )
    ratios.masked_mean(f"{prefix}advantage/abs_mean", advantages.abs(), mask)
    ratios.masked_mean(f"{prefix}returns/mean", returns, mask)
    result = TensorDict(
        {out_fields[0]: advantages.float(), out_fields[1]: returns.float()}, batch_size=batch.batch_size
    )
    return result, metrics, ratios


def _student_log_probs(batch: TensorDict, node: Node) -> torch.Tensor:
    """A distillation advantage's student log-probs: the ``old_log_probs`` input, or with
    ``student_log_probs: rollout`` the rollout engine's, which it recorded for every sample."""
    if node.spec.options.student_log_probs == "recomputed":
        return batch[K.OLD_LOG_PROBS].float()
    require_rollout_log_probs(batch, f"advantage {node.name!r} (student_log_probs: rollout)")
    return batch[K.ROLLOUT_LOG_PROBS].float()


def apply_safety(
    batch: TensorDict, opts: UpdateOptions, node_state: LagrangeMultiplier, reduce_sum: ReduceSum = local_sum
) -> dict[str, float]:
    """Safe-RLHF: step lambda on the batch's mean episode cost, then combine the advantages.

    Overwrites ``batch[advantages]`` with ``(A - lambda * A_cost) / (1 + lambda)``, lambda taken
    after this batch's ascent step. Returns ``safety/*`` metrics.
    """
    for field in (K.COSTS, K.COST_ADVANTAGES):
        if field not in batch.keys():
            raise ValueError(f"a safety update needs '{field}' among its inputs")
    costs = batch[K.COSTS].float()
    total, count = reduce_sum(torch.stack([costs.sum(), torch.tensor(float(costs.numel()))]))
    mean_cost = float(total / count)
    lagrange_lambda = node_state.update(mean_cost)
    batch[K.ADVANTAGES] = safe_rlhf_advantage(
        batch[K.ADVANTAGES], batch[K.COST_ADVANTAGES], lagrange_lambda
    )
    return {
        "safety/lambda": lagrange_lambda,
        "safety/mean_cost": mean_cost,
        "safety/cost_margin": mean_cost - opts.safety.cost_threshold,
    }


def require_rollout_log_probs(batch: TensorDict, reader: str) -> None:
    """Refuses a batch without the rollout's log-probs of every sample (a rollout records them
    for only some with ``rollout.log_prob_check_samples``) for ``reader``, which needs them."""
    recorded = batch.get(K.ROLLOUT_LOG_PROBS_RECORDED, None)
    if K.ROLLOUT_LOG_PROBS not in batch.keys() or (recorded is not None and not bool(recorded.all())):
        raise ValueError(f"{reader} needs the rollout's log-probs of every sample; this rollout recorded "
                         "them for only some or none (rollout.log_prob_check_samples)")


def check_rollout_log_probs_recorded(batch: TensorDict, opts: UpdateOptions, node_name: str) -> None:
    """An update that reads ``rollout_log_probs`` (``rollout_correction``, ``old_log_probs:
    rollout``) needs every sample's (``require_rollout_log_probs``)."""
    if opts.rollout_correction is not None or opts.old_log_probs == "rollout":
        require_rollout_log_probs(batch, f"update {node_name!r} (reads rollout_log_probs)")


def apply_rollout_correction(
    batch: TensorDict, opts: UpdateOptions, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Rollout correction of an actor update (``opts.rollout_correction``), once per rollout
    batch, before any optimizer step: the weights compare ``old_log_probs`` with
    ``rollout_log_probs``, neither of which changes during the update.

    Writes ``batch[rollout_is_weights]`` (B, R) and narrows ``batch[response_mask]`` to the kept
    tokens (so they also leave the loss's token count). Returns ``rollout_corr/*`` metrics over
    the whole batch: sums added and extremes taken over the data-parallel ``group``.
    """
    corr = opts.rollout_correction
    for field in (K.OLD_LOG_PROBS, K.ROLLOUT_LOG_PROBS):
        if field not in batch.keys():
            raise ValueError(f"a rollout_correction update needs '{field}' among its inputs")
    mask = batch[K.RESPONSE_MASK]
    correction = rollout_correction(
        batch[K.OLD_LOG_PROBS], batch[K.ROLLOUT_LOG_PROBS], mask,
        corr.is_level, corr.is_cap, corr.reject_level, corr.reject_low, corr.reject_high,
    )
    sums, extremes = correction_stats(correction, mask)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    batch[K.ROLLOUT_IS_WEIGHTS] = correction.weights.float()
    batch[K.RESPONSE_MASK] = correction.keep_mask.to(mask.dtype)
    return {f"rollout_corr/{k}": v for k, v in correction_metrics(sums, extremes).items()}


def staleness(batch: TensorDict, version: int, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """``async/staleness_{mean,max}``: how many actor updates behind ``version`` (the train
    engine's, before this update) the samples' ``weight_version`` tags are, over the whole batch
    (data-parallel ``group``). 0 in sync mode; 1 in one-step off-policy.
    ``async/staleness_last_mean``: the same for ``weight_version_last``, the weights of each
    sample's last token (lower than the mean when partial rollouts took newer weights)."""
    lag = (version - batch[K.WEIGHT_VERSION]).double()
    last = batch[K.WEIGHT_VERSION_LAST] if K.WEIGHT_VERSION_LAST in batch.keys() else batch[K.WEIGHT_VERSION]
    sums = torch.stack([lag.sum(), (version - last).double().sum(), torch.tensor(float(lag.numel()), dtype=torch.float64)])
    top = lag.max() if lag.numel() else torch.tensor(0.0, dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    count = sums[2].clamp(min=1)
    return {"async/staleness_mean": float(sums[0] / count), "async/staleness_max": float(top),
            "async/staleness_last_mean": float(sums[1] / count)}


def critic_fields(node: Node) -> tuple[str, str]:
    """(old values field, returns field) of a critic update node."""
    return _fields(node, "values")[0], _fields(node, "advantages")[1]


def critic_loss(opts: UpdateOptions, values_field: str, returns_field: str):
    """``loss_fn(micro_batch, forward_out)`` of a critic update (clipped value loss)."""

    def loss_fn(mb: TensorDict, out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        response_mask = mb[K.RESPONSE_MASK]
        loss_mat, metrics = clipped_value_loss(
            out[K.VALUES], mb[values_field], mb[returns_field], response_mask, opts.value_clip
        )
        metrics["vf_loss"] = float(agg_loss(loss_mat.detach(), response_mask))
        loss = agg_loss(
            loss_mat,
            response_mask,
            opts.loss_agg,
            normalizer=out["num_global_tokens"],
            num_seqs=out["num_global_seqs"],
        )
        return loss, metrics

    return loss_fn


def critic_explained_variance(
    batch: TensorDict, values_field: str, returns_field: str, reduce_sum: ReduceSum = local_sum
) -> float:
    """Explained variance of the values the advantages were computed with, whole batch."""
    return explained_variance(batch[values_field], batch[returns_field], batch[K.RESPONSE_MASK], reduce_sum)
