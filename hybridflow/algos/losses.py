"""Policy losses, loss aggregation, and the log-prob / entropy read-outs of logits.

Policy losses return a per-token loss matrix and metrics; ``agg_loss`` turns the matrix into the
scalar that is backpropagated. The engine sums that scalar over micro-batches and data-parallel
ranks, so aggregation takes an explicit ``normalizer``: with the *global* number of response
tokens, the sum of micro-batch losses is exactly the full-batch token mean.

Shapes: B = samples, R = response length, V = vocabulary size.
"""

from __future__ import annotations

import torch

from hybridflow.algos.kl import kl_penalty
from hybridflow.algos.registry import LOSS_AGGS, POLICY_LOSSES

# Same bound as the KL estimators: exp() of a log-ratio stays finite in float32.
_MAX_LOG_RATIO = 20.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` (B, R) where ``mask`` (B, R) is 1; 0 when the mask is empty."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


# -- aggregation ---------------------------------------------------------------------------


@LOSS_AGGS.register("token-mean")
def token_mean(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum(loss_mat * mask) / normalizer``; ``normalizer`` defaults to ``mask.sum()``, at least 1.

    Args:
        loss_mat: (B, R) float, per-token losses.
        mask: (B, R), 1 on tokens that count.
        normalizer: the number of tokens to divide by. Pass the global count (all micro-batches,
            all data-parallel ranks) so that summing the returned losses gives the token mean of
            the whole batch.

    Returns:
        () float.
    """
    mask = mask.to(loss_mat.dtype)
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1)
    return (loss_mat * mask).sum() / normalizer


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (B, R) loss matrix under ``mask`` (B, R) to a scalar with the ``LOSS_AGGS`` mode."""
    return LOSS_AGGS.get(mode)(loss_mat, mask, normalizer=normalizer)


# -- policy losses -------------------------------------------------------------------------


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate, per token.

    ``ratio = exp(log_probs - old_log_probs)`` (log-ratio clamped to [-20, 20] against overflow),
    ``loss = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio, 1 + clip_ratio))``.

    Args:
        log_probs: (B, R) float, current policy log-probs of the sampled tokens (with grad).
        old_log_probs: (B, R) float, behaviour-policy log-probs of the same tokens.
        advantages: (B, R) float.
        response_mask: (B, R), 1 on response tokens; used only for the metrics.
        clip_ratio: epsilon of the clip range.

    Returns:
        ``(loss_mat, metrics)``: loss_mat (B, R), not masked (aggregate it with ``agg_loss``);
        metrics are python floats over masked tokens:

        - ``clip_frac``: fraction of tokens where the clipped term is the larger (active) one,
          i.e. the token gets no gradient.
        - ``approx_kl``: mean k3 estimate of ``KL(pi_old || pi)`` from the old policy's samples,
          ``ratio - 1 - log(ratio)``.
        - ``ratio_mean``: mean of ``ratio``.
    """
    log_ratio = (log_probs - old_log_probs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    loss_mat = torch.maximum(unclipped, clipped)

    with torch.no_grad():
        clipped_mask = (clipped > unclipped).to(loss_mat.dtype)
        approx_kl = kl_penalty(old_log_probs, log_probs, "k3")
        metrics = {
            "clip_frac": masked_mean(clipped_mask, response_mask).item(),
            "approx_kl": masked_mean(approx_kl, response_mask).item(),
            "ratio_mean": masked_mean(ratio, response_mask).item(),
        }
    return loss_mat, metrics


# -- read-outs of logits -------------------------------------------------------------------
# The train and the rollout engine both call these, so their log-probs agree bit for bit on
# equal logits. Half-precision logits are upcast to float32: bf16 log-probs are too coarse for
# importance ratios.


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def log_probs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each token under its logits.

    Args:
        logits: (B, R, V) float, ``logits[:, j]`` is the distribution ``tokens[:, j]`` was drawn
            from (already shifted by the caller).
        tokens: (B, R) int64.

    Returns:
        (B, R) float32 (float64 for float64 logits).
    """
    log_softmax = torch.log_softmax(_upcast(logits), dim=-1)
    return log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position.

    Args:
        logits: (B, R, V) float; ``-inf`` entries (masked-out vocabulary) are allowed.

    Returns:
        (B, R) float32 (float64 for float64 logits).
    """
    log_p = torch.log_softmax(_upcast(logits), dim=-1)
    # p * log p with p = 0 is 0, but 0 * -inf is NaN: clamp log p to a finite floor.
    floor = torch.finfo(log_p.dtype).min
    return -(log_p.exp() * log_p.clamp(min=floor)).sum(-1)
