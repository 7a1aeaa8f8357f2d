"""Rollout correction: importance weights and rejection masks between the trainer's policy and
the policy the rollout engine sampled with.

Two policies score every sampled token:

- ``pi_old``: the actor at the trainer's weights before the update, recomputed by a ``log_prob``
  node (``old_log_probs``). The PPO ratio is ``pi_theta / pi_old`` (decoupled PPO, as in AReaL:
  the clip is a trust region around ``pi_old``, not around the sampler).
- ``pi_rollout``: the behaviour policy, the log-probs the rollout engine sampled with
  (``rollout_log_probs``). It differs from ``pi_old`` when the sample is stale (async modes: it
  was generated with older weights) or when the two engines' numerics differ (vLLM vs torch, bf16
  vs fp32), also in sync mode.

The correction reweights or drops tokens by the *importance ratio* ``rho = pi_old / pi_rollout``
(detached: no gradient flows through it), at one of three levels (``IS_LEVELS``):

- ``token``: ``rho_t = exp(lo_t - lr_t)`` per token;
- ``sequence``: ``rho_i = exp(sum_t (lo_t - lr_t))``, the product over the valid tokens of row
  ``i``, on each of its tokens;
- ``geometric``: ``rho_i = exp(mean_t (lo_t - lr_t))``, the per-token geometric mean of row ``i``
  (length-normalised; a long sequence's product explodes or vanishes).

``lo``/``lr`` are the old / rollout log-probs. Log-ratios are clamped to [-20, 20] before
``exp`` (the sum, for ``sequence``), so weights stay finite in float32.

Two uses of a ratio:

- *truncated IS* (TIS): the loss of each token is multiplied by ``w = min(rho, cap)``;
- *rejection* (masked IS, MIS / IcePop): tokens (``token``) or whole rows (``sequence``,
  ``geometric``) whose ratio is outside ``[low, high]`` leave the loss (IcePop: token level,
  ``[0.5, 2]``; MIS: sequence level with ``low = 0``: a sequence whose ratio passes the cap is
  dropped rather than truncated).

Both are computed from the same ``response_mask``; the loss then uses ``response_mask & keep``
and ``w``. Shapes: B = samples, R = response length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.algos.registry import Registry

_MAX_LOG_RATIO = 20.0

IS_LEVELS: Registry = Registry("rollout correction level")


def _log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) ``old - rollout`` on valid tokens, 0 elsewhere, detached."""
    return (old_log_probs.detach() - rollout_log_probs.detach()) * mask


@IS_LEVELS.register("token")
def token_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token ratio ``exp(clamp(lo_t - lr_t))``: (B, R) in, (B, R) out, 0 outside the mask."""
    mask = response_mask.to(old_log_probs.dtype)
    log_ratio = _log_ratio(old_log_probs, rollout_log_probs, mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return log_ratio.exp() * mask


@IS_LEVELS.register("sequence")
def sequence_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-row ratio ``exp(clamp(sum_t (lo_t - lr_t)))`` on each valid token of the row: (B, R)
    in, (B, R) out, 0 outside the mask."""
    mask = response_mask.to(old_log_probs.dtype)
    seq = _log_ratio(old_log_probs, rollout_log_probs, mask).sum(-1).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return seq.exp().unsqueeze(-1) * mask


@IS_LEVELS.register("geometric")
def geometric_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-row geometric mean ratio ``exp(mean_t (lo_t - lr_t))`` over the row's valid tokens, on
    each valid token of the row: (B, R) in, (B, R) out, 0 outside the mask."""
    mask = response_mask.to(old_log_probs.dtype)
    lengths = mask.sum(-1).clamp(min=1)
    seq = (_log_ratio(old_log_probs, rollout_log_probs, mask).sum(-1) / lengths).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return seq.exp().unsqueeze(-1) * mask


@dataclass
class Correction:
    """What the loss uses: ``weights`` (B, R), the detached IS weight of each token (1 when IS is
    off, 0 outside ``keep_mask``); ``keep_mask`` (B, R) bool, the response tokens left in the
    loss; ``clipped_mask`` (B, R) bool, valid tokens whose ratio was truncated at the cap."""

    weights: torch.Tensor
    keep_mask: torch.Tensor
    clipped_mask: torch.Tensor


def rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    is_level: str | None = "token",
    is_cap: float = 2.0,
    reject_level: str | None = None,
    reject_low: float = 0.5,
    reject_high: float = 2.0,
) -> Correction:
    """Truncated IS weights and a rejection mask from ``pi_old / pi_rollout``.

    Args:
        old_log_probs: (B, R) float, ``pi_old`` (trainer weights) log-probs of the sampled tokens.
        rollout_log_probs: (B, R) float, the rollout engine's (behaviour policy) log-probs.
        response_mask: (B, R) 0/1, the response tokens.
        is_level: ``IS_LEVELS`` name of the IS weight's ratio, or None (weights 1).
        is_cap: C of truncated IS, ``w = min(rho, C)``.
        reject_level: ``IS_LEVELS`` name of the rejection ratio, or None (keep every token).
        reject_low, reject_high: tokens / rows with ratio outside ``[low, high]`` are dropped.

    Returns:
        ``Correction`` (weights, keep_mask, clipped_mask), all (B, R).
    """
    valid = response_mask.bool()
    keep = valid
    if reject_level is not None:
        rho = IS_LEVELS.get(reject_level)(old_log_probs, rollout_log_probs, response_mask)
        keep = valid & (rho >= reject_low) & (rho <= reject_high)
    if is_level is None:
        weights = torch.ones_like(old_log_probs)
        clipped = torch.zeros_like(valid)
    else:
        rho = IS_LEVELS.get(is_level)(old_log_probs, rollout_log_probs, response_mask)
        weights = rho.clamp(max=is_cap)
        clipped = valid & (rho > is_cap)
    return Correction(weights=(weights * keep).detach(), keep_mask=keep, clipped_mask=clipped)


# Statistics: per-rank sums and extremes, so that the caller can add / max them over the ranks
# that hold parts of the batch before ``correction_metrics`` turns them into numbers.
STAT_SUMS = ("num_tokens", "num_kept", "weight_sum", "num_clipped", "num_seqs", "num_rejected_seqs")


def correction_stats(correction: Correction, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, extremes)`` float64 tensors of this batch part: ``sums`` in ``STAT_SUMS``
    order; ``extremes`` = (max weight, -min weight) over kept tokens (``-inf`` when none)."""
    valid = response_mask.bool()
    keep = correction.keep_mask
    has_token = valid.any(-1)
    kept_weights = correction.weights[keep].double()
    sums = torch.tensor(
        [
            float(valid.sum()),
            float(keep.sum()),
            float(kept_weights.sum()),
            float(correction.clipped_mask.sum()),
            float(has_token.sum()),
            float((has_token & ~keep.any(-1)).sum()),
        ],
        dtype=torch.float64,
    )
    if kept_weights.numel():
        extremes = torch.stack([kept_weights.max(), -kept_weights.min()])
    else:
        extremes = torch.full((2,), -float("inf"), dtype=torch.float64)
    return sums, extremes


def correction_metrics(sums: torch.Tensor, extremes: torch.Tensor) -> dict[str, float]:
    """Metric names (without namespace) -> values from (reduced) ``correction_stats``:
    ``is_weight_mean/max/min`` over kept tokens, ``clipped_frac`` (valid tokens whose weight was
    truncated), ``masked_frac`` (valid tokens rejected), ``rejected_seq_frac`` (rows with a valid
    token that lost all of them)."""
    num_tokens, num_kept, weight_sum, num_clipped, num_seqs, num_rejected = sums.tolist()
    out = {
        "clipped_frac": num_clipped / max(num_tokens, 1.0),
        "masked_frac": (num_tokens - num_kept) / max(num_tokens, 1.0),
        "rejected_seq_frac": num_rejected / max(num_seqs, 1.0),
    }
    if num_kept > 0:
        out.update(
            is_weight_mean=weight_sum / num_kept,
            is_weight_max=float(extremes[0]),
            is_weight_min=-float(extremes[1]),
        )
    return out
