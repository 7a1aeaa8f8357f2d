"""Rollout vs training log-prob consistency: the check that the rollout engine sampled from the
policy the train engine is about to update.

The update's first forward (before any optimizer step) already computes the training log-probs
of the sampled tokens; ``ConsistencyStats.add`` takes them there, next to the rollout engine's
``rollout_log_probs``, so the check costs no extra forward pass. A rollout engine that generated
from stale weights (a skipped weight sync, a stale prefix cache, an un-repacked head) or at
another temperature shows up as a large difference; the run then stops, because a silent
mismatch trains the wrong objective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ConsistencyStats", "RolloutMismatchError", "check_consistency"]


class RolloutMismatchError(RuntimeError):
    """Rollout and training log-probs of the same tokens differ by more than the tolerance."""


class ConsistencyStats:
    """Accumulates |train - rollout| log-prob differences and importance ratios over tokens.

    ``add`` is called once per micro-batch of the first optimizer step; ``reduce`` combines them
    over the data-parallel group (sums add, maxima take the max), so every rank gets the
    whole mini-batch's numbers.
    """

    def __init__(self) -> None:
        self.num_tokens = 0.0
        self.diff_sum = 0.0
        self.diff_max = 0.0
        self.ratio_sum = 0.0
        self.ratio_max = 0.0
        self.neg_ratio_max = -float("inf")  # -min(ratio)
        self.frozen = False  # set after the first optimizer step: later forwards are off-policy

    @torch.no_grad()
    def add(
        self, log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
    ) -> None:
        """log_probs, rollout_log_probs: (B, R) float; response_mask: (B, R) 0/1."""
        if self.frozen:
            return
        mask = response_mask.to(torch.bool)
        if not bool(mask.any()):
            return
        delta = (log_probs.detach().double() - rollout_log_probs.double())[mask]
        ratio = delta.exp()  # pi_train / pi_rollout per token
        self.num_tokens += float(mask.sum())
        self.diff_sum += float(delta.abs().sum())
        self.diff_max = max(self.diff_max, float(delta.abs().max()))
        self.ratio_sum += float(ratio.sum())
        self.ratio_max = max(self.ratio_max, float(ratio.max()))
        self.neg_ratio_max = max(self.neg_ratio_max, float(-ratio.min()))

    def reduce(self, process_group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Metrics over the whole group: ``rollout_log_prob_diff_{mean,max}``,
        ``rollout_ratio_{mean,min,max}``; empty when no token was seen anywhere."""
        sums = torch.tensor([self.num_tokens, self.diff_sum, self.ratio_sum], dtype=torch.float64)
        maxima = torch.tensor(
            [self.diff_max, self.ratio_max, self.neg_ratio_max], dtype=torch.float64
        )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=process_group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=process_group)
        num_tokens, diff_sum, ratio_sum = sums.tolist()
        if num_tokens == 0:
            return {}
        diff_max, ratio_max, neg_ratio_max = maxima.tolist()
        return {
            "rollout_log_prob_diff_mean": diff_sum / num_tokens,
            "rollout_log_prob_diff_max": diff_max,
            "rollout_ratio_mean": ratio_sum / num_tokens,
            "rollout_ratio_min": -neg_ratio_max,
            "rollout_ratio_max": ratio_max,
        }


def check_consistency(
    metrics: dict[str, float], tolerance: float | None, *, model: str, engine: str
) -> None:
    """Raise RolloutMismatchError (one line: what, how much, which setting) when the mean
    absolute difference exceeds ``tolerance``; ``None`` only reports."""
    if tolerance is None or "rollout_log_prob_diff_mean" not in metrics:
        return
    mean = metrics["rollout_log_prob_diff_mean"]
    if not mean <= tolerance:  # NaN fails too
        raise RolloutMismatchError(
            f"rollout/training log-prob mismatch on model {model!r} (rollout.engine={engine}): "
            f"mean |diff| {mean:.3g} > models.{model}.rollout.log_prob_tolerance={tolerance:g} "
            f"(max |diff| {metrics['rollout_log_prob_diff_max']:.3g}, importance ratio "
            f"{metrics['rollout_ratio_min']:.3g}..{metrics['rollout_ratio_max']:.3g}); the rollout "
            "engine is not sampling from the weights being trained (stale weight sync?), stopping"
        )
