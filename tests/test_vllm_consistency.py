"""The rollout/training log-prob consistency statistics and the stop (no vLLM needed)."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.hybrid_engine.consistency import (
    ConsistencyStats,
    RolloutMismatchError,
    check_consistency,
)


def test_stats_hand_case_over_micro_batches_and_freeze():
    stats = ConsistencyStats()
    train = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    rollout = torch.tensor([[-1.5, -2.0, -9.0], [-0.5, -0.25, -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # column 2 is padding: ignored
    stats.add(train[:1], rollout[:1], mask[:1])  # micro-batch 1: diffs 0.5, 0
    stats.add(train[1:], rollout[1:], mask[1:])  # micro-batch 2: diffs 0, -0.25
    stats.frozen = True
    stats.add(train, rollout - 100, mask)  # after an optimizer step: not counted
    out = stats.reduce()
    assert out["rollout_log_prob_diff_mean"] == pytest.approx(0.75 / 4)
    assert out["rollout_log_prob_diff_max"] == pytest.approx(0.5)
    ratios = [math.exp(0.5), 1.0, 1.0, math.exp(-0.25)]
    assert out["rollout_ratio_mean"] == pytest.approx(sum(ratios) / 4)
    assert out["rollout_ratio_max"] == pytest.approx(math.exp(0.5))
    assert out["rollout_ratio_min"] == pytest.approx(math.exp(-0.25))
    assert ConsistencyStats().reduce() == {}


def test_check_stops_above_tolerance_only():
    stats = ConsistencyStats()
    stats.add(torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.2, -1.0]]), torch.tensor([[1, 1]]))
    metrics = stats.reduce()  # mean 0.1
    check_consistency(metrics, None, model="actor", engine="vllm")  # report only
    check_consistency(metrics, 0.2, model="actor", engine="vllm")
    with pytest.raises(RolloutMismatchError, match=r"mean \|diff\| 0.1 > models.actor.rollout."
                       r"log_prob_tolerance=0.05 \(max \|diff\| 0.2, importance ratio 1..1.22\)"):
        check_consistency(metrics, 0.05, model="actor", engine="vllm")
    with pytest.raises(RolloutMismatchError):
        check_consistency({**metrics, "rollout_log_prob_diff_mean": math.nan}, 1.0, model="a", engine="hf")
