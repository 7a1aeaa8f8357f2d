"""Advantage estimators.

Each estimator is registered in ``ADV_ESTIMATORS`` and called with keyword arguments only: the
batch fields it needs (named as in ``hybridflow.data.keys``) plus its options. Every estimator
accepts and ignores extra keyword arguments, so a caller can pass one uniform set of fields::

    advantages, returns = ADV_ESTIMATORS.get(name)(**batch_fields, **options)

Shapes: B = samples, R = response length.
"""

from __future__ import annotations

import torch

from hybridflow.algos.registry import ADV_ESTIMATORS


@ADV_ESTIMATORS.register("grpo")
def grpo_advantage(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    uid: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage (GRPO): each score against the other answers to its prompt.

    A group is the samples sharing a ``uid``. Per sample,
    ``A = (score - group_mean) / (group_std + epsilon)`` (or ``score - group_mean`` when
    ``norm_by_std`` is False), with ``group_std`` unbiased (``torch.std`` default). The sequence
    advantage is broadcast over the response tokens and zeroed outside ``response_mask``.

    Conventions: a group of one sample has mean = its score and std = 1, so its advantage is 0
    (it has nothing to be compared with; the unbiased std would be NaN). A group whose scores are
    all equal has advantage 0 (std 0, numerator 0).

    Args:
        scores: (B,) float, sequence-level rewards.
        response_mask: (B, R), 1 on response tokens.
        uid: (B,) int64, prompt id; equal within a group.
        norm_by_std: divide by the group std.
        epsilon: added to the std before dividing.

    Returns:
        ``(advantages, returns)``, both (B, R) in the dtype of ``scores`` (float32 if integer),
        equal in value (GRPO has no critic: the return target is the advantage).
    """
    if scores.dim() != 1 or uid.shape != scores.shape or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"grpo_advantage expects scores (B,), uid (B,), response_mask (B, R); got "
            f"{tuple(scores.shape)}, {tuple(uid.shape)}, {tuple(response_mask.shape)}"
        )
    if not scores.is_floating_point():
        scores = scores.float()
    group_ids, group_of = torch.unique(uid, return_inverse=True)
    num_groups = group_ids.numel()
    counts = torch.bincount(group_of, minlength=num_groups).to(scores.dtype)

    sums = scores.new_zeros(num_groups).index_add_(0, group_of, scores)
    mean = (sums / counts)[group_of]
    centered = scores - mean
    if norm_by_std:
        sq_sums = scores.new_zeros(num_groups).index_add_(0, group_of, centered.square())
        singleton = counts < 2
        # clamp keeps the size-1 division finite; those groups get std 1 below (advantage 0).
        std = (sq_sums / (counts - 1).clamp(min=1)).sqrt()
        std = torch.where(singleton, torch.ones_like(std), std)[group_of]
        seq_advantages = centered / (std + epsilon)
    else:
        seq_advantages = centered

    advantages = seq_advantages.unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages.clone()
