"""Rollout correction (algos/rollout_correction.py) against hand-computed values.

The log-probs are built as ``old = rollout + log(rho)`` with ratios chosen by hand, so every
expected number below is written from the ratios, not computed by the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from hybridflow.algos import IS_LEVELS, UnknownNameError, correction_metrics, correction_stats, rollout_correction

F64 = torch.float64

# Two rows, R = 3. Row 0: three valid tokens with ratios 3, 1/2, 1 (product 3/2).
# Row 1: one valid token with ratio 1/4; its padding has wild values that must not count.
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -1.0]], dtype=F64)
RATIOS = torch.tensor([[3.0, 0.5, 1.0], [0.25, 100.0, 1e-3]], dtype=F64)
OLD = ROLLOUT + RATIOS.log()
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def correct(**kwargs):
    return rollout_correction(OLD, ROLLOUT, MASK, **kwargs)


def test_token_truncated_is():
    out = correct(is_level="token", is_cap=2.0)
    assert_close(out.weights, torch.tensor([[2.0, 0.5, 1.0], [0.25, 0.0, 0.0]], dtype=F64))
    assert out.keep_mask.tolist() == [[True, True, True], [True, False, False]]
    assert out.clipped_mask.tolist() == [[True, False, False], [False, False, False]]


def test_sequence_truncated_is():
    # Row 0: 3 * 0.5 * 1 = 1.5 on every token; row 1: 0.25.
    out = correct(is_level="sequence", is_cap=2.0)
    assert_close(out.weights, torch.tensor([[1.5, 1.5, 1.5], [0.25, 0.0, 0.0]], dtype=F64))
    assert not out.clipped_mask.any()
    capped = correct(is_level="sequence", is_cap=1.2)
    assert_close(capped.weights, torch.tensor([[1.2, 1.2, 1.2], [0.25, 0.0, 0.0]], dtype=F64))
    assert capped.clipped_mask.tolist() == [[True, True, True], [False, False, False]]


def test_geometric_ratio():
    geo = 1.5 ** (1 / 3)  # 1.1447...
    out = correct(is_level="geometric", is_cap=10.0)
    assert_close(out.weights, torch.tensor([[geo, geo, geo], [0.25, 0.0, 0.0]], dtype=F64))


def test_is_off_gives_unit_weights_on_the_mask():
    out = correct(is_level=None)
    assert_close(out.weights, MASK.to(F64))
    assert not out.clipped_mask.any()


def test_token_rejection_icepop():
    # Bounds [0.4, 2.5]: ratio 3 and ratio 0.25 are out; row 1 loses its only token.
    out = correct(is_level=None, reject_level="token", reject_low=0.4, reject_high=2.5)
    assert out.keep_mask.tolist() == [[False, True, True], [False, False, False]]
    assert_close(out.weights, torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=F64))


def test_sequence_and_geometric_rejection():
    seq = correct(is_level=None, reject_level="sequence", reject_low=0.4, reject_high=2.5)
    assert seq.keep_mask.tolist() == [[True, True, True], [False, False, False]]
    # MIS: no lower bound, cap 1.4 -> row 0 (1.5) is dropped, row 1 (0.25) kept.
    mis = correct(is_level=None, reject_level="sequence", reject_low=0.0, reject_high=1.4)
    assert mis.keep_mask.tolist() == [[False, False, False], [True, False, False]]
    # geometric 1.1447 > 1.1: row 0 dropped
    geo = correct(is_level=None, reject_level="geometric", reject_low=0.2, reject_high=1.1)
    assert geo.keep_mask.tolist() == [[False, False, False], [True, False, False]]


def test_is_and_rejection_compose():
    out = correct(is_level="token", is_cap=2.0, reject_level="token", reject_low=0.4, reject_high=2.5)
    assert_close(out.weights, torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.0, 0.0]], dtype=F64))
    metrics = correction_metrics(*correction_stats(out, MASK))
    assert metrics == pytest.approx(
        {
            "is_weight_mean": 0.75,  # kept tokens 0.5 and 1
            "is_weight_max": 1.0,
            "is_weight_min": 0.5,
            "clipped_frac": 0.25,  # ratio 3 of 4 valid tokens (then also rejected)
            "masked_frac": 0.5,  # 2 of 4 valid tokens dropped
            "rejected_seq_frac": 0.5,  # row 1
        }
    )


def test_metrics_of_token_tis():
    out = correct(is_level="token", is_cap=2.0)
    metrics = correction_metrics(*correction_stats(out, MASK))
    assert metrics == pytest.approx(
        {
            "is_weight_mean": (2.0 + 0.5 + 1.0 + 0.25) / 4,
            "is_weight_max": 2.0,
            "is_weight_min": 0.25,
            "clipped_frac": 0.25,
            "masked_frac": 0.0,
            "rejected_seq_frac": 0.0,
        }
    )


def test_stats_add_up_over_ranks():
    """Sums added and extremes maxed over two halves give the whole batch's metrics."""
    whole = correction_metrics(*correction_stats(correct(is_level="token", is_cap=2.0), MASK))
    parts = [
        correction_stats(rollout_correction(OLD[i : i + 1], ROLLOUT[i : i + 1], MASK[i : i + 1], "token", 2.0), MASK[i : i + 1])
        for i in range(2)
    ]
    sums = parts[0][0] + parts[1][0]
    extremes = torch.maximum(parts[0][1], parts[1][1])
    assert correction_metrics(sums, extremes) == pytest.approx(whole)


def test_everything_rejected_reports_no_weights():
    out = correct(is_level="token", reject_level="geometric", reject_low=0.9, reject_high=1.0)
    metrics = correction_metrics(*correction_stats(out, MASK))
    assert "is_weight_mean" not in metrics
    assert metrics["masked_frac"] == 1.0 and metrics["rejected_seq_frac"] == 1.0


def test_huge_log_ratios_stay_finite_and_weights_are_detached():
    old = torch.tensor([[30.0, 0.0]], dtype=torch.float32, requires_grad=True)
    rollout = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    for level in ("token", "sequence", "geometric"):
        out = rollout_correction(old, rollout, mask, level, is_cap=math.inf)
        assert torch.isfinite(out.weights).all()
        assert not out.weights.requires_grad
    assert_close(rollout_correction(old, rollout, mask, "token", is_cap=math.inf).weights[0, 0], torch.tensor(math.exp(20.0)))


def test_unknown_level_names_the_known_ones():
    with pytest.raises(UnknownNameError, match="geometric, sequence, token"):
        correct(is_level="tokens")
    assert IS_LEVELS.names() == ["geometric", "sequence", "token"]


@pytest.mark.parametrize(
    "options", [{"rollout_correction": {"is_level": "token"}}, {"old_log_probs": "rollout"}]
)
def test_an_update_that_reads_rollout_log_probs_refuses_a_partly_recorded_batch(options):
    """rollout.log_prob_check_samples records a sample of rows; an update that reads the rollout's
    log-probs needs them all, and says so instead of training on zeros."""
    from tensordict import TensorDict

    from hybridflow.data import keys as K
    from hybridflow.spec.graph import UpdateOptions
    from hybridflow.workers.algo_steps import check_rollout_log_probs_recorded

    def batch(recorded):
        return TensorDict({K.ROLLOUT_LOG_PROBS_RECORDED: torch.tensor(recorded),
                           K.ROLLOUT_LOG_PROBS: torch.zeros(len(recorded), 2)}, batch_size=[len(recorded)])

    reads = UpdateOptions(**options)
    refused = r"'update_actor' \(reads rollout_log_probs\) needs the rollout's log-probs of every sample"
    with pytest.raises(ValueError, match=refused):
        check_rollout_log_probs_recorded(batch([True, False, True]), reads, "update_actor")
    with pytest.raises(ValueError, match=refused):  # none recorded at all
        check_rollout_log_probs_recorded(TensorDict({}, batch_size=[3]), reads, "update_actor")
    check_rollout_log_probs_recorded(batch([True, True, True]), reads, "update_actor")
    hf_rollout = batch([True] * 3).exclude(K.ROLLOUT_LOG_PROBS_RECORDED)  # every row, no flag
    check_rollout_log_probs_recorded(hf_rollout, reads, "update_actor")
    # An update that does not read them takes the sample (the consistency check's).
    check_rollout_log_probs_recorded(batch([True, False, False]), UpdateOptions(), "update_actor")
