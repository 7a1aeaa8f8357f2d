"""Policy losses, loss aggregation, and the log-prob / entropy read-outs of logits.

Policy losses return a per-token loss matrix and metrics; ``agg_loss`` turns the matrix into the
scalar that is backpropagated. The engine sums that scalar over micro-batches and data-parallel
ranks, so aggregation takes an explicit ``normalizer``: with the *global* number of response
tokens, the sum of micro-batch losses is exactly the full-batch token mean.

Shapes: B = samples, R = response length, V = vocabulary size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.algos.kl import kl_penalty
from hybridflow.algos.registry import LOSS_AGGS, POLICY_LOSSES

# Same bound as the KL estimators: exp() of a log-ratio stays finite in float32.
_MAX_LOG_RATIO = 20.0


# -- batch statistics over ranks -------------------------------------------------------------
# A batch split over data-parallel ranks (whole prompt groups on each) takes its batch-wide
# statistics through ``reduce_sum``: it adds a tensor of sums over every rank holding part of the
# batch (an all-reduce; the worker builds it). The default, ``local_sum``, is the identity: the
# whole batch is here. Each statistic is written so that with ``local_sum`` it computes exactly
# what it would without the parameter.

ReduceSum = Callable[[torch.Tensor], torch.Tensor]


def local_sum(sums: torch.Tensor) -> torch.Tensor:
    """``reduce_sum`` of a batch held whole by one rank."""
    return sums


def masked_mean(values: torch.Tensor, mask: torch.Tensor, reduce_sum: ReduceSum = local_sum) -> torch.Tensor:
    """Mean of ``values`` (B, R) where ``mask`` (B, R) is 1; 0 when the mask is empty."""
    mask = mask.to(values.dtype)
    total, count = reduce_sum(torch.stack([(values * mask).sum(), mask.sum()]))
    return total / count.clamp(min=1)


# -- aggregation ---------------------------------------------------------------------------
# ``agg_loss`` masks the (B, R) loss matrix and resolves the two counts once; every registered
# mode then takes ``(masked, mask, num_tokens, num_seqs)``: ``masked = loss_mat * mask``, ``mask``
# in the loss's dtype, and the *global* numbers of valid tokens and of sequences (all
# micro-batches, all data-parallel ranks), so that summing the returned micro-batch losses gives
# the full-batch value. Left as None by the caller they are this call's own counts (at least 1).


@LOSS_AGGS.register("token-mean")
def token_mean(masked: torch.Tensor, mask: torch.Tensor, num_tokens, num_seqs) -> torch.Tensor:
    """``sum(loss * mask) / num_tokens``: every valid token weighs the same."""
    return masked.sum() / num_tokens


@LOSS_AGGS.register("seq-mean-token-sum")
def seq_mean_token_sum(masked: torch.Tensor, mask: torch.Tensor, num_tokens, num_seqs) -> torch.Tensor:
    """``sum_i (sum_t loss_it * mask_it) / num_seqs``: long sequences weigh more."""
    return masked.sum() / num_seqs


@LOSS_AGGS.register("seq-mean-token-mean")
def seq_mean_token_mean(masked: torch.Tensor, mask: torch.Tensor, num_tokens, num_seqs) -> torch.Tensor:
    """``sum_i mean_t(loss_it over valid t) / num_seqs``: every sequence weighs the same. A
    sequence without valid tokens contributes 0 (and still counts in ``num_seqs``)."""
    return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs


@LOSS_AGGS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(masked: torch.Tensor, mask: torch.Tensor, num_tokens, num_seqs) -> torch.Tensor:
    """``sum(loss * mask) / (num_seqs * R)``: token sums over a constant (Dr.GRPO). ``R`` is the
    maximum response length, so a token's weight does not depend on the other responses'
    lengths."""
    return masked.sum() / (num_seqs * masked.shape[1])


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (B, R) loss matrix under ``mask`` (B, R) to a () scalar with a ``LOSS_AGGS`` mode.

    ``normalizer`` is the global number of valid tokens, ``num_seqs`` the global number of
    sequences (see above); None = this call's own counts.
    """
    mask = mask.to(loss_mat.dtype)
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1)
    if num_seqs is None:
        num_seqs = max(mask.shape[0], 1)
    return LOSS_AGGS.get(mode)(loss_mat * mask, mask, normalizer, num_seqs)


# -- policy losses -------------------------------------------------------------------------


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate, per token, with optional asymmetric clip and dual clip.

    ``ratio = exp(log_probs - old_log_probs)`` (log-ratio clamped to [-20, 20] against overflow),
    ``loss = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))`` with ``low`` / ``high``
    defaulting to ``clip_ratio`` (DAPO's clip-higher sets ``high > low``). Dual clip (Ye et al.
    2020): where ``A < 0`` the loss is further capped at ``-A * clip_ratio_c`` (``c > 1``), so a
    huge ratio on a bad token cannot blow the loss up.

    Args:
        log_probs: (B, R) float, current policy log-probs of the sampled tokens (with grad).
        old_log_probs: (B, R) float, behaviour-policy log-probs of the same tokens.
        advantages: (B, R) float.
        response_mask: (B, R), 1 on response tokens; used only for the metrics.
        clip_ratio: epsilon of the clip range (both sides unless overridden).
        clip_ratio_low, clip_ratio_high: the lower / upper epsilon; None = ``clip_ratio``.
        clip_ratio_c: dual-clip bound (> 1); None = off.

    Returns:
        ``(loss_mat, metrics)``: loss_mat (B, R), not masked (aggregate it with ``agg_loss``);
        metrics are python floats over masked tokens:

        - ``clip_frac``: fraction of tokens where the clipped term is the larger (active) one,
          i.e. the token gets no gradient.
        - ``dual_clip_frac``: fraction of tokens capped by the dual clip (0 when off).
        - ``approx_kl``: mean k3 estimate of ``KL(pi_old || pi)`` from the old policy's samples,
          ``ratio - 1 - log(ratio)``.
        - ``ratio_mean``: mean of ``ratio``.
    """
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = (log_probs - old_log_probs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual_mask = torch.zeros_like(loss_mat, dtype=torch.bool)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 for dual clip, got {clip_ratio_c}")
        cap = -advantages * clip_ratio_c
        dual_mask = (advantages < 0) & (loss_mat > cap)
        loss_mat = torch.where(dual_mask, cap, loss_mat)

    with torch.no_grad():
        clipped_mask = (clipped > unclipped).to(loss_mat.dtype)
        approx_kl = kl_penalty(old_log_probs, log_probs, "k3")
        metrics = {
            "clip_frac": masked_mean(clipped_mask, response_mask).item(),
            "dual_clip_frac": masked_mean(dual_mask.to(loss_mat.dtype), response_mask).item(),
            "approx_kl": masked_mean(approx_kl, response_mask).item(),
            "ratio_mean": masked_mean(ratio, response_mask).item(),
        }
    return loss_mat, metrics


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO value loss, per token: ``0.5 * max((V - R)^2, (V_clip - R)^2)``.

    ``V_clip = V_old + clip(V - V_old, -clip_range, clip_range)`` keeps the new value near the
    one the advantages were computed with; ``clip_range=None`` gives plain ``0.5 * (V - R)^2``.

    Args:
        values: (B, R) float, current critic values (with grad).
        old_values: (B, R) float, the values the advantages were computed with.
        returns: (B, R) float, value targets.
        response_mask: (B, R); used only for the metrics.
        clip_range: epsilon of the value clip, or None.

    Returns:
        ``(loss_mat, metrics)``: loss_mat (B, R), not masked; metrics ``vf_clip_frac`` (share
        of tokens where the clipped term is the larger one) and ``value_mean``.
    """
    unclipped = (values - returns).square()
    if clip_range is None:
        loss_mat = 0.5 * unclipped
        clip_frac = torch.zeros_like(loss_mat)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (clipped_values - returns).square()
        loss_mat = 0.5 * torch.maximum(unclipped, clipped)
        clip_frac = (clipped > unclipped).to(loss_mat.dtype)
    with torch.no_grad():
        metrics = {
            "vf_clip_frac": masked_mean(clip_frac, response_mask).item(),
            "value_mean": masked_mean(values.detach(), response_mask).item(),
        }
    return loss_mat, metrics


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, reduce_sum: ReduceSum = local_sum
) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over the valid tokens of (B, R) tensors.

    1 = perfect prediction, 0 = no better than the mean, negative = worse. ``nan`` when the
    returns have no variance.
    """
    mask_f = mask.to(returns.dtype)
    count = reduce_sum(mask_f.sum()).clamp(min=1)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = reduce_sum((x * mask_f).sum()) / count
        return reduce_sum(((x - mean).square() * mask_f).sum()) / count

    var_returns = var(returns)
    if float(var_returns) == 0.0:
        return float("nan")
    return float(1.0 - var(returns - values) / var_returns)


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
