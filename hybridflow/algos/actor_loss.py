"""The actor update's loss: the registered policy loss, rollout-correction weights, the KL and
entropy terms, and the aggregation, as one ``loss_fn(mini_batch, forward_out)`` for a train
engine's ``train_step``.

``opts`` holds the update node's options (``spec.graph.UpdateOptions``: ``policy_loss``, the
clip ratios, ``kl_coef``, ``kl_estimator``, ``kl_bound``, ``entropy_coef``, ``loss_agg``,
``old_log_probs``); it is read, never imported here, so this module stays pure tensor math.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from hybridflow.algos.kl import kl_penalty
from hybridflow.algos.losses import POLICY_LOSSES, agg_loss, masked_mean
from hybridflow.data import keys as K

LossFn = Callable[[TensorDict, dict[str, torch.Tensor]], tuple[torch.Tensor, dict]]


class RolloutLogProbStats(Protocol):
    """Collects how far the trainer's log-probs are from the rollout engine's
    (``hybrid_engine.consistency.ConsistencyStats``)."""

    def add(self, log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> None: ...


def old_log_probs(opts: Any, mb: TensorDict, log_probs: torch.Tensor) -> torch.Tensor:
    """(B, R) pi_old of the PPO ratio (``UpdateOptions.old_log_probs``): the rollout engine's
    log-probs, or the recomputed ``old_log_probs`` (decoupled PPO); without that input the
    update is on-policy (one step): old = the current forward, detached. With rollout
    correction the ratio stays pi_theta / pi_old and the detached IS weight pi_old /
    pi_rollout multiplies the per-token policy loss; for gspo the ratio is the sequence's
    (geometric mean) and the weight still per token (use is_level sequence or geometric for
    one weight per sequence); for cispo the clipped weight pi_theta / pi_old and the IS
    weight multiply (AReaL's decoupled objective in REINFORCE form)."""
    if opts.old_log_probs == "rollout":
        return mb[K.ROLLOUT_LOG_PROBS]
    return mb[K.OLD_LOG_PROBS] if K.OLD_LOG_PROBS in mb.keys() else log_probs.detach()


def policy_loss_fn(opts: Any, rollout_stats: RolloutLogProbStats | None = None) -> LossFn:
    """The actor's ``loss_fn(mb, out)``: ``out`` holds the forward's ``log_probs`` and
    ``entropy`` (B, R) and the global ``num_global_tokens`` / ``num_global_seqs`` the loss is
    normalised by; returns the scalar loss and the step's metrics."""
    policy_loss = POLICY_LOSSES.get(opts.policy_loss)

    def loss_fn(mb: TensorDict, out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        log_probs = out["log_probs"]
        response_mask = mb[K.RESPONSE_MASK]
        old = old_log_probs(opts, mb, log_probs)
        loss_mat, metrics = policy_loss(
            log_probs=log_probs,
            old_log_probs=old,
            advantages=mb[K.ADVANTAGES],
            response_mask=response_mask,
            clip_ratio=opts.clip_ratio,
            clip_ratio_low=opts.clip_ratio_low,
            clip_ratio_high=opts.clip_ratio_high,
            clip_ratio_c=opts.clip_ratio_c,
        )
        if K.ROLLOUT_IS_WEIGHTS in mb.keys():  # rollout correction: policy term only
            loss_mat = loss_mat * mb[K.ROLLOUT_IS_WEIGHTS]
        metrics["pg_loss"] = float(agg_loss(loss_mat.detach(), response_mask))
        if K.OLD_LOG_PROBS not in mb.keys():  # no log_prob node on the actor to report it
            metrics["entropy"] = float(masked_mean(out["entropy"].detach(), response_mask))
        if opts.kl_coef > 0:
            kl = kl_penalty(log_probs, mb[K.REF_LOG_PROBS], opts.kl_estimator, opts.kl_bound)
            loss_mat = loss_mat + opts.kl_coef * kl
            metrics["kl"] = float(masked_mean(kl.detach(), response_mask))
        elif K.REF_LOG_PROBS in mb.keys():  # no KL term: the distance to the ref is watched only
            with torch.no_grad():
                kl = kl_penalty(log_probs, mb[K.REF_LOG_PROBS], opts.kl_estimator, opts.kl_bound)
            metrics["kl"] = float(masked_mean(kl, response_mask))
        if opts.entropy_coef:
            loss_mat = loss_mat - opts.entropy_coef * out["entropy"]
        if rollout_stats is not None and K.ROLLOUT_LOG_PROBS in mb.keys():
            checked = response_mask
            if K.ROLLOUT_LOG_PROBS_RECORDED in mb.keys():  # a sample of rows (log_prob_check_samples)
                checked = response_mask * mb[K.ROLLOUT_LOG_PROBS_RECORDED].unsqueeze(-1).to(response_mask.dtype)
            rollout_stats.add(log_probs, mb[K.ROLLOUT_LOG_PROBS], checked)
        loss = agg_loss(
            loss_mat,
            response_mask,
            opts.loss_agg,
            normalizer=out["num_global_tokens"],
            num_seqs=out["num_global_seqs"],
        )
        return loss, metrics

    return loss_fn
