"""Advantage estimators.

Each estimator is registered in ``ADV_ESTIMATORS`` and called with keyword arguments only: the
batch fields it needs (named as in ``hybridflow.data.keys``) plus its options. Every estimator
accepts and ignores extra keyword arguments, so a caller can pass one uniform set of fields::

    advantages, returns = ADV_ESTIMATORS.get(name)(**batch_fields, **options)

Fields an estimator may take (all (B, ...) tensors, aligned with ``responses``):

- ``scores`` (B,): sequence-level reward; ``token_rewards`` (B, R): per-token reward (the score
  on the last valid token, minus a KL penalty when the graph puts KL in the reward);
- ``values`` (B, R): critic values; ``baseline_scores`` (B,): reward of a baseline response
  (ReMax: the greedy one); ``uid`` (B,): prompt id; ``response_mask`` (B, R);
- ``teacher_log_probs``, ``student_log_probs`` (B, R): a teacher's and the sampling student's
  log-probs of the sampled tokens (distillation).

Every estimator returns ``(advantages, returns)``, both (B, R) and zero outside
``response_mask``. They are batch functions: the worker calls them on its data-parallel rank's
part of the rollout batch, which holds whole prompt groups, so group statistics are local;
batch-wide statistics (whitening, ``scope="batch"``) go through ``reduce_sum`` (an all-reduce
over the ranks, see ``losses.ReduceSum``; default: the whole batch is here), so they do not
depend on the number of ranks.

Shapes: B = samples, R = response length.
"""

from __future__ import annotations

from typing import Literal

import torch

from hybridflow.algos.losses import ReduceSum, local_sum
from hybridflow.algos.registry import ADV_ESTIMATORS

GroupScope = Literal["group", "batch"]


def _check_seq(scores: torch.Tensor, response_mask: torch.Tensor, name: str) -> torch.Tensor:
    if scores.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"{name} expects scores (B,) and response_mask (B, R); got "
            f"{tuple(scores.shape)}, {tuple(response_mask.shape)}"
        )
    return scores if scores.is_floating_point() else scores.float()


def _broadcast(seq_values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, R): each sequence value on its response tokens, 0 elsewhere."""
    return seq_values.unsqueeze(-1) * response_mask.to(seq_values.dtype)


def _group_stats(
    scores: torch.Tensor, uid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: its group's size, sum, and sum of squared deviations from the group mean."""
    if uid.shape != scores.shape:
        raise ValueError(f"uid {tuple(uid.shape)} must match scores {tuple(scores.shape)}")
    _, group_of = torch.unique(uid, return_inverse=True)
    num_groups = int(group_of.max()) + 1 if group_of.numel() else 0
    counts = torch.bincount(group_of, minlength=num_groups).to(scores.dtype)
    sums = scores.new_zeros(num_groups).index_add_(0, group_of, scores)
    centered = scores - (sums / counts)[group_of]
    sq_sums = scores.new_zeros(num_groups).index_add_(0, group_of, centered.square())
    return counts[group_of], sums[group_of], sq_sums[group_of]


def _batch_stats(
    scores: torch.Tensor, reduce_sum: ReduceSum
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_group_stats`` with the whole batch (every rank's part) as one group."""
    one_group = torch.zeros_like(scores, dtype=torch.int64)
    local = scores.new_zeros(1).index_add_(0, one_group, scores)
    count, total = reduce_sum(torch.cat([scores.new_tensor([scores.numel()]), local]))
    centered = scores - total / count
    sq_sum = reduce_sum(scores.new_zeros(1).index_add_(0, one_group, centered.square()))[0]
    return count.expand_as(scores), total.expand_as(scores), sq_sum.expand_as(scores)


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    epsilon: float = 1e-8,
    shift_mean: bool = True,
    reduce_sum: ReduceSum = local_sum,
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + epsilon)`` over the tokens where ``mask`` (B, R) is 1
    (on every rank's part of the batch, through ``reduce_sum``).

    The variance is the unbiased one (n - 1), 0 for a single token; masked-out entries are 0.
    With ``shift_mean=False`` the mean is added back (only the scale changes).
    """
    mask_f = mask.to(values.dtype)
    total, count = reduce_sum(torch.stack([(values * mask_f).sum(), mask_f.sum()]))
    mean = total / count.clamp(min=1)
    var = reduce_sum(((values - mean).square() * mask_f).sum()) / (count - 1).clamp(min=1)
    whitened = (values - mean) * torch.rsqrt(var + epsilon)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask_f


def _discounted(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``discounted_returns`` and each row's return at its first valid token, (B,)."""
    valid = response_mask.bool()
    mask_f = response_mask.to(token_rewards.dtype)
    rewards = token_rewards * mask_f
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        # A masked token (padding, or a gap: an observation token) takes no step.
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask_f, running


def discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next`` per valid token, ``G_next`` the return of the next
    *valid* token (0 after the last), so ``G_t = sum_{k >= t, k valid} gamma^(j(k)) r_k`` with
    ``j(k)`` the number of valid tokens between t and k. A masked token before a row's last
    valid token (a gap: an observation token of a multi-turn rollout) is skipped: the return
    carries over it with no discount step (the same rule as ``gae_advantage``). 0 outside the
    mask. (B, R)."""
    return _discounted(token_rewards, response_mask, gamma)[0]


def zero_without_groups(estimator: str, scope: GroupScope = "group") -> bool:
    """Whether ``estimator`` gives every sample advantage 0 when each prompt has one sample:
    its baseline is the other samples of the prompt (GRPO at ``scope="group"``, RLOO).
    Validation refuses such a graph. REINFORCE++ with a group baseline falls back to plain
    REINFORCE++ there (as verl does), GRPO at ``scope="batch"`` compares across prompts."""
    return estimator == "rloo" or (estimator == "grpo" and scope == "group")


@ADV_ESTIMATORS.register("grpo")
def grpo_advantage(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    uid: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
    scope: GroupScope = "group",
    reduce_sum: ReduceSum = local_sum,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (GRPO): each score against the other answers to its prompt.

    A group is the samples sharing a ``uid`` (``scope="group"``) or the whole batch
    (``scope="batch"``). Per sample, ``A = (score - group_mean) / (group_std + epsilon)`` (or
    ``score - group_mean`` when ``norm_by_std`` is False: Dr.GRPO), with ``group_std`` unbiased
    (``torch.std`` default). The sequence advantage is broadcast over the response tokens and
    zeroed outside ``response_mask``.

    Conventions: a group of one sample has mean = its score and std = 1, so its advantage is 0
    (it has nothing to be compared with; the unbiased std would be NaN). A group whose scores are
    all equal has advantage 0 (std 0, numerator 0).

    Args:
        scores: (B,) float, sequence-level rewards.
        response_mask: (B, R), 1 on response tokens.
        uid: (B,) int64, prompt id; equal within a group.
        norm_by_std: divide by the group std.
        epsilon: added to the std before dividing.
        scope: ``"group"`` (per uid) or ``"batch"`` (one group of everything, over every
            rank's part of the batch through ``reduce_sum``).

    Returns:
        ``(advantages, returns)``, both (B, R) in the dtype of ``scores`` (float32 if integer),
        equal in value (GRPO has no critic: the return target is the advantage).
    """
    scores = _check_seq(scores, response_mask, "grpo_advantage")
    if scope == "batch":
        counts, sums, sq_sums = _batch_stats(scores, reduce_sum)
    else:
        counts, sums, sq_sums = _group_stats(scores, uid)
    centered = scores - sums / counts
    if norm_by_std:
        # clamp keeps the size-1 division finite; those groups get std 1 (advantage 0).
        std = (sq_sums / (counts - 1).clamp(min=1)).sqrt()
        std = torch.where(counts < 2, torch.ones_like(std), std)
        centered = centered / (std + epsilon)
    advantages = _broadcast(centered, response_mask)
    return advantages, advantages.clone()


@ADV_ESTIMATORS.register("rloo")
def rloo_advantage(
    scores: torch.Tensor, response_mask: torch.Tensor, uid: torch.Tensor, **_
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: each score against the mean of the *other* samples of its prompt.

    ``A_i = s_i - (sum_group - s_i) / (k - 1)`` for a group of ``k`` samples, equal to
    ``k / (k - 1) * (s_i - group_mean)``. A group of one has no other sample: advantage 0.

    Args:
        scores: (B,) float; response_mask: (B, R); uid: (B,) int64.

    Returns:
        ``(advantages, returns)``, (B, R), equal in value.
    """
    scores = _check_seq(scores, response_mask, "rloo_advantage")
    counts, sums, _ = _group_stats(scores, uid)
    others_mean = (sums - scores) / (counts - 1).clamp(min=1)
    seq = torch.where(counts > 1, scores - others_mean, torch.zeros_like(scores))
    advantages = _broadcast(seq, response_mask)
    return advantages, advantages.clone()


@ADV_ESTIMATORS.register("remax")
def remax_advantage(
    scores: torch.Tensor, response_mask: torch.Tensor, baseline_scores: torch.Tensor, **_
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: the sampled response's reward minus the reward of the greedy response.

    ``A = score - baseline_score`` on every response token (the return of a sequence-level reward
    is the same at every token).

    Args:
        scores: (B,) float; response_mask: (B, R);
        baseline_scores: (B,) float, reward of the greedy response to the same prompt.

    Returns:
        ``(advantages, returns)``, (B, R); ``returns`` is the score on every response token.
    """
    scores = _check_seq(scores, response_mask, "remax_advantage")
    if baseline_scores.shape != scores.shape:
        raise ValueError(
            f"remax_advantage: baseline_scores {tuple(baseline_scores.shape)} must match scores "
            f"{tuple(scores.shape)} (one greedy response per sampled one)"
        )
    advantages = _broadcast(scores - baseline_scores.to(scores.dtype), response_mask)
    return advantages, _broadcast(scores, response_mask)


@ADV_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    reduce_sum: ReduceSum = local_sum,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted token returns, whitened over the whole batch.

    ``G_t = sum_{k >= t} gamma^(k - t) r_k``; ``A = masked_whiten(G)`` (mean 0, unit variance
    over all valid tokens of the batch; the unbiased variance, epsilon 1e-8).

    Args:
        token_rewards: (B, R) float (KL penalty already subtracted when it is in the reward).
        response_mask: (B, R); gamma: discount.

    Returns:
        ``(advantages, returns)``: the whitened and the raw returns, (B, R).
    """
    returns = discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask, reduce_sum=reduce_sum), returns


@ADV_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    uid: torch.Tensor,
    gamma: float = 1.0,
    reduce_sum: ReduceSum = local_sum,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: the group-mean return is subtracted before whitening.

    ``A_t = whiten(G_t - mean_{j in group} G_0^j)``: each token's discounted return minus the mean
    sequence return ``G_0`` (the return at its first valid token) of the samples sharing its
    ``uid``, then whitened over the batch's valid tokens. A group of equal returns centres to 0
    before whitening. A group of one has no baseline (0): its sample is plain REINFORCE++, as
    in verl, so a batch of one sample per prompt is ``reinforce_plus_plus``.

    Args:
        token_rewards: (B, R); response_mask: (B, R); uid: (B,) int64; gamma: discount.

    Returns:
        ``(advantages, returns)``, (B, R): whitened centred returns and the raw returns.
    """
    returns, seq_return = _discounted(token_rewards, response_mask, gamma)
    counts, sums, _ = _group_stats(seq_return, uid)
    baseline = torch.where(counts > 1, sums / counts, torch.zeros_like(sums))
    centred = returns - _broadcast(baseline, response_mask)
    return masked_whiten(centred, response_mask, reduce_sum=reduce_sum), returns


@ADV_ESTIMATORS.register("gae")
def gae_advantage(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    gae_lambda: float = 1.0,
    whiten: bool = False,
    reduce_sum: ReduceSum = local_sum,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the response tokens.

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lambda * A_next``,
    where ``next`` is the next *valid* token (``V_next = A_next = 0`` after the last);
    ``returns = A + V`` (the value target). A masked token before a row's last valid token (a
    gap: an observation token of a multi-turn rollout) is skipped, not an episode end: the
    running ``V_next`` and ``A_next`` carry over it with no discount step, as in verl. With
    ``whiten`` the advantages (not the returns) are whitened over the batch's valid tokens.

    Args:
        token_rewards: (B, R) float; values: (B, R) float, ``V`` of the state each token was
            sampled in; response_mask: (B, R), 1 on the tokens the policy chose; gamma,
            gae_lambda: in [0, 1].

    Returns:
        ``(advantages, returns)``, (B, R), 0 outside the mask.
    """
    if values.shape != token_rewards.shape or response_mask.shape != values.shape:
        raise ValueError(
            f"gae_advantage expects token_rewards, values, response_mask all (B, R); got "
            f"{tuple(token_rewards.shape)}, {tuple(values.shape)}, {tuple(response_mask.shape)}"
        )
    valid = response_mask.bool()
    mask_f = response_mask.to(values.dtype)
    rewards = token_rewards.to(values.dtype) * mask_f
    values = values * mask_f
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])
    next_advantage = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = (delta + gamma * gae_lambda * next_advantage) * mask_f[:, t]
        advantages[:, t] = advantage
        # A masked position (trailing padding: still 0; a gap) passes the running values on.
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
    returns = (advantages + values) * mask_f
    if whiten:
        advantages = masked_whiten(advantages, response_mask, reduce_sum=reduce_sum)
    return advantages, returns


def safe_rlhf_advantage(
    advantages: torch.Tensor, cost_advantages: torch.Tensor, lagrange_lambda: float
) -> torch.Tensor:
    """Safe-RLHF actor advantage: ``(A_reward - lambda * A_cost) / (1 + lambda)``. (B, R)."""
    return (advantages - lagrange_lambda * cost_advantages) / (1.0 + lagrange_lambda)


@ADV_ESTIMATORS.register("distill")
def distill_advantage(
    response_mask: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    student_log_probs: torch.Tensor,
    distill_coef: float = 1.0,
    distill_gamma: float = 0.0,
    distill_baseline: str = "none",
    reward_coef: float = 0.0,
    reward_estimator: str = "grpo",
    reduce_sum: ReduceSum = local_sum,
    **fields,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation: each sampled token's advantage is the negative reverse KL of
    the student to the teacher at that token, ``teacher_log_prob - student_log_prob``,
    optionally plus a reward advantage::

        A = distill_coef * D + reward_coef * A_reward

    ``D`` is the per-token difference itself when ``distill_gamma`` is 0 (the default: a
    token is credited with its own divergence only, no return over later tokens), else its
    discounted return over the row's later valid tokens (``discounted_returns``). With
    ``distill_baseline="batch_mean"`` the mean of ``D`` over every response token of the batch
    is subtracted: a baseline that does not depend on the sampled token, so the expected
    gradient is unchanged and its variance falls (``D`` is mostly negative, ``-KL`` on
    average, so without it every sampled token is pushed down and only the differences teach).
    ``A_reward`` is the registered ``reward_estimator`` (e.g. ``grpo``) on the same fields
    (``scores``, ``uid``, ...) and its options; skipped when ``reward_coef`` is 0, so a pure
    distillation needs no score. ``student_log_probs`` are the behaviour policy's
    (``old_log_probs``); the update's clipped ratio pi / pi_old then weighs them as it weighs
    any advantage.

    Args:
        response_mask: (B, R), 1 on response tokens (gaps allowed).
        teacher_log_probs: (B, R) float, the teacher's log-probs of the sampled tokens.
        student_log_probs: (B, R) float, the student's, at sampling.
        distill_coef: weight of the distillation term.
        distill_gamma: discount of the distillation return (0: per-token).
        distill_baseline: ``none`` or ``batch_mean`` (subtract D's mean over the batch's tokens).
        reward_coef: weight of the reward advantage (0: pure distillation).
        reward_estimator: registered estimator giving the reward advantage.

    Returns:
        ``(advantages, returns)``, both (B, R) float, equal, zero outside ``response_mask``.
    """
    if teacher_log_probs.shape != response_mask.shape or student_log_probs.shape != response_mask.shape:
        raise ValueError(
            "distill_advantage expects teacher_log_probs, student_log_probs and response_mask of "
            f"one (B, R) shape; got {tuple(teacher_log_probs.shape)}, "
            f"{tuple(student_log_probs.shape)}, {tuple(response_mask.shape)}"
        )
    if distill_baseline not in ("none", "batch_mean"):
        raise ValueError(f"distill_advantage: distill_baseline must be 'none' or 'batch_mean', got {distill_baseline!r}")
    mask_f = response_mask.to(teacher_log_probs.dtype)
    diff = (teacher_log_probs - student_log_probs) * mask_f
    if distill_gamma > 0:
        diff = discounted_returns(diff, response_mask, distill_gamma)
    if distill_baseline == "batch_mean":
        total, count = reduce_sum(torch.stack([diff.sum(), mask_f.sum()]))
        diff = (diff - total / count.clamp(min=1)) * mask_f
    advantages = distill_coef * diff
    if reward_coef != 0:
        if reward_estimator == "distill":
            raise ValueError("distill_advantage: reward_estimator must be another estimator than distill")
        reward_adv, _ = ADV_ESTIMATORS.get(reward_estimator)(
            response_mask=response_mask, reduce_sum=reduce_sum, **fields
        )
        advantages = advantages + reward_coef * reward_adv.to(advantages.dtype)
    advantages = advantages * mask_f
    return advantages, advantages.clone()
