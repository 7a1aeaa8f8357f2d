"""Advantage statistics over data-parallel ranks: 2 gloo ranks, each with half the prompt groups,
against 1 rank with the whole batch.

No rank gathers the batch: group statistics are local (a rank holds whole groups), batch-wide
ones all-reduce their partial sums. Group-local estimators must agree bit for bit; batch-wide
statistics (whitening, ``scope: batch``, the KL-in-reward mean, the safety cost, the explained
variance, the metrics) agree up to the rounding of a sum taken in two parts.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from hybridflow.algos import AdaptiveKLController, LagrangeMultiplier, local_sum
from hybridflow.controller.metrics import reduce_metas
from hybridflow.data import keys as K
from hybridflow.graph.dag import resolve_node
from hybridflow.spec.graph import AdvantageNode, ModelSpec, UpdateOptions
from hybridflow.workers import algo_steps

pytestmark = pytest.mark.slow

GROUPS, PER_GROUP, LENGTH = 6, 4, 7
ROWS = GROUPS * PER_GROUP
INPUTS = ["responses", "scores", "values", "baseline_scores", "old_log_probs", "ref_log_probs"]
# (case name, estimator options, bit-exact across ranks)
CASES = [
    ("grpo", {"estimator": "grpo"}, True),
    ("dr_grpo", {"estimator": "grpo", "norm_by_std": False}, True),
    ("grpo_batch", {"estimator": "grpo", "scope": "batch"}, False),
    ("rloo", {"estimator": "rloo"}, True),
    ("remax", {"estimator": "remax"}, True),
    ("gae", {"estimator": "gae", "gamma": 0.99, "gae_lambda": 0.95}, True),
    ("gae_whiten", {"estimator": "gae", "gamma": 0.99, "gae_lambda": 0.95, "whiten": True}, False),
    ("rpp", {"estimator": "reinforce_plus_plus", "gamma": 0.9}, False),
    ("rpp_baseline", {"estimator": "reinforce_plus_plus_baseline"}, False),
    ("gae_kl", {"estimator": "gae", "kl_coef": 0.05, "kl_estimator": "k3", "kl_target": 0.01}, True),
]


def _batch() -> TensorDict:
    """6 prompts x 4 samples with ragged responses (rank 0's half longer than rank 1's)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, LENGTH + 1, (ROWS,), generator=gen)
    lengths[: ROWS // 2] = lengths[: ROWS // 2].clamp(min=4)
    mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
    return TensorDict(
        {
            K.RESPONSE_MASK: mask,
            K.UID: torch.arange(GROUPS).repeat_interleave(PER_GROUP),
            K.SCORES: torch.randn(ROWS, generator=gen),
            K.BASELINE_SCORES: torch.randn(ROWS, generator=gen),
            K.VALUES: torch.randn(ROWS, LENGTH, generator=gen) * mask,
            K.OLD_LOG_PROBS: (-1.0 - torch.rand(ROWS, LENGTH, generator=gen)) * mask,
            K.REF_LOG_PROBS: (-1.0 - torch.rand(ROWS, LENGTH, generator=gen)) * mask,
            K.COSTS: torch.rand(ROWS, generator=gen),
            K.ADVANTAGES: torch.randn(ROWS, LENGTH, generator=gen) * mask,
            K.COST_ADVANTAGES: torch.randn(ROWS, LENGTH, generator=gen) * mask,
            K.RETURNS: torch.randn(ROWS, LENGTH, generator=gen) * mask,
        },
        batch_size=[ROWS],
    )


def _node(name: str, options: dict):
    spec = AdvantageNode(name=name, op="advantage", model="actor", inputs=INPUTS, outputs=["advantages"], options=options)
    return resolve_node(spec, ModelSpec(role="actor", source={"config": {}}))


def _run_all(batch: TensorDict, reduce_sum) -> dict:
    """Every case on ``batch`` (this rank's part), plus the safety step and explained variance."""
    out = {}
    for name, options, _ in CASES:
        node = _node(name, options)
        state = {f"kl_ctrl/{name}": AdaptiveKLController(0.05, 0.01, 100.0)}
        result, metrics, ratios = algo_steps.compute_advantages(batch, node, state, reduce_sum)
        out[name] = (result[K.ADVANTAGES], result[K.RETURNS], metrics, state[f"kl_ctrl/{name}"].value, dict(ratios))
    safety = UpdateOptions(safety={"cost_threshold": 0.3, "lambda_init": 0.5, "lambda_lr": 1.0})
    local = batch.clone()
    metrics = algo_steps.apply_safety(local, safety, LagrangeMultiplier(0.5, 1.0, 0.3), reduce_sum)
    out["safety"] = (local[K.ADVANTAGES], metrics)
    out["explained_var"] = algo_steps.critic_explained_variance(batch, K.VALUES, K.RETURNS, reduce_sum)
    return out


def _rank(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist

    from megatron_harness import init_dist

    init_dist(rank, world, port)
    half = _batch()[rank * ROWS // world : (rank + 1) * ROWS // world]
    torch.save(_run_all(half, algo_steps.dp_sum()), f"{path}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_ranks_compute_the_statistics_of_one(tmp_path):
    from megatron_harness import spawn

    spawn(_rank, 2, str(tmp_path))
    halves = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    whole = _run_all(_batch(), local_sum)

    for name, _, exact in CASES:
        advantages, returns, metrics, kl_coef, ratios = whole[name]
        got_adv = torch.cat([h[name][0] for h in halves])
        got_ret = torch.cat([h[name][1] for h in halves])
        if exact:
            assert torch.equal(got_adv, advantages) and torch.equal(got_ret, returns), name
        else:
            torch.testing.assert_close(got_adv, advantages, rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(got_ret, returns, rtol=1e-5, atol=1e-6, msg=name)
        for half in halves:  # batch metrics and controllers: the same on every rank
            assert half[name][2] == pytest.approx(metrics, rel=1e-5, abs=1e-7), name
            assert half[name][3] == pytest.approx(kl_coef, rel=1e-6), name
        # logged means: each rank sends its sums, the controller adds them (no collective)
        combined = reduce_metas([{"num_samples": 1, "ratios": h[name][4]} for h in halves])
        assert combined == pytest.approx(reduce_metas([{"num_samples": 1, "ratios": ratios}]), rel=1e-5, abs=1e-7), name
        assert set(combined) == set(ratios) and len(combined) >= 2, name
    assert whole["gae_kl"][3] != 0.05  # the adaptive controller moved: the KL mean was used

    safe_adv = torch.cat([h["safety"][0] for h in halves])
    torch.testing.assert_close(safe_adv, whole["safety"][0], rtol=1e-5, atol=1e-6)
    for half in halves:
        assert half["safety"][1] == pytest.approx(whole["safety"][1], rel=1e-6)
        assert half["explained_var"] == pytest.approx(whole["explained_var"], rel=1e-5)
