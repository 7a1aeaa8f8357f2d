"""Exact values of the algorithm library on small hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from hybridflow.algos import (
    ADV_ESTIMATORS,
    LOSS_AGGS,
    POLICY_LOSSES,
    Registry,
    agg_loss,
    entropy_from_logits,
    grpo_advantage,
    kl_penalty,
    log_probs_from_logits,
    ppo_clip_policy_loss,
)

F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


# -- GRPO ---------------------------------------------------------------------------------

# Two groups of three, interleaved and with unsorted uids; ragged responses (R = 4).
UID = t([7, 3, 7, 3, 7, 3], torch.int64)
SCORES = t([1.0, 0.0, 2.0, 1.0, 6.0, 2.0])
RESPONSE_MASK = t(
    [
        [1, 1, 1, 1],
        [1, 1, 0, 0],
        [1, 0, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
        [1, 1, 0, 0],
    ],
    torch.int64,
)


def expand(seq_values, mask):
    """Sequence values (B,) written out over their response tokens, 0 elsewhere."""
    return t([[v if m else 0.0 for m in row] for v, row in zip(seq_values, mask.tolist())])


def test_grpo_two_groups_ragged():
    # uid 7: scores 1, 2, 6 -> mean 3, deviations -2, -1, 3, var (4 + 1 + 9) / 2 = 7.
    # uid 3: scores 0, 1, 2 -> mean 1, deviations -1, 0, 1, var (1 + 0 + 1) / 2 = 1.
    eps = 1e-6
    s7, s3 = math.sqrt(7.0) + eps, 1.0 + eps
    seq = [-2 / s7, -1 / s3, -1 / s7, 0.0, 3 / s7, 1 / s3]
    advantages, returns = grpo_advantage(SCORES, RESPONSE_MASK, UID)
    assert advantages.shape == (6, 4) and advantages.dtype == F64
    assert_close(advantages, expand(seq, RESPONSE_MASK), rtol=0, atol=1e-15)
    assert_close(returns, advantages, rtol=0, atol=0)


def test_grpo_without_std():
    advantages, _ = grpo_advantage(SCORES, RESPONSE_MASK, UID, norm_by_std=False)
    expected = expand([-2.0, -1.0, -1.0, 0.0, 3.0, 1.0], RESPONSE_MASK)
    assert_close(advantages, expected, rtol=0, atol=0)


def test_grpo_equal_group_and_singleton_are_zero():
    # uid 0: all equal; uid 1: a group of one; uid 2: two samples 1 and 3 -> mean 2, std sqrt(2).
    uid = t([0, 0, 0, 1, 2, 2], torch.int64)
    scores = t([0.5, 0.5, 0.5, 10.0, 1.0, 3.0])
    mask = torch.ones(6, 2, dtype=torch.int64)
    a = 1 / (math.sqrt(2.0) + 1e-6)
    for norm_by_std, expected in ((True, [0, 0, 0, 0, -a, a]), (False, [0, 0, 0, 0, -1, 1])):
        advantages, _ = grpo_advantage(scores, mask, uid, norm_by_std=norm_by_std)
        assert_close(advantages, expand(expected, mask), rtol=0, atol=1e-15)


def test_grpo_equal_inexact_scores_stay_near_zero():
    # 0.1 is not exact in binary: the group mean may miss by an ulp; epsilon keeps it tiny.
    advantages, _ = grpo_advantage(t([0.1, 0.1, 0.1]), torch.ones(3, 1), t([4, 4, 4], torch.int64))
    assert advantages.abs().max() < 1e-9


def test_grpo_through_registry_ignores_extra_fields():
    fields = {"scores": SCORES, "response_mask": RESPONSE_MASK, "uid": UID, "truncated": UID > 0}
    advantages, _ = ADV_ESTIMATORS.get("grpo")(**fields, norm_by_std=False, unused_option=1)
    assert_close(advantages, grpo_advantage(SCORES, RESPONSE_MASK, UID, norm_by_std=False)[0])


# -- KL -----------------------------------------------------------------------------------

LOGP = t([[-1.0, -2.0]])
LOGR = t([[-2.0, -1.0]])


def test_kl_estimators():
    assert_close(kl_penalty(LOGP, LOGR, "k1"), t([[1.0, -1.0]]), rtol=0, atol=0)
    assert_close(kl_penalty(LOGP, LOGR, "k2"), t([[0.5, 0.5]]), rtol=0, atol=0)
    # logr - logp = -1, 1: exp(-1) + 1 - 1 and exp(1) - 1 - 1.
    expected_k3 = t([[math.exp(-1.0), math.e - 2.0]])
    assert_close(kl_penalty(LOGP, LOGR, "k3"), expected_k3, rtol=1e-15, atol=0)


def test_kl_k3_clamps_log_ratio():
    # logr - logp = -100 and 100 are clamped to -20 and 20 (no per-token bound).
    k3 = kl_penalty(t([[0.0, -100.0]]), t([[-100.0, 0.0]]), "k3", bound=None)
    assert_close(k3, t([[math.exp(-20.0) + 19.0, math.exp(20.0) - 21.0]]), rtol=1e-15, atol=0)
    far = kl_penalty(t([[0.0]], torch.float32), t([[-1e4]], torch.float32), "k3")
    assert torch.isfinite(far).all()


def test_kl_k3_is_bounded_per_token_by_default():
    # logr - logp = -100, 100, 2, -3: k3 = e^-20 + 19, e^20 - 21 (~4.9e8), e^2 - 3, e^-3 + 2.
    logp = t([[0.0, -100.0, -2.0, 0.0]])
    logr = t([[-100.0, 0.0, 0.0, -3.0]])
    unbounded = [math.exp(-20.0) + 19.0, math.exp(20.0) - 21.0, math.exp(2.0) - 3.0, math.exp(-3.0) + 2.0]
    assert_close(kl_penalty(logp, logr, "k3"), t([[10.0, 10.0, unbounded[2], unbounded[3]]]), rtol=1e-15, atol=0)
    assert_close(kl_penalty(logp, logr, "k3", bound=3.0), t([[3.0, 3.0, 3.0, unbounded[3]]]), rtol=1e-15, atol=0)
    # The bound is k3's only: k1 and k2 keep their values.
    assert_close(kl_penalty(logp, logr, "k1"), t([[100.0, -100.0, -2.0, 3.0]]), rtol=0, atol=0)
    # A bounded token passes no gradient (verl's clamp): the policy is not pushed by outliers.
    logp_grad = logp.clone().requires_grad_(True)
    kl_penalty(logp_grad, logr, "k3").sum().backward()
    assert logp_grad.grad[0, :2].abs().sum() == 0 and logp_grad.grad[0, 2:].abs().sum() > 0


def test_kl_abs_estimator():
    assert_close(kl_penalty(LOGP, LOGR, "abs"), t([[1.0, 1.0]]), rtol=0, atol=0)
    assert_close(kl_penalty(t([[-0.5, -3.0]]), t([[-0.25, -1.0]]), "abs"), t([[0.25, 2.0]]), rtol=0, atol=0)


def test_kl_estimator_names_agree_with_the_graph_spec():
    import typing

    from hybridflow.algos import KL_ESTIMATORS
    from hybridflow.spec.graph import KLName

    assert set(typing.get_args(KLName)) == set(KL_ESTIMATORS)


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(LOGP, LOGR, "k4")


# -- PPO clip -----------------------------------------------------------------------------


def test_ppo_clip_both_sides():
    # (advantage, ratio) per token, clip_ratio 0.2 -> ratio clipped to [0.8, 1.2]:
    #   (+1, 1.5): max(-1.5, -1.2) = -1.2  clipped branch active
    #   (+1, 0.5): max(-0.5, -0.8) = -0.5
    #   (-1, 1.5): max( 1.5,  1.2) =  1.5
    #   (-1, 0.5): max( 0.5,  0.8) =  0.8  clipped branch active
    #   (+2, 1.1): max(-2.2, -2.2) = -2.2  inside the range: not clipped
    #   (-1, 0.5): masked out (would be clipped)
    advantages = t([[1.0, 1.0, -1.0], [-1.0, 2.0, -1.0]])
    ratios = [[1.5, 0.5, 1.5], [0.5, 1.1, 0.5]]
    mask = t([[1, 1, 1], [1, 1, 0]], torch.int64)
    old_log_probs = t([[-1.0, -2.0, -0.5], [-3.0, -1.5, -0.7]])
    log_probs = (old_log_probs + t(ratios).log()).requires_grad_(True)

    loss_mat, metrics = ppo_clip_policy_loss(
        log_probs, old_log_probs, advantages, mask, clip_ratio=0.2
    )
    expected = t([[-1.2, -0.5, 1.5], [0.8, -2.2, 0.8]])
    assert_close(loss_mat.detach(), expected, rtol=1e-12, atol=0)

    assert metrics["clip_frac"] == pytest.approx(2 / 5, abs=1e-15)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5, rel=1e-12)
    kl = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.5, 0.5, 1.1)]  # k3 of KL(old || new)
    assert metrics["approx_kl"] == pytest.approx(sum(kl) / 5, rel=1e-12)
    assert all(isinstance(v, float) for v in metrics.values())

    # Clipped tokens carry no gradient; the others d(-A * ratio)/d logp = -A * ratio.
    agg_loss(loss_mat, mask, normalizer=1.0).backward()
    assert_close(log_probs.grad, t([[0.0, -0.5, 1.5], [0.0, -2.2, 0.0]]), rtol=1e-12, atol=0)


def test_ppo_clip_through_registry():
    zeros = torch.zeros(1, 2, dtype=F64)
    loss_fn = POLICY_LOSSES.get("ppo_clip")
    loss_mat, metrics = loss_fn(
        log_probs=zeros,
        old_log_probs=zeros,
        advantages=t([[1.0, -2.0]]),
        response_mask=torch.ones(1, 2),
        clip_ratio=0.1,
        ref_log_probs=zeros,  # an extra field, ignored
    )
    assert_close(loss_mat, t([[-1.0, 2.0]]), rtol=0, atol=0)
    assert metrics == {"clip_frac": 0.0, "dual_clip_frac": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0}


# -- aggregation --------------------------------------------------------------------------


def test_token_mean_global_normalizer_sums_to_full_batch_mean():
    loss_mat = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [10.0, 11.0, 12.0]])
    mask = t([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]], torch.int64)
    # Masked tokens: 1 2 3 | 4 | 7 8 -> 25 over 6 tokens.
    assert agg_loss(loss_mat, mask).item() == pytest.approx(25 / 6, rel=1e-15)

    num_tokens = mask.sum()
    micro_sum = sum(
        agg_loss(loss_mat[i : i + 2], mask[i : i + 2], normalizer=num_tokens) for i in (0, 2)
    )
    assert micro_sum.item() == pytest.approx(25 / 6, rel=1e-15)
    float_sum = sum(
        agg_loss(loss_mat[i : i + 1], mask[i : i + 1], normalizer=6.0) for i in range(4)
    )
    assert float_sum.item() == pytest.approx(25 / 6, rel=1e-15)
    # Averaging per-micro-batch means weights tokens unequally: (10/4 + 15/2) / 2 = 5 != 25/6.
    mean_of_means = (agg_loss(loss_mat[:2], mask[:2]) + agg_loss(loss_mat[2:], mask[2:])) / 2
    assert mean_of_means.item() == pytest.approx(5.0, rel=1e-15)


def test_token_mean_empty_mask_is_zero():
    out = agg_loss(torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.int64))
    assert out.item() == 0.0 and out.dim() == 0


# -- logits read-outs ---------------------------------------------------------------------


def test_log_probs_and_entropy_from_logits():
    # logits (0, ln 3) -> probs (1/4, 3/4); (0, 0) -> (1/2, 1/2).
    logits = t([[[0.0, math.log(3.0)], [0.0, 0.0]]])
    tokens = t([[0, 1]], torch.int64)
    expected = t([[math.log(0.25), math.log(0.5)]])
    assert_close(log_probs_from_logits(logits, tokens), expected, rtol=1e-15, atol=0)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert_close(entropy_from_logits(logits), t([[h, math.log(2.0)]]), rtol=1e-15, atol=1e-16)


def test_entropy_with_masked_vocab_is_finite():
    logits = t([[[0.0, 0.0, float("-inf")]]]).requires_grad_(True)
    entropy = entropy_from_logits(logits)
    assert_close(entropy, t([[math.log(2.0)]]), rtol=1e-15, atol=0)
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_half_precision_logits_are_upcast():
    logits = torch.zeros(1, 2, 4, dtype=torch.bfloat16)
    tokens = torch.zeros(1, 2, dtype=torch.int64)
    assert log_probs_from_logits(logits, tokens).dtype == torch.float32
    assert entropy_from_logits(logits).dtype == torch.float32


# -- registry -----------------------------------------------------------------------------


def test_registry_unknown_name_lists_known_names():
    with pytest.raises(KeyError) as info:
        ADV_ESTIMATORS.get("nope")
    assert str(info.value) == (
        "unknown advantage estimator 'nope'; known: distill, gae, grpo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, remax, rloo"
    )
    assert "token-mean" in LOSS_AGGS.names() and "ppo_clip" in POLICY_LOSSES


def test_registry_register_and_duplicates():
    registry = Registry("widget")
    registry.register("b")(len)
    registry.register("a")(abs)
    assert registry.names() == ["a", "b"] and registry.get("a") is abs
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.register("a")(abs)
    with pytest.raises(KeyError, match="known: a, b"):
        registry.get("c")
