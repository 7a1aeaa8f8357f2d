"""Losses of scalar models trained from preference pairs: reward models (Bradley-Terry) and
Safe-RLHF's cost models.

A pair is two responses to one prompt, each scored by the model with one number (its output at
the last response token). ``chosen`` is the response the model must score *higher*: the
preferred one for a reward model, the less safe one for a cost model (a cost is high when
harmful). So one pairwise term serves both:

    bradley_terry      -log sigmoid(r_chosen - r_rejected - margin)
                       + center_coef * (r_chosen + r_rejected)^2
    safe_rlhf_cost     bradley_terry on costs
                       - log sigmoid(s_chosen * c_chosen) - log sigmoid(s_rejected * c_rejected)

The centring term (TRL's and OpenRLHF's ``center_rewards_coefficient``, Eisenstein et al. 2023)
pulls the scores of a pair towards a zero mean: the pairwise term only fixes differences. The
sign term (Safe-RLHF, Dai et al. 2023, eq. 6) fixes the cost's zero instead: ``s = +1`` for an
unsafe response, ``-1`` for a safe one, so a safe response is pushed below 0 and an unsafe one
above, and "cost > 0" reads as "unsafe" when the policy is constrained to a cost budget.

Shapes: B = pairs. Each loss returns the *sum* over this call's pairs divided by ``num_pairs``:
with the global number of pairs (every micro-batch, every data-parallel rank), the engine's sum
of micro-batch losses is exactly the full-batch mean (as ``agg_loss``'s ``normalizer``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.algos.losses import ReduceSum, local_sum
from hybridflow.algos.registry import PAIR_LOSSES

# Metric names every pairwise loss's caller logs (``val/`` in front for held-out pairs).
ACCURACY = "rm/accuracy"
MARGIN_MEAN = "rm/margin_mean"
CHOSEN_MEAN = "rm/chosen_mean"
REJECTED_MEAN = "rm/rejected_mean"


def _normalizer(num_pairs: float | torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
    count = scores.shape[0] if num_pairs is None else num_pairs
    return torch.as_tensor(count, dtype=scores.dtype, device=scores.device).clamp(min=1)


@PAIR_LOSSES.register("bradley_terry")
def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: float | torch.Tensor = 0.0,
    center_coef: float = 0.0,
    num_pairs: float | torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley-Terry pairwise loss, ``-log sigmoid(chosen - rejected - margin)`` per pair, plus
    ``center_coef * (chosen + rejected)^2``.

    Args:
        chosen_scores: (B,) float, the model's score of the response that must score higher
            (with grad).
        rejected_scores: (B,) float, its score of the other response.
        margin: a float, or (B,) float per pair (TRL's ``margin`` column): the difference the
            chosen score must exceed before the loss flattens out. 0 = plain Bradley-Terry.
        center_coef: weight of the reward-centring term; 0 = off.
        num_pairs: the divisor (module docstring); None = B.

    Returns:
        ``(loss, metrics)``: loss () scalar; metrics ``rm/pair_loss`` and ``rm/center_loss``,
        the two terms' contributions to it, as python floats.
    """
    pair = -F.logsigmoid(chosen_scores - rejected_scores - margin)
    center = center_coef * (chosen_scores + rejected_scores).square()
    normalizer = _normalizer(num_pairs, chosen_scores)
    pair_loss, center_loss = pair.sum() / normalizer, center.sum() / normalizer
    metrics = {"rm/pair_loss": pair_loss.item(), "rm/center_loss": center_loss.item()}
    return pair_loss + center_loss, metrics


@PAIR_LOSSES.register("safe_rlhf_cost")
def safe_rlhf_cost_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    chosen_signs: torch.Tensor,
    rejected_signs: torch.Tensor,
    margin: float | torch.Tensor = 0.0,
    center_coef: float = 0.0,
    num_pairs: float | torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Safe-RLHF's cost-model loss: ``bradley_terry_loss`` on the costs (chosen = the less
    safe response) plus the sign term ``-log sigmoid(s * c)`` of each response.

    Args:
        chosen_scores: (B,) float, the cost of the less safe response of each pair (with grad).
        rejected_scores: (B,) float, the cost of the safer response.
        chosen_signs: (B,) float, +1 where the chosen response is unsafe, -1 where it is safe.
        rejected_signs: (B,) float, the same for the rejected response.
        margin, center_coef, num_pairs: as ``bradley_terry_loss``.

    Returns:
        ``(loss, metrics)``: loss () scalar; metrics ``bradley_terry_loss``'s plus
        ``rm/sign_loss`` (the sign term's contribution) and ``rm/sign_accuracy`` (share of
        this call's responses whose cost has the sign of its label; a cost of exactly 0 counts
        as wrong).
    """
    if not bool(((chosen_signs.abs() == 1) & (rejected_signs.abs() == 1)).all()):
        raise ValueError("safety signs must be +1 (unsafe) or -1 (safe)")
    loss, metrics = bradley_terry_loss(chosen_scores, rejected_scores, margin, center_coef, num_pairs)
    signed = torch.cat([chosen_signs * chosen_scores, rejected_signs * rejected_scores])
    sign_loss = -F.logsigmoid(signed).sum() / _normalizer(num_pairs, chosen_scores)
    metrics["rm/sign_loss"] = sign_loss.item()
    metrics["rm/sign_accuracy"] = (signed > 0).to(signed.dtype).mean().item()
    return loss + sign_loss, metrics


def pairwise_metrics(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, reduce_sum: ReduceSum = local_sum
) -> dict[str, float]:
    """What every pairwise model logs, over the pairs of every rank (``reduce_sum``).

    Args:
        chosen_scores: (B,) float, scores of the responses that should score higher.
        rejected_scores: (B,) float, scores of the others.
        reduce_sum: adds a tensor of sums over the ranks holding parts of the batch.

    Returns:
        ``rm/accuracy``: share of pairs with ``chosen > rejected`` (a tie counts as wrong: the
        model has not told the two apart); ``rm/margin_mean``: mean of ``chosen - rejected``;
        ``rm/chosen_mean`` and ``rm/rejected_mean``: mean scores. All 0 for no pair.
    """
    chosen, rejected = chosen_scores.detach().double(), rejected_scores.detach().double()
    sums = torch.stack([
        (chosen > rejected).double().sum(),
        (chosen - rejected).sum(),
        chosen.sum(),
        rejected.sum(),
        torch.tensor(float(chosen.shape[0]), dtype=torch.float64, device=chosen.device),
    ])
    *totals, count = reduce_sum(sums).tolist()
    count = max(count, 1.0)
    return {
        name: total / count
        for name, total in zip((ACCURACY, MARGIN_MEAN, CHOSEN_MEAN, REJECTED_MEAN), totals)
    }


def squash_scores(scores: torch.Tensor, squash: str | None) -> torch.Tensor:
    """A scorer's raw scores mapped for use as rewards or costs (a score node's ``squash``).

    ``sigmoid``: a Safe-RLHF cost model's sign term trains ``sigmoid(c)`` as the probability
    that a response is unsafe (``-log sigmoid(s * c)`` is the logistic loss of the label
    ``s``), so ``sigmoid(c)`` is its estimate of P(unsafe), in [0, 1] like a 0/1 rule cost;
    a cost budget then bounds the expected share of unsafe responses. ``None``: unchanged.

    Args:
        scores: (B,) float, one raw score per response.
        squash: ``"sigmoid"`` or None.

    Returns:
        (B,) float, the mapped scores, in the dtype of ``scores``.
    """
    if squash is None:
        return scores
    if squash == "sigmoid":
        return torch.sigmoid(scores)
    raise ValueError(f"unknown squash {squash!r}: expected 'sigmoid' or None")
