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
#
# Fully masked rows (a truncated response masked out of the loss, a row with no token the
# policy chose): one rule for every mode, verl's. Such a row has no token, so it adds nothing to
# any numerator, and it is *not a sequence* of the batch: ``num_seqs`` counts the rows with at
# least one valid token (``count_sequences``; the engines count the same). TRL counts such rows
# in its ``grpo`` and ``dr_grpo`` means; with no fully masked row the two agree.
#
# Besides verl's ``loss_agg_mode`` names, TRL's ``loss_type`` names (GRPOTrainer) are modes:
# ``grpo`` = seq-mean-token-mean, ``dr_grpo`` = seq-mean-token-sum-norm (R is
# ``data.max_response_length``: responses are padded to it), ``dapo`` = token-mean (TRL
# normalises by the tokens of the whole accumulated batch over all processes, as here), and
# ``bnpo``, which has no verl twin: the token mean of each micro-batch, averaged over the
# micro-batches and ranks.


def count_sequences(mask: torch.Tensor) -> torch.Tensor:
    """Rows of ``mask`` (B, R) with at least one valid token (the ``num_seqs`` of the rule)."""
    return (mask.sum(-1) > 0).sum()


@LOSS_AGGS.register("token-mean")
def token_mean(masked: torch.Tensor, mask: torch.Tensor, num_tokens, num_seqs) -> torch.Tensor:
    """``sum(loss * mask) / num_tokens``: every valid token weighs the same (TRL's ``dapo``)."""
    return masked.sum() / num_tokens


@LOSS_AGGS.register("seq-mean-token-sum")
def seq_mean_token_sum(masked: torch.Tensor, mask: torch.Tensor, num_tokens, num_seqs) -> torch.Tensor:
    """``sum_i (sum_t loss_it * mask_it) / num_seqs``: long sequences weigh more."""
    return masked.sum() / num_seqs


@LOSS_AGGS.register("seq-mean-token-mean")
def seq_mean_token_mean(masked: torch.Tensor, mask: torch.Tensor, num_tokens, num_seqs) -> torch.Tensor:
    """``sum_i mean_t(loss_it over valid t) / num_seqs``: every sequence weighs the same (TRL's
    ``grpo``). A fully masked row is no sequence: not in the sum, not in ``num_seqs``."""
    return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs


@LOSS_AGGS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(masked: torch.Tensor, mask: torch.Tensor, num_tokens, num_seqs) -> torch.Tensor:
    """``sum(loss * mask) / (num_seqs * R)``: token sums over a constant (Dr.GRPO, TRL's
    ``dr_grpo``). ``R`` is the maximum response length, so a token's weight does not depend on
    the other responses' lengths."""
    return masked.sum() / (num_seqs * masked.shape[1])


@LOSS_AGGS.register("bnpo")
def bnpo(masked: torch.Tensor, mask: torch.Tensor, num_tokens, num_seqs) -> torch.Tensor:
    """TRL's ``bnpo``: this call's (micro-batch's) own token mean, weighted by its share of the
    sequences, ``(sum(loss * mask) / tokens_here) * (seqs_here / num_seqs)``. Over equal
    micro-batches that is the mean of the micro-batch token means (TRL: per device batch =
    ``train.micro_batch_size``); it depends on how the batch is cut, unlike ``token-mean``."""
    here = count_sequences(mask).to(masked.dtype)
    return masked.sum() / mask.sum().clamp(min=1) * (here / num_seqs)


LOSS_AGGS.register("grpo")(seq_mean_token_mean)
LOSS_AGGS.register("dr_grpo")(seq_mean_token_sum_norm)
LOSS_AGGS.register("dapo")(token_mean)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (B, R) loss matrix under ``mask`` (B, R) to a () scalar with a ``LOSS_AGGS`` mode.

    ``normalizer`` is the global number of valid tokens, ``num_seqs`` the global number of
    sequences with a valid token (see above); None = this call's own counts. Both are taken
    as at least 1.
    """
    mask = mask.to(loss_mat.dtype)
    if normalizer is None:
        normalizer = mask.sum()
    if num_seqs is None:
        num_seqs = count_sequences(mask)
    # At least 1: a batch whose every row is masked out (all truncated) has loss 0, not NaN.
    normalizer = torch.as_tensor(normalizer, dtype=loss_mat.dtype).clamp(min=1)
    num_seqs = torch.as_tensor(num_seqs, dtype=loss_mat.dtype).clamp(min=1)
    return LOSS_AGGS.get(mode)(loss_mat * mask, mask, normalizer, num_seqs)


# -- policy losses -------------------------------------------------------------------------


def _ratio_metrics(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """The metrics every ratio-based policy loss reports (see ``ppo_clip_policy_loss``)."""
    with torch.no_grad():
        return {
            "clip_frac": masked_mean(clipped.to(log_probs.dtype), response_mask).item(),
            "approx_kl": masked_mean(kl_penalty(old_log_probs, log_probs, "k3"), response_mask).item(),
            "ratio_mean": masked_mean(ratio.detach(), response_mask).item(),
        }


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

    metrics = _ratio_metrics(log_probs, old_log_probs, ratio, clipped > unclipped, response_mask)
    metrics["dual_clip_frac"] = masked_mean(dual_mask.to(loss_mat.dtype), response_mask).item()
    return loss_mat, metrics


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): PPO's clipped surrogate on a sequence-level ratio.

    ``s_i = exp(mean_{t valid} (log_probs - old_log_probs))``, the length-normalised (geometric
    mean) importance ratio of sequence ``i``, clipped as a whole to ``[1 - low, 1 + high]``
    (GSPO's ranges are small, e.g. 3e-4 / 4e-4). Per token (the paper's GSPO-token form), the
    ratio is ``s_i`` in value and ``s_i * grad log pi_t`` in gradient, and the loss is
    ``max(-A_t * s_i, -A_t * clip(s_i))``; with a sequence advantage and ``seq-mean-token-mean``
    aggregation (GSPO's) that is exactly the sequence objective, gradient included. The
    sequence log-ratio is clamped to [-20, 20] (its value only). A row with no valid token has
    ratio 1.

    Returns ``(loss_mat, metrics)`` as ``ppo_clip_policy_loss`` (``clip_frac`` counts the
    tokens of clipped sequences, ``ratio_mean`` is the mean of ``s_i`` over tokens) plus
    ``seq_clip_frac``, the share of sequences whose ratio is clipped.
    """
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    mask_f = response_mask.to(log_probs.dtype)
    lengths = mask_f.sum(-1)
    seq_log_ratio = ((log_probs - old_log_probs) * mask_f).sum(-1) / lengths.clamp(min=1)
    seq_log_ratio = seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # value: s_i on every token; gradient: s_i * d log pi_t (the detached terms cancel in value)
    ratio = (log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    loss_mat = torch.maximum(unclipped, clipped)
    metrics = _ratio_metrics(log_probs, old_log_probs, ratio, clipped > unclipped, response_mask)
    with torch.no_grad():
        seq_ratio = seq_log_ratio.exp()
        seq_clipped = ((seq_ratio < 1.0 - low) | (seq_ratio > 1.0 + high)) & (lengths > 0)
        metrics["seq_clip_frac"] = float(seq_clipped.sum() / (lengths > 0).sum().clamp(min=1))
    return loss_mat, metrics


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE on every token, weighted by a clipped, stop-gradient
    importance weight: ``loss = -sg(clip(ratio, 1 - low, 1 + high)) * A * log_probs``.

    Unlike PPO's clip, a token whose ratio leaves the range keeps its gradient (scaled by the
    bound): only the weight is clipped. ``ratio = exp(log_probs - old_log_probs)``, log-ratio
    clamped to [-20, 20]; the gradient is ``-w * A * grad log pi``. MiniMax sets no lower bound
    in effect (``clip_ratio_low: 1`` here gives 0) and a large upper one.

    Returns ``(loss_mat, metrics)`` as ``ppo_clip_policy_loss``; ``clip_frac`` is the share of
    tokens whose weight is clipped.
    """
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    ratio = (log_probs - old_log_probs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    weight = ratio.clamp(1.0 - low, 1.0 + high).detach()
    loss_mat = -weight * advantages * log_probs
    clipped = (ratio < 1.0 - low) | (ratio > 1.0 + high)
    return loss_mat, _ratio_metrics(log_probs, old_log_probs, ratio, clipped, response_mask)


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
