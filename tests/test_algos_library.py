"""Exact values of the estimators, losses, aggregations, KL controllers and the Lagrangian.

Every expected value is worked out by hand in the comments: ragged response masks (junk in the
padded positions must not leak), groups whose scores are all equal, groups of one.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from torch.testing import assert_close

from hybridflow.algos import (
    ADV_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    LagrangeMultiplier,
    agg_loss,
    clipped_value_loss,
    explained_variance,
    gae_advantage,
    grpo_advantage,
    masked_whiten,
    ppo_clip_policy_loss,
    reinforce_plus_plus_advantage,
    reinforce_plus_plus_baseline_advantage,
    remax_advantage,
    rloo_advantage,
    safe_rlhf_advantage,
)
from hybridflow.data import keys as K
from hybridflow.workers import algo_steps

F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def expand(seq_values, mask):
    return t([[v if m else 0.0 for m in row] for v, row in zip(seq_values, mask.tolist())])


UID = t([7, 3, 7, 3, 7, 3], torch.int64)
SCORES = t([1.0, 0.0, 2.0, 1.0, 6.0, 2.0])
MASK = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], torch.int64)


# -- group estimators -----------------------------------------------------------------------


def test_grpo_batch_scope():
    # One group of all six: mean 2, deviations -1 -2 0 -1 4 0, var (1+4+0+1+16+0)/5 = 4.4.
    advantages, _ = grpo_advantage(SCORES, MASK, UID, scope="batch")
    s = math.sqrt(4.4) + 1e-6
    assert_close(advantages, expand([-1 / s, -2 / s, 0.0, -1 / s, 4 / s, 0.0], MASK), rtol=0, atol=1e-15)
    dr, _ = grpo_advantage(SCORES, MASK, UID, scope="batch", norm_by_std=False)  # Dr.GRPO
    assert_close(dr, expand([-1.0, -2.0, 0.0, -1.0, 4.0, 0.0], MASK), rtol=0, atol=0)


def test_rloo_two_groups_ragged():
    # uid 7: 1, 2, 6 -> 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5.
    # uid 3: 0, 1, 2 -> 0 - 1.5 = -1.5, 1 - 1 = 0, 2 - 0.5 = 1.5.
    advantages, returns = rloo_advantage(SCORES, MASK, UID)
    assert_close(advantages, expand([-3.0, -1.5, -1.5, 0.0, 4.5, 1.5], MASK), rtol=0, atol=0)
    assert_close(returns, advantages, rtol=0, atol=0)


def test_rloo_equal_group_and_singleton_are_zero():
    uid = t([0, 0, 0, 1, 2, 2], torch.int64)
    scores = t([0.5, 0.5, 0.5, 10.0, 1.0, 3.0])
    advantages, _ = ADV_ESTIMATORS.get("rloo")(scores=scores, response_mask=torch.ones(6, 2), uid=uid)
    assert_close(advantages, expand([0, 0, 0, 0, -2.0, 2.0], torch.ones(6, 2)), rtol=0, atol=0)


def test_remax_ragged():
    mask = t([[1, 1, 0], [1, 0, 0]], torch.int64)
    advantages, returns = remax_advantage(t([1.0, 0.5]), mask, baseline_scores=t([0.25, 0.5]))
    assert_close(advantages, t([[0.75, 0.75, 0.0], [0.0, 0.0, 0.0]]), rtol=0, atol=0)
    assert_close(returns, t([[1.0, 1.0, 0.0], [0.5, 0.0, 0.0]]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one greedy response per sampled one"):
        remax_advantage(t([1.0, 0.5]), mask, baseline_scores=t([0.25]))


# -- token-level estimators -----------------------------------------------------------------

# Row 1 is ragged: its padded position holds junk (reward 5, value 9) that must not leak.
TR_MASK = t([[1, 1, 1], [1, 1, 0]], torch.int64)
TOKEN_REWARDS = t([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
VALUES = t([[0.5, 0.2, 0.4], [1.0, 0.5, 9.0]])


def test_gae_ragged():
    # gamma 0.9, lambda 0.5.  Row 0: delta_2 = 1 - 0.4 = 0.6 = A_2;
    # delta_1 = 0.9 * 0.4 - 0.2 = 0.16, A_1 = 0.16 + 0.45 * 0.6 = 0.43;
    # delta_0 = 0.9 * 0.2 - 0.5 = -0.32, A_0 = -0.32 + 0.45 * 0.43 = -0.1265.
    # Row 1 (ends at t = 1): A_1 = 2 - 0.5 = 1.5; A_0 = 0.9 * 0.5 - 1 + 0.45 * 1.5 = 0.125.
    advantages, returns = gae_advantage(TOKEN_REWARDS, VALUES, TR_MASK, gamma=0.9, gae_lambda=0.5)
    assert_close(advantages, t([[-0.1265, 0.43, 0.6], [0.125, 1.5, 0.0]]), rtol=0, atol=1e-12)
    assert_close(returns, t([[0.3735, 0.63, 1.0], [1.125, 2.0, 0.0]]), rtol=0, atol=1e-12)


def test_gae_gamma_lambda_one_is_return_minus_value():
    advantages, returns = gae_advantage(TOKEN_REWARDS, VALUES, TR_MASK)
    assert_close(advantages, t([[0.5, 0.8, 0.6], [1.0, 1.5, 0.0]]), rtol=0, atol=1e-15)
    assert_close(returns, t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]), rtol=0, atol=1e-15)


def test_gae_whiten():
    # Valid advantages 0.5 0.8 0.6 1.0 1.5: mean 0.88, unbiased var over the five tokens.
    advantages, returns = gae_advantage(TOKEN_REWARDS, VALUES, TR_MASK, whiten=True)
    raw = [0.5, 0.8, 0.6, 1.0, 1.5]
    mean = sum(raw) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 4 + 1e-8)
    expected = t([[(0.5 - mean) / std, (0.8 - mean) / std, (0.6 - mean) / std],
                  [(1.0 - mean) / std, (1.5 - mean) / std, 0.0]])
    assert_close(advantages, expected, rtol=0, atol=1e-12)
    assert_close(returns, t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]), rtol=0, atol=1e-15)  # not whitened


def test_masked_whiten_single_token_and_shift():
    assert_close(masked_whiten(t([[3.0, 7.0]]), t([[1, 0]])), t([[0.0, 0.0]]), rtol=0, atol=0)
    # 1 2 3 -> mean 2, var 1 -> -1 0 1; without the shift the mean comes back: 1 2 3.
    out = masked_whiten(t([[1.0, 2.0, 3.0]]), torch.ones(1, 3), epsilon=0.0, shift_mean=False)
    assert_close(out, t([[1.0, 2.0, 3.0]]), rtol=0, atol=1e-15)


def test_reinforce_plus_plus_ragged():
    # gamma 1: returns row 0 = 1 1 1, row 1 = 2.0 + 0 -> 2 2 (junk 5 masked): valid 1 1 1 2 2,
    # mean 1.4, deviations -0.4 x3, 0.6 x2, var (3 * 0.16 + 2 * 0.36) / 4 = 0.3.
    advantages, returns = reinforce_plus_plus_advantage(TOKEN_REWARDS, TR_MASK)
    std = math.sqrt(0.3 + 1e-8)
    expected = t([[-0.4 / std] * 3, [0.6 / std, 0.6 / std, 0.0]])
    assert_close(advantages, expected, rtol=0, atol=1e-12)
    assert_close(returns, t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]), rtol=0, atol=0)
    # gamma 0.5: row 0 = 0.25 0.5 1, row 1 = 1 2.
    _, returns = reinforce_plus_plus_advantage(TOKEN_REWARDS, TR_MASK, gamma=0.5)
    assert_close(returns, t([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]), rtol=0, atol=0)


def test_reinforce_plus_plus_baseline_groups():
    # Returns: row 0 = 1 1, row 1 = 3 (one token), row 2 = 5 5; uid 0 = rows 0, 1 (mean 2),
    # uid 1 = row 2 alone: no baseline (0, verl's fallback). Centred: -1 -1 | 1 | 5 5; mean 1.8;
    # deviations -2.8 -2.8 -0.8 3.2 3.2; var (2 * 7.84 + 0.64 + 2 * 10.24) / 4 = 9.2.
    mask = t([[1, 1], [1, 0], [1, 1]], torch.int64)
    token_rewards = t([[0.0, 1.0], [3.0, 9.0], [0.0, 5.0]])
    advantages, returns = reinforce_plus_plus_baseline_advantage(token_rewards, mask, t([0, 0, 1], torch.int64))
    std = math.sqrt(9.2 + 1e-8)
    expected = t([[-2.8 / std, -2.8 / std], [-0.8 / std, 0.0], [3.2 / std, 3.2 / std]])
    assert_close(advantages, expected, rtol=0, atol=1e-12)
    assert_close(returns, t([[1.0, 1.0], [3.0, 0.0], [5.0, 5.0]]), rtol=0, atol=0)


def test_every_estimator_is_zero_outside_the_mask():
    fields = dict(scores=SCORES, response_mask=MASK, uid=UID, token_rewards=expand(SCORES, MASK) * 0.5,
                  values=torch.rand(6, 4, dtype=F64), baseline_scores=SCORES.flip(0),
                  teacher_log_probs=-torch.rand(6, 4, dtype=F64), student_log_probs=-torch.rand(6, 4, dtype=F64))
    for name in ADV_ESTIMATORS.names():
        advantages, returns = ADV_ESTIMATORS.get(name)(**fields, whiten=True)
        assert advantages.shape == returns.shape == (6, 4), name
        assert (advantages[MASK == 0] == 0).all() and (returns[MASK == 0] == 0).all(), name


# -- policy and value losses ----------------------------------------------------------------


def test_ppo_asymmetric_and_dual_clip():
    # low 0.2, high 0.28 -> ratio clipped to [0.8, 1.28]; dual clip c = 3 for A < 0.
    #   (+1, 1.5): max(-1.5, -1.28) = -1.28       clipped
    #   (-1, 0.5): max( 0.5,  0.8)  =  0.8        clipped
    #   (-1, 1.5): max( 1.5,  1.28) =  1.5
    #   (-1, 5.0): max( 5.0,  1.28) =  5.0 -> capped at 3 (dual clip)
    #   (-1, 2.0): max( 2.0,  1.28) =  2.0 < 3: kept
    #   (+1, 5.0): max(-5.0, -1.28) = -1.28       clipped; no dual clip for A > 0
    advantages = t([[1.0, -1.0, -1.0], [-1.0, -1.0, 1.0]])
    ratios = t([[1.5, 0.5, 1.5], [5.0, 2.0, 5.0]])
    old = torch.zeros(2, 3, dtype=F64)
    log_probs = ratios.log().requires_grad_(True)
    mask = torch.ones(2, 3, dtype=torch.int64)
    loss_mat, metrics = ppo_clip_policy_loss(
        log_probs, old, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0
    )
    assert_close(loss_mat.detach(), t([[-1.28, 0.8, 1.5], [3.0, 2.0, -1.28]]), rtol=1e-12, atol=1e-12)
    assert metrics["clip_frac"] == pytest.approx(3 / 6)
    assert metrics["dual_clip_frac"] == pytest.approx(1 / 6)
    loss_mat.sum().backward()
    # gradient -A * ratio where neither clip is active, 0 where one is.
    assert_close(log_probs.grad, t([[0.0, 0.0, 1.5], [0.0, 2.0, 0.0]]), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ppo_clip_policy_loss(log_probs, old, advantages, mask, clip_ratio_c=0.5)


def test_clipped_value_loss():
    # old 0.5, clip 0.2.  token 0: (1 - 2)^2 = 1 vs (0.7 - 2)^2 = 1.69 -> 0.845 (clipped);
    # token 1: 0 vs (0.3 - 0)^2 = 0.09 -> 0.045 (clipped); token 2: v = old: 0.25 both -> 0.125.
    values = t([[1.0, 0.0, 0.5]]).requires_grad_(True)
    old, returns = t([[0.5, 0.5, 0.5]]), t([[2.0, 0.0, 1.0]])
    loss_mat, metrics = clipped_value_loss(values, old, returns, torch.ones(1, 3), clip_range=0.2)
    assert_close(loss_mat.detach(), t([[0.845, 0.045, 0.125]]), rtol=0, atol=1e-12)
    assert metrics["vf_clip_frac"] == pytest.approx(2 / 3)
    loss_mat.sum().backward()
    assert_close(values.grad, t([[0.0, 0.0, -0.5]]), rtol=0, atol=1e-12)  # clipped: no gradient
    plain, _ = clipped_value_loss(values, old, returns, torch.ones(1, 3), clip_range=None)
    assert_close(plain.detach(), t([[0.5, 0.0, 0.125]]), rtol=0, atol=1e-12)


def test_explained_variance():
    # returns 1 2 4: var 14/9; residual 0 0 1: var 2/9 -> 1 - 1/7. A masked junk token ignored.
    ev = explained_variance(t([[1.0, 2.0, 3.0, 50.0]]), t([[1.0, 2.0, 4.0, 0.0]]), t([[1, 1, 1, 0]]))
    assert ev == pytest.approx(6 / 7, rel=1e-12)
    assert math.isnan(explained_variance(t([[0.0, 1.0]]), t([[2.0, 2.0]]), torch.ones(1, 2)))


# -- aggregation ----------------------------------------------------------------------------

AGG_LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
AGG_MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]], torch.int64)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        # the empty row is no sequence (tests/test_algos_2025.py): 2 sequences
        ("seq-mean-token-sum", 7 / 2),  # (3 + 4) / 2 sequences
        ("seq-mean-token-mean", 5.5 / 2),  # (1.5 + 4) / 2 sequences
        ("seq-mean-token-sum-norm", 7 / 6),  # 7 / (2 sequences * R = 3)
    ],
)
def test_loss_aggregation_modes(mode, expected):
    assert agg_loss(AGG_LOSS, AGG_MASK, mode).item() == pytest.approx(expected, rel=1e-15)
    # Micro-batches of one row with the global counts add up to the full-batch value.
    split = sum(
        agg_loss(AGG_LOSS[i : i + 1], AGG_MASK[i : i + 1], mode, normalizer=3.0, num_seqs=2.0)
        for i in range(3)
    )
    assert split.item() == pytest.approx(expected, rel=1e-15)


def test_seq_modes_differ_from_token_mean_on_ragged_rows():
    mask = t([[1, 1, 1], [1, 0, 0]], torch.int64)
    loss = t([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.5)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)


# -- KL controllers and the Lagrangian ------------------------------------------------------


def test_kl_controllers():
    fixed = FixedKLController(0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
    # target 0.01, horizon 100, 10 samples: error clipped to +-0.2 -> x(1 +- 0.02).
    cases = [(0.02, 0.102), (0.005, 0.098), (0.011, 0.1 * (1 + 0.1 * 10 / 100))]
    for kl, expected in cases:
        ctrl = AdaptiveKLController(0.1, target=0.01, horizon=100)
        ctrl.update(kl, num_steps=10)
        assert ctrl.value == pytest.approx(expected, rel=1e-12)
    restored = AdaptiveKLController(1.0, 0.01, 100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_lagrange_multiplier_rises_above_threshold_and_floors_at_zero():
    lam = LagrangeMultiplier(init=0.5, lr=0.5, threshold=0.2)
    assert lam.update(0.6) == pytest.approx(0.7)  # 0.5 + 0.5 * (0.6 - 0.2)
    assert lam.update(0.0) == pytest.approx(0.6)  # 0.7 + 0.5 * (0.0 - 0.2)
    for _ in range(10):
        lam.update(0.0)
    assert lam.value == 0.0
    capped = LagrangeMultiplier(init=0.0, lr=10.0, threshold=0.0, max_value=2.0)
    assert capped.update(1.0) == 2.0
    other = LagrangeMultiplier(init=0.0, lr=1.0, threshold=0.0)
    other.load_state_dict(capped.state_dict())
    assert other.value == 2.0
    with pytest.raises(ValueError):
        LagrangeMultiplier(init=-1.0, lr=1.0, threshold=0.0)


def test_safe_rlhf_advantage():
    # lambda 1: (1 - 0.5) / 2 = 0.25, (-1 - 2) / 2 = -1.5; lambda 0: the reward advantage.
    assert_close(safe_rlhf_advantage(t([1.0, -1.0]), t([0.5, 2.0]), 1.0), t([0.25, -1.5]))
    assert_close(safe_rlhf_advantage(t([1.0, -1.0]), t([0.5, 2.0]), 0.0), t([1.0, -1.0]))


# -- the worker side: which fields feed which estimator (no process group: one rank) --------


def _rollout(scores_key=K.SCORES, values_key=K.VALUES):
    return TensorDict(
        {
            K.RESPONSE_MASK: TR_MASK,
            K.UID: t([0, 1], torch.int64),
            scores_key: t([1.0, 2.0]),
            values_key: VALUES,
            K.OLD_LOG_PROBS: t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -7.0]]),
            K.REF_LOG_PROBS: t([[-1.5, -1.0, -0.5], [-1.0, -2.0, -1.0]]),
        },
        batch_size=[2],
    )


def _advantage_node(name: str, inputs: list[str], outputs: list[str], **options):
    """The resolved advantage node a worker runs (keys and slots as validation fills them)."""
    from hybridflow.graph.dag import resolve_node
    from hybridflow.spec.graph import AdvantageNode, ModelSpec

    spec = AdvantageNode(name=name, op="advantage", model="actor", inputs=inputs, outputs=outputs, options=options)
    return resolve_node(spec, ModelSpec(role="actor", source={"config": {}}))


def test_compute_advantages_kl_in_reward_and_cost_keys():
    options = {"estimator": "gae", "kl_coef": 0.1, "kl_estimator": "k1"}
    state = {"kl_ctrl/adv": FixedKLController(0.1)}
    out, metrics, ratios = algo_steps.compute_advantages(
        _rollout(),
        _advantage_node("adv", ["responses", "scores", "values", "old_log_probs", "ref_log_probs"], ["advantages"], **options),
        state,
    )
    # k1 = old - ref: row 0: 0.5 0 -0.5, row 1: 0 1 (masked). Rewards: row 0 = -0.05 0 1.05,
    # row 1 = 0 1.9. gamma = lambda = 1: A_t = sum of rewards from t - V_t.
    expected = t([[1.0 - 0.5, 1.05 - 0.2, 1.05 - 0.4], [1.9 - 1.0, 1.9 - 0.5, 0.0]])
    assert_close(out[K.ADVANTAGES].double(), expected, rtol=0, atol=1e-6)
    assert_close(out[K.RETURNS].double(), t([[1.0, 1.05, 1.05], [1.9, 1.9, 0.0]]), rtol=0, atol=1e-6)
    assert ratios.means()["reward_kl/mean"] == pytest.approx((0.5 + 0 - 0.5 + 0 + 1) / 5)
    assert ratios["reward_kl/mean"] == pytest.approx([1.0, 5.0])  # sums for the controller to add
    assert metrics == {"reward_kl/coef": 0.1}

    cost_out, _, cost_ratios = algo_steps.compute_advantages(
        _rollout(K.COSTS, K.COST_VALUES),
        _advantage_node("cost_adv", ["responses", "costs", "cost_values"], ["cost_advantages"], estimator="gae"),
        {},
    )
    assert set(cost_out.keys()) == {K.COST_ADVANTAGES, K.COST_RETURNS}
    assert_close(cost_out[K.COST_ADVANTAGES].double(), t([[0.5, 0.8, 0.6], [1.0, 1.5, 0.0]]), rtol=0, atol=1e-6)
    assert "cost_advantage/abs_mean" in cost_ratios
    with pytest.raises(ValueError, match="needs inputs"):
        algo_steps.compute_advantages(
            _rollout(), _advantage_node("adv", ["responses", "scores", "values"], ["advantages"], **options), state
        )


def test_apply_safety_steps_lambda_then_combines():
    batch = TensorDict(
        {K.COSTS: t([1.0, 0.0]), K.ADVANTAGES: t([[1.0], [-1.0]]), K.COST_ADVANTAGES: t([[0.5], [2.0]])},
        batch_size=[2],
    )
    from hybridflow.spec.graph import UpdateOptions

    opts = UpdateOptions(safety={"cost_threshold": 0.1, "lambda_init": 0.5, "lambda_lr": 1.0})
    lam = LagrangeMultiplier(0.5, 1.0, 0.1)
    metrics = algo_steps.apply_safety(batch, opts, lam)
    # mean cost 0.5 > 0.1: lambda 0.5 + 0.4 = 0.9; A = (A - 0.9 A_c) / 1.9.
    assert metrics["safety/lambda"] == pytest.approx(0.9)
    assert_close(batch[K.ADVANTAGES], t([[(1 - 0.45) / 1.9], [(-1 - 1.8) / 1.9]]))


# -- graph-file side: names checked at load, algorithm state registered for checkpoints ------


@pytest.mark.parametrize(
    "override, field, expected",
    [
        ("nodes.advantage.options.estimator=gea", "nodes[5].options.estimator", "unknown advantage estimator 'gea'; known: distill, gae"),
        ("nodes.update_actor.options.loss_agg=mean", "nodes[7].options.loss_agg", "unknown loss aggregation 'mean'"),
        ("nodes.update_actor.options.clip_ratio_c=0.5", "nodes[7].options.clip_ratio_c", "greater than 1"),
    ],
)
def test_unknown_algorithm_names_are_one_line_spec_errors(override, field, expected):
    from pathlib import Path

    from hybridflow.graph.plugins import load_graph_spec
    from hybridflow.spec.loading import SpecError

    path = Path(__file__).resolve().parent.parent / "graphs" / "ppo.yaml"
    with pytest.raises(SpecError) as info:
        load_graph_spec(path, [override])
    message = str(info.value)
    assert message.startswith(f"{path}: {field}: ") and expected in message and "\n" not in message


def test_controllers_are_built_for_the_nodes_a_worker_runs():
    from hybridflow.graph.library import ppo, safe_rlhf

    spec = safe_rlhf().spec()
    state = algo_steps.build_controllers(spec, list(spec.models))
    assert sorted(state) == ["kl_ctrl/advantage", "lagrange/update_actor"]
    assert state["lagrange/update_actor"].state_dict() == {"value": 0.0}
    assert algo_steps.build_controllers(spec, ["reward", "cost"]) == {}
    spec = ppo().spec()
    node = next(n for n in spec.nodes if n.name == "advantage")
    options = node.options.model_copy(update={"kl_target": 0.01})
    tuned = spec.model_copy(update={"nodes": [node.model_copy(update={"options": options})]})
    assert isinstance(algo_steps.build_controllers(tuned, ["actor"])["kl_ctrl/advantage"], AdaptiveKLController)
