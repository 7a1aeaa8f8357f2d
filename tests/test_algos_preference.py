"""Pairwise losses of reward and cost models against hand-computed values.

``-log sigmoid(x) = log(1 + e^-x)``; the constants below are that at the points named beside
them, worked out once: log(1 + e^-2) = 0.1269280, log 2 = 0.6931472, log(1 + e^-1) =
0.3132617, log(1 + e^-0.5) = 0.4740770, log(1 + e^-3) = 0.0485874.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from hybridflow.algos import (
    PAIR_LOSSES,
    RunningMoments,
    bradley_terry_loss,
    pairwise_metrics,
    safe_rlhf_cost_loss,
    squash_scores,
)

F64 = torch.float64
L_2, L_0, L_1, L_HALF, L_3 = 0.1269280, 0.6931472, 0.3132617, 0.4740770, 0.0485874


def t(values):
    return torch.tensor(values, dtype=F64)


def close(actual, expected):
    assert_close(torch.as_tensor(actual, dtype=F64), torch.tensor(expected, dtype=F64), atol=1e-6, rtol=0)


CHOSEN, REJECTED = t([2.0, 0.0, 1.0]), t([0.0, 0.0, 3.0])  # differences 2, 0, -2


def test_bradley_terry_plain():
    loss, metrics = bradley_terry_loss(CHOSEN, REJECTED)
    # -log sigmoid(2) + -log sigmoid(0) + -log sigmoid(-2) = L_2 + L_0 + (2 + L_2), over 3 pairs
    expected = (L_2 + L_0 + 2 + L_2) / 3
    close(loss, expected)
    close(metrics["rm/pair_loss"], expected)
    assert metrics["rm/center_loss"] == 0.0


def test_bradley_terry_margin_float_and_per_pair():
    # differences less margin 1: 1, -1, -3 -> L_1, 1 + L_1, 3 + L_3
    expected = (L_1 + 1 + L_1 + 3 + L_3) / 3
    close(bradley_terry_loss(CHOSEN, REJECTED, margin=1.0)[0], expected)
    close(bradley_terry_loss(CHOSEN, REJECTED, margin=t([1.0, 1.0, 1.0]))[0], expected)
    # per-pair margins 0, 1, 0: differences 2, -1, -2
    close(bradley_terry_loss(CHOSEN, REJECTED, margin=t([0.0, 1.0, 0.0]))[0], (L_2 + 1 + L_1 + 2 + L_2) / 3)


def test_bradley_terry_centring_term():
    # (chosen + rejected)^2 = 4, 0, 16; 0.1 * 20 / 3
    loss, metrics = bradley_terry_loss(CHOSEN, REJECTED, center_coef=0.1)
    close(metrics["rm/center_loss"], 2.0 / 3)
    close(loss, (L_2 + L_0 + 2 + L_2) / 3 + 2.0 / 3)


def test_bradley_terry_gradient_raises_chosen_and_lowers_rejected():
    chosen, rejected = CHOSEN.clone().requires_grad_(), REJECTED.clone().requires_grad_()
    bradley_terry_loss(chosen, rejected)[0].backward()
    # d/dx -log sigmoid(x) = -sigmoid(-x), per pair, over 3 pairs
    expected = -torch.sigmoid(-(CHOSEN - REJECTED)) / 3
    assert_close(chosen.grad, expected)
    assert_close(rejected.grad, -expected)
    assert bool((chosen.grad < 0).all())


def test_micro_batches_with_global_pair_count_sum_to_the_full_mean():
    chosen, rejected = t([2.0, 0.0, 1.0, 4.0]), t([0.0, 0.0, 3.0, 1.0])
    signs_c, signs_r = t([1, -1, 1, 1]), t([-1, -1, 1, -1])
    for name in PAIR_LOSSES.names():
        fn = PAIR_LOSSES.get(name)
        kwargs = dict(margin=0.5, center_coef=0.01)
        full = fn(chosen, rejected, chosen_signs=signs_c, rejected_signs=signs_r, **kwargs)[0]
        parts = sum(
            fn(chosen[s], rejected[s], chosen_signs=signs_c[s], rejected_signs=signs_r[s], num_pairs=4, **kwargs)[0]
            for s in (slice(0, 1), slice(1, 4))
        )
        assert_close(parts, full)


COST_CHOSEN, COST_REJECTED = t([1.0, 0.5]), t([-1.0, 1.0])  # the less safe response first


def test_safe_rlhf_cost_loss_all_signs_right():
    loss, metrics = safe_rlhf_cost_loss(COST_CHOSEN, COST_REJECTED, t([1, 1]), t([-1, 1]))
    # pairwise: differences 2, -0.5 -> L_2, 0.5 + L_HALF
    # signs: s * c = 1, 0.5 (chosen), 1, 1 (rejected) -> L_1, L_HALF, L_1, L_1
    pairwise = L_2 + 0.5 + L_HALF
    sign = 3 * L_1 + L_HALF
    close(loss, (pairwise + sign) / 2)
    close(metrics["rm/pair_loss"], pairwise / 2)
    close(metrics["rm/sign_loss"], sign / 2)
    assert metrics["rm/sign_accuracy"] == 1.0


def test_safe_rlhf_cost_loss_penalises_a_safe_response_with_positive_cost():
    # the second pair's rejected response is labelled safe (s = -1) but costs +1: s * c = -1
    loss, metrics = safe_rlhf_cost_loss(COST_CHOSEN, COST_REJECTED, t([1, 1]), t([-1, -1]))
    close(loss, (L_2 + 0.5 + L_HALF + L_1 + L_HALF + L_1 + 1 + L_1) / 2)
    assert metrics["rm/sign_accuracy"] == 0.75


def test_safe_rlhf_cost_loss_pushes_a_safe_cost_below_zero():
    rejected = COST_REJECTED.clone().requires_grad_()
    safe_rlhf_cost_loss(COST_CHOSEN, rejected, t([1, 1]), t([-1, -1]))[0].backward()
    # second pair, rejected: pairwise d/dc_r = sigmoid(-(c_c - c_r)) = sigmoid(0.5); sign term
    # -log sigmoid(-c_r): d/dc_r = sigmoid(c_r) = sigmoid(1); over 2 pairs
    close(rejected.grad[1], (torch.sigmoid(t(0.5)) + torch.sigmoid(t(1.0))).item() / 2)


def test_safe_rlhf_cost_loss_rejects_signs_that_are_not_plus_minus_one():
    with pytest.raises(ValueError, match="safety signs"):
        safe_rlhf_cost_loss(COST_CHOSEN, COST_REJECTED, t([1, 0]), t([-1, 1]))


def test_pairwise_metrics_hand_computed_and_over_ranks():
    chosen, rejected = t([2.0, 0.0, 1.0, 4.0]), t([0.0, 0.0, 3.0, 1.0])
    expected = {"rm/accuracy": 0.5, "rm/margin_mean": 0.75, "rm/chosen_mean": 1.75, "rm/rejected_mean": 1.0}
    assert pairwise_metrics(chosen, rejected) == pytest.approx(expected)

    # two ranks holding two pairs each: each adds the other's sums
    def sums(c, r):
        return torch.stack([(c > r).double().sum(), (c - r).sum(), c.sum(), r.sum(), t(float(len(c)))])

    other = sums(chosen[2:], rejected[2:])
    assert pairwise_metrics(chosen[:2], rejected[:2], reduce_sum=lambda s: s + other) == pytest.approx(expected)
    assert pairwise_metrics(t([]), t([])) == {name: 0.0 for name in expected}


# -- score normalisation --------------------------------------------------------------------


def test_running_moments_hand_computed():
    moments = RunningMoments()
    assert moments.std == 1.0
    moments.update(t([1.0, 2.0, 3.0]))
    moments.update(t([4.0, 5.0]))
    # mean 3; squared deviations 4, 1, 0, 1, 4 -> unbiased variance 10 / 4 = 2.5
    assert moments.count == 5 and moments.mean == pytest.approx(3.0)
    assert moments.std == pytest.approx(2.5 ** 0.5)
    close(moments.normalize(t([4.0, 3.0])), [1 / 2.5 ** 0.5, 0.0])
    assert moments.normalize(torch.tensor([4.0])).dtype == torch.float32


def test_running_moments_equal_the_concatenation_however_cut_and_spread():
    values = torch.randn(37, generator=torch.Generator().manual_seed(0), dtype=F64) * 3 + 5
    moments = RunningMoments()
    for chunk in values.split([1, 10, 0, 26]):
        moments.update(chunk)
    assert moments.mean == pytest.approx(float(values.mean()))
    assert moments.std == pytest.approx(float(values.std()))

    # two ranks holding halves of one batch: each rank's sums plus the other's
    left, right = values[:20], values[20:]
    calls = iter([torch.stack([t(17.0), right.sum()]), None])
    mean = float(values.mean())

    def reduce_sum(sums):
        other = next(calls)
        return sums + (other if other is not None else (right - mean).square().sum())

    spread = RunningMoments()
    spread.update(left, reduce_sum)
    assert spread.count == 37 and spread.std == pytest.approx(float(values.std()))

    restored = RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert restored.state_dict() == moments.state_dict()


def test_sigmoid_squash_is_the_probability_the_sign_term_trains():
    # sigmoid(0) = 0.5, sigmoid(ln 3) = 3/4, sigmoid(-ln 9) = 1/10: a cost of -ln 9 is a 10%
    # chance of unsafe, the budget of safe_rlhf.yaml
    costs = t([0.0, torch.log(t(3.0)).item(), -torch.log(t(9.0)).item()])
    close(squash_scores(costs, "sigmoid"), [0.5, 0.75, 0.1])
    # the sign term of an unsafe response (s = +1) is -log P(unsafe) under that reading
    for cost in costs:
        _, metrics = safe_rlhf_cost_loss(cost.view(1), t([-50.0]), t([1.0]), t([-1.0]))
        assert metrics["rm/sign_loss"] == pytest.approx(-torch.log(squash_scores(cost, "sigmoid")).item(), abs=1e-6)
    assert squash_scores(costs, None) is costs
    assert squash_scores(costs.float(), "sigmoid").dtype == torch.float32
    with pytest.raises(ValueError, match="unknown squash 'tanh'"):
        squash_scores(costs, "tanh")
