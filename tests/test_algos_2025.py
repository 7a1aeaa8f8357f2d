"""Issue 21's algorithm pieces, worked out by hand: gaps in masks, fully masked rows, the
bounded k3, group estimators at one sample per prompt, GSPO, CISPO, the named loss
normalisations (TRL's loss_types) and DAPO's overlong punishment.

A *gap* is a masked token before a row's last valid token (an observation token of a
multi-turn rollout); a *fully masked* row has no valid token (a truncated response masked out
of the loss).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.testing import assert_close

from hybridflow.algos import (
    LOSS_AGGS,
    POLICY_LOSSES,
    agg_loss,
    cispo_policy_loss,
    count_sequences,
    discounted_returns,
    gae_advantage,
    gspo_policy_loss,
    ppo_clip_policy_loss,
    reinforce_plus_plus_advantage,
    reinforce_plus_plus_baseline_advantage,
)
from hybridflow.rewards.overlong import overlong_penalty

ROOT = Path(__file__).resolve().parent.parent
F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


# -- gaps: GAE and discounted returns skip them ---------------------------------------------


def test_gae_skips_a_gap_with_no_discount_step():
    # gamma 0.9, lambda 0.5; row 0 = [valid, gap, valid] with junk (9, 7) in the gap.
    # t = 2: delta = 1 - 0.4 = 0.6 = A_2. t = 1 (gap): carries V_next = 0.4, A_next = 0.6.
    # t = 0: delta = 0.9 * 0.4 - 0.5 = -0.14, A_0 = -0.14 + 0.45 * 0.6 = 0.13.
    # Row 1 is row 0 without the gap: the same advantages on its two tokens.
    rewards = t([[0.0, 7.0, 1.0], [0.0, 1.0, 0.0]])
    values = t([[0.5, 9.0, 0.4], [0.5, 0.4, 0.0]])
    mask = t([[1, 0, 1], [1, 1, 0]], torch.int64)
    advantages, returns = gae_advantage(rewards, values, mask, gamma=0.9, gae_lambda=0.5)
    assert_close(advantages, t([[0.13, 0.0, 0.6], [0.13, 0.6, 0.0]]), rtol=0, atol=1e-12)
    assert_close(returns, t([[0.63, 0.0, 1.0], [0.63, 1.0, 0.0]]), rtol=0, atol=1e-12)


def test_gae_and_returns_with_gaps_equal_the_compacted_rows():
    # Any gaps (and a leading one) give, on the valid tokens, what the row gives with its
    # masked tokens removed; junk in the masked positions never leaks.
    gen = torch.Generator().manual_seed(0)
    mask = t([[1, 0, 0, 1, 1, 0, 1, 0], [0, 1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]], torch.int64)
    rewards = torch.rand(3, 8, generator=gen, dtype=F64)
    values = torch.rand(3, 8, generator=gen, dtype=F64)
    adv, ret = gae_advantage(rewards, values, mask, gamma=0.8, gae_lambda=0.7)
    disc = discounted_returns(rewards, mask, 0.7)
    for i in range(3):
        keep = mask[i].bool()
        one = torch.ones(1, int(keep.sum()), dtype=torch.int64)
        a, r = gae_advantage(rewards[i, keep][None], values[i, keep][None], one, gamma=0.8, gae_lambda=0.7)
        assert_close(adv[i, keep], a[0], rtol=0, atol=1e-12)
        assert_close(ret[i, keep], r[0], rtol=0, atol=1e-12)
        assert_close(disc[i, keep], discounted_returns(rewards[i, keep][None], one, 0.7)[0], rtol=0, atol=1e-12)
        assert (adv[i, ~keep] == 0).all() and (disc[i, ~keep] == 0).all()


def test_discounted_returns_carry_over_a_gap():
    # gamma 0.5, mask [1, gap, 1, 1, pad], junk 7 in the gap: G_3 = 2, G_2 = 0 + 0.5 * 2 = 1,
    # the gap carries 1 with no discount step, G_0 = 1 + 0.5 * 1 = 1.5.
    rewards = t([[1.0, 7.0, 0.0, 2.0, 0.0]])
    mask = t([[1, 0, 1, 1, 0]], torch.int64)
    assert_close(discounted_returns(rewards, mask, 0.5), t([[1.5, 0.0, 1.0, 2.0, 0.0]]), rtol=0, atol=0)
    advantages, returns = reinforce_plus_plus_advantage(rewards, mask, gamma=0.5)
    assert_close(returns, t([[1.5, 0.0, 1.0, 2.0, 0.0]]), rtol=0, atol=0)


def test_reinforce_plus_plus_baseline_with_a_leading_gap_uses_the_first_valid_return():
    # Row 0 starts with an observation token: its sequence return is G at t = 1, = 1 (gamma 1).
    # Rows 0 and 1 share uid 0: baseline (1 + 3) / 2 = 2 -> centred -1 -1 | 1 (row 1 is one token).
    mask = t([[0, 1, 1], [1, 0, 0]], torch.int64)
    rewards = t([[5.0, 0.0, 1.0], [3.0, 0.0, 0.0]])
    advantages, returns = reinforce_plus_plus_baseline_advantage(rewards, mask, t([0, 0], torch.int64))
    assert_close(returns, t([[0.0, 1.0, 1.0], [3.0, 0.0, 0.0]]), rtol=0, atol=0)
    # centred -1 -1 1: mean -1/3, deviations -2/3 -2/3 4/3, var (4/9 + 4/9 + 16/9) / 2 = 4/3.
    std = math.sqrt(4 / 3 + 1e-8)
    expected = t([[0.0, -2 / 3 / std, -2 / 3 / std], [4 / 3 / std, 0.0, 0.0]])
    assert_close(advantages, expected, rtol=0, atol=1e-12)


# -- degenerate groups --------------------------------------------------------------------------


def test_reinforce_plus_plus_baseline_at_one_sample_per_prompt_is_plain_reinforce_plus_plus():
    # verl's fallback: a group of one has baseline 0, so each sample keeps its own return.
    rewards = t([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [2.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0]], torch.int64)
    base, base_returns = reinforce_plus_plus_baseline_advantage(rewards, mask, t([0, 1, 2], torch.int64))
    plain, plain_returns = reinforce_plus_plus_advantage(rewards, mask)
    assert_close(base, plain, rtol=0, atol=0)
    assert_close(base_returns, plain_returns, rtol=0, atol=0)
    assert base.abs().sum() > 0  # not the all-zero advantages of a group baseline


def _validate(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridflow.cli.main", "validate", *overrides],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )


@pytest.mark.parametrize(
    "graph, overrides, refused",
    [
        ("grpo", [], True),
        ("rloo", [], True),
        ("grpo", ["nodes.advantage.options.scope=batch"], False),  # compares across prompts
        ("grpo", ["nodes.advantage.options.estimator=reinforce_plus_plus_baseline"], False),  # fallback
        ("grpo", ["nodes.advantage.options.estimator=reinforce_plus_plus"], False),
    ],
)
def test_validate_refuses_group_estimators_at_one_sample_per_prompt(graph, overrides, refused):
    done = _validate(f"graphs/{graph}.yaml", "models.actor.rollout.n=1", *overrides)
    if not refused:
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    index = [n["name"] for n in yaml.safe_load((ROOT / "graphs" / f"{graph}.yaml").read_text())["nodes"]].index("advantage")
    assert lines[0].startswith(f"error: graphs/{graph}.yaml: nodes[{index}].options.estimator: ")
    assert "1 sample per prompt" in lines[0] and "rollout.n >= 2" in lines[0]


def test_remax_at_one_sample_per_prompt_validates():
    assert _validate("graphs/remax.yaml").returncode == 0


# -- fully masked rows in the aggregations --------------------------------------------------------

LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [1.0, 1.0, 1.0]])
MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], torch.int64)  # row 2: fully masked


@pytest.mark.parametrize(
    "mode, expected",
    [
        # Three sequences have tokens (rows 0, 1, 3); row 2 is in no numerator or denominator.
        ("token-mean", (1 + 2 + 4 + 3) / 6),
        ("seq-mean-token-sum", (3 + 4 + 3) / 3),
        ("seq-mean-token-mean", (1.5 + 4 + 1) / 3),
        ("seq-mean-token-sum-norm", (3 + 4 + 3) / (3 * 3)),
    ],
)
def test_fully_masked_rows_are_not_sequences(mode, expected):
    assert count_sequences(MASK) == 3
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected, rel=1e-15)
    # The same batch without the masked row: the same loss.
    keep = [0, 1, 3]
    assert agg_loss(LOSS[keep], MASK[keep], mode).item() == pytest.approx(expected, rel=1e-15)
    # Row by row with the global counts (as the engines pass them) adds up to it too.
    split = sum(agg_loss(LOSS[i : i + 1], MASK[i : i + 1], mode, 6.0, 3.0) for i in range(4))
    assert split.item() == pytest.approx(expected, rel=1e-15)


def test_every_row_masked_gives_zero_not_nan():
    empty = torch.zeros(2, 3, dtype=torch.int64)
    for mode in LOSS_AGGS.names():
        assert agg_loss(LOSS[:2], empty, mode).item() == 0.0, mode
        assert agg_loss(LOSS[:2], empty, mode, torch.tensor(0.0), torch.tensor(0.0)).item() == 0.0, mode


# -- TRL's loss_type names -------------------------------------------------------------------


def trl_loss(loss_type: str, per_token: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """TRL 1.16 GRPOTrainer's normalisations, for one micro-batch on one process."""
    m = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (per_token.size(0) * max_len)
    raise ValueError(loss_type)


def test_loss_type_names_are_verl_modes():
    assert LOSS_AGGS.get("grpo") is LOSS_AGGS.get("seq-mean-token-mean")
    assert LOSS_AGGS.get("dr_grpo") is LOSS_AGGS.get("seq-mean-token-sum-norm")
    assert LOSS_AGGS.get("dapo") is LOSS_AGGS.get("token-mean")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_types_reproduce_trl_over_micro_batches(loss_type):
    # 8 ragged rows (no fully masked one) in micro-batches of 2 (TRL: per-device batch 2, 4
    # accumulation steps on one process, or 2 processes x 2 steps). TRL's per-step losses
    # are divided by the accumulation steps and averaged over processes: the mean of the
    # micro-batch losses; dapo divides by the tokens of the whole accumulated batch.
    gen = torch.Generator().manual_seed(1)
    per_token = torch.randn(8, 5, generator=gen, dtype=F64)
    lengths = t([1, 5, 2, 3, 5, 1, 4, 2], torch.int64)
    mask = (torch.arange(5)[None] < lengths[:, None]).to(torch.int64)
    num_tokens, num_seqs = float(mask.sum()), 8.0
    ours = sum(
        agg_loss(per_token[i : i + 2], mask[i : i + 2], loss_type, num_tokens, num_seqs) for i in range(0, 8, 2)
    )
    if loss_type == "dapo":
        trl = (per_token * mask).sum() / mask.sum()
    else:
        trl = sum(trl_loss(loss_type, per_token[i : i + 2], mask[i : i + 2], 5) for i in range(0, 8, 2)) / 4
    assert ours.item() == pytest.approx(trl.item(), rel=1e-13)


def test_bnpo_depends_on_the_micro_batches_token_mean_does_not():
    # Micro-batches rows 0-1 (tokens 1 2 | 4: mean 7/3) and rows 2-3 (7 8 9 | 1: mean 25/4).
    loss = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [1.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], torch.int64)
    parts = [agg_loss(loss[i : i + 2], mask[i : i + 2], "bnpo", 7.0, 4.0) for i in (0, 2)]
    assert sum(parts).item() == pytest.approx((7 / 3 + 25 / 4) / 2, rel=1e-15)
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(32 / 7, rel=1e-15)
    assert agg_loss(loss, mask, "bnpo").item() == pytest.approx(32 / 7, rel=1e-15)  # one micro-batch


# -- GSPO ---------------------------------------------------------------------------------------


def _leaf(values):
    return t(values).requires_grad_(True)


def test_gspo_sequence_ratio_clip_and_gradient():
    # clip 0.2. Row 0: diffs 0.2 0.4 (junk 5 masked): s = e^0.3 = 1.3499 > 1.2, A = 1 ->
    #   max(-1.3499, -1.2) = -1.2 (clipped: no gradient).
    # Row 1: diffs -0.3 0 0.3: s = 1 (token ratios 0.74 and 1.35 leave the range, the sequence's
    #   does not), A = -2 -> loss 2 per token, d/dlogp_t = 2 * s = 2 per token.
    # Row 2: one token, diff 0.1: s = e^0.1, A = 0.5 -> -0.5 e^0.1, d/dlogp = -0.5 e^0.1.
    # Row 3: fully masked (junk): ratio 1, no loss, no gradient.
    old = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    logp = _leaf([[0.2, 0.4, 5.0], [-0.3, 0.0, 0.3], [0.1, 3.0, 3.0], [4.0, 4.0, 4.0]])
    adv = t([[1.0] * 3, [-2.0] * 3, [0.5] * 3, [1.0] * 3])
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], torch.int64)
    loss_mat, metrics = gspo_policy_loss(logp, old, adv, mask, clip_ratio=0.2)
    e01 = math.exp(0.1)
    expected = t([[-1.2, -1.2, -1.2], [2.0, 2.0, 2.0], [-0.5 * e01] * 3, [-1.0] * 3])
    assert_close(loss_mat, expected, rtol=0, atol=1e-12)
    loss = agg_loss(loss_mat, mask, "seq-mean-token-mean")  # GSPO's aggregation; 3 sequences
    assert loss.item() == pytest.approx((-1.2 + 2.0 - 0.5 * e01) / 3, rel=1e-12)
    loss.backward()
    # Row 1: d/dlogp_t = 2 * (1/3 tokens) / 3 seqs; row 2: -0.5 e^0.1 / 3.
    grad = t([[0.0, 0.0, 0.0], [2 / 9, 2 / 9, 2 / 9], [-0.5 * e01 / 3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(logp.grad, grad, rtol=0, atol=1e-12)
    assert metrics["seq_clip_frac"] == pytest.approx(1 / 3)
    assert metrics["clip_frac"] == pytest.approx(2 / 6)  # row 0's two tokens of six valid
    # The sequence form's gradient: d/dlogp_t of -A * exp(mean(logp - old)) is -A s / |y|.
    logp2 = _leaf([[-0.3, 0.0, 0.3]])
    (-(-2.0) * (logp2.mean() - 0.0).exp()).backward()
    assert_close(logp.grad[1] * 3, logp2.grad[0], rtol=0, atol=1e-12)
    # Token-level PPO on row 1 clips token 0 (A < 0, ratio 0.74 < 0.8): a different loss.
    ppo, _ = ppo_clip_policy_loss(logp.detach()[1:2], old[1:2], adv[1:2], mask[1:2], clip_ratio=0.2)
    assert ppo[0, 0].item() == pytest.approx(2 * 0.8)


def test_gspo_asymmetric_clip_and_zero_advantage_group():
    # s = e^0.3 with high 0.4: not clipped (1.3499 < 1.4); all-equal rewards -> A = 0 -> no loss.
    logp = _leaf([[0.3, 0.3]])
    loss_mat, metrics = gspo_policy_loss(logp, t([[0.0, 0.0]]), t([[1.0, 1.0]]), t([[1, 1]]), clip_ratio_low=0.2, clip_ratio_high=0.4)
    assert_close(loss_mat, t([[-math.exp(0.3)] * 2]), rtol=0, atol=1e-12)
    assert metrics["seq_clip_frac"] == 0.0
    zero, _ = gspo_policy_loss(logp, t([[0.0, 0.0]]), t([[0.0, 0.0]]), t([[1, 1]]))
    agg_loss(zero, t([[1, 1]]), "seq-mean-token-mean").backward()
    assert (logp.grad == 0).all()


# -- CISPO ------------------------------------------------------------------------------------


def test_cispo_clips_the_weight_and_keeps_the_gradient():
    # logp -1 -2, old -1.5 -1: ratios e^0.5 = 1.65 and e^-1 = 0.37; low 0.2, high 0.28 -> weights
    # 1.28 and 0.8 (both clipped). A = 1: loss = -w * A * logp = 1.28, 1.6;
    # d/dlogp = -w * A = -1.28, -0.8 (PPO's clip would give token 0 no gradient).
    logp = _leaf([[-1.0, -2.0, 0.0]])
    old = t([[-1.5, -1.0, 0.0]])
    adv = t([[1.0, 1.0, 1.0]])
    mask = t([[1, 1, 0]], torch.int64)
    loss_mat, metrics = cispo_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert_close(loss_mat[:, :2], t([[1.28, 1.6]]), rtol=0, atol=1e-12)
    agg_loss(loss_mat, mask, "token-mean").backward()
    assert_close(logp.grad, t([[-1.28 / 2, -0.8 / 2, 0.0]]), rtol=0, atol=1e-12)
    assert metrics["clip_frac"] == 1.0
    ppo_logp = _leaf([[-1.0, -2.0, 0.0]])
    ppo, _ = ppo_clip_policy_loss(ppo_logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    agg_loss(ppo, mask, "token-mean").backward()
    assert ppo_logp.grad[0, 0] == 0


def test_cispo_inside_the_range_is_importance_weighted_reinforce():
    # ratio e^0.1 inside [0.8, 1.2]: weight e^0.1; A = -0.5 -> grad = 0.5 e^0.1 (no clip).
    logp = _leaf([[-0.9]])
    loss_mat, metrics = cispo_policy_loss(logp, t([[-1.0]]), t([[-0.5]]), t([[1]]))
    loss_mat.sum().backward()
    assert logp.grad.item() == pytest.approx(0.5 * math.exp(0.1), rel=1e-12)
    assert metrics["clip_frac"] == 0.0


def test_policy_losses_are_registered():
    assert POLICY_LOSSES.get("gspo") is gspo_policy_loss and POLICY_LOSSES.get("cispo") is cispo_policy_loss


# -- DAPO's overlong punishment --------------------------------------------------------------


def test_overlong_penalty_rises_over_the_buffer():
    # max 8, buffer 4: nothing up to 4 tokens, then 1/4 per token, the whole penalty at 8.
    lengths = t([1, 4, 5, 6, 8], torch.int64)
    assert_close(overlong_penalty(lengths, 8, 4, 1.0), t([0.0, 0.0, 0.25, 0.5, 1.0], torch.float32))
    assert_close(overlong_penalty(lengths, 8, 4, 0.5), t([0.0, 0.0, 0.125, 0.25, 0.5], torch.float32))
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_penalty(lengths, 8, 9, 1.0)


def test_an_overlong_buffer_longer_than_the_responses_is_one_line_before_any_worker(monkeypatch, capsys):
    from hybridflow.cli.main import main

    monkeypatch.chdir(ROOT)
    assert main(["validate", "graphs/grpo_smollm2_rm.yaml", "data.max_response_length=8",
                 "nodes.reward.options.overlong_buffer=9"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: graphs/grpo_smollm2_rm.yaml: nodes[1].options.overlong_buffer: 9 tokens is longer than "
                   "the responses (data.max_response_length = 8); the buffer is their last tokens\n")
