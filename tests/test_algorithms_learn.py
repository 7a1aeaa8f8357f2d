"""Every shipped algorithm graph learns on CPU with its defaults and a fixed seed.

One full default run per graph file (``graphs/<name>.yaml``, no override but the run directory
and the progress bar): the mean reward of the last 10 iterations must beat the first 10 by at
least 0.2. GRPO (the showcase run) must also learn to stop: at most 10% of its responses
truncated over the last 10 iterations, with the reward up by at least 0.3. PPO: the critic's explained variance over the last 10 iterations is positive and
above the first 10's. Safe-RLHF: the mean cost starts above its threshold and ends at it (the
second half's mean below the threshold plus two batch-means standard errors: the Lagrangian's
equilibrium is a time-average cost = threshold), and the Lagrange multiplier rises while the cost
is above the threshold.

These are the slowest tests of the suite (one to two minutes each on an idle 2-core machine).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import mean, stdev

import pytest

from hybridflow.graph.dag import load_graph

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def run_default(name: str, run_dir: Path) -> list[dict]:
    from hybridflow.controller.trainer import Trainer

    graph = load_graph(ROOT / "graphs" / f"{name}.yaml", ["trainer.progress=false"])
    Trainer(graph, run_dir=str(run_dir)).fit()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def first_last(rows: list[dict], key: str) -> tuple[float, float]:
    values = [r[key] for r in rows]
    return mean(values[:10]), mean(values[-10:])


@pytest.mark.parametrize("name", ["grpo", "ppo", "remax", "rloo", "safe_rlhf"])
def test_default_run_learns(ray_session, tmp_path, name):
    rows = run_default(name, tmp_path / name)
    first, last = first_last(rows, "reward/mean")
    assert last - first >= 0.2, f"{name}: reward {first:.3f} -> {last:.3f}"
    if name == "grpo":
        assert last - first >= 0.3, f"{name}: reward {first:.3f} -> {last:.3f}"
        _, truncated = first_last(rows, "response/truncated_frac")
        assert truncated <= 0.1, f"{name}: {truncated:.2f} of the last 10 iterations' responses truncated"
    for row in rows:
        # explained variance is nan for a batch whose returns are all equal
        assert all(math.isfinite(v) for k, v in row.items() if not k.endswith("/explained_var")), row

    if name == "ppo":
        ev_first, ev_last = first_last(rows, "critic/explained_var")
        assert ev_last > 0 and ev_last > ev_first, (ev_first, ev_last)

    if name == "safe_rlhf":
        safety = load_graph(ROOT / "graphs" / "safe_rlhf.yaml").node("update_actor").spec.options.safety
        threshold = safety.cost_threshold
        costs = [r["cost/mean"] for r in rows]
        # Dual ascent settles the *time-average* cost at the threshold d, oscillating about it
        # (lambda rises while the cost is above d, then falls to 0 and lets it rise again), so
        # successive iterations are correlated: 10-iteration means of one run range 0.04-0.12 at
        # d = 0.1. The check is on the second half of the run, with the standard error taken from
        # its 10-iteration batch means, which carry that correlation.
        second = costs[len(costs) // 2:]
        chunks = [mean(second[i:i + 10]) for i in range(0, len(second) - 9, 10)]
        noise = 2 * stdev(chunks) / math.sqrt(len(chunks))
        cost_first = mean(costs[:10])
        assert cost_first > threshold + noise and mean(second) < threshold + noise, (
            cost_first, threshold, noise, mean(second))
        # lambda is stepped on each batch's own mean cost: it rises exactly when that is above d.
        lambdas = [r["safety/lambda"] for r in rows]
        for prev, row in zip([None, *lambdas], rows):
            before = safety.lambda_init if prev is None else prev
            if row["safety/mean_cost"] > threshold:
                assert row["safety/lambda"] > before
        assert max(lambdas) > lambdas[0]


# -- issue 21: DAPO (dynamic sampling), GSPO, CISPO ------------------------------------------
# Their full runs (300-400 iterations at 16 x 16, the README's rows: each +0.3 or more) are too
# long for the suite; each shipped file runs a few iterations end to end here instead, at its
# earlier 8 samples per prompt (more of DAPO's groups are all-equal there, so the filter refills
# within 4 iterations), with its own losses and dynamic sampling's bookkeeping checked.
ISSUE_21_ITERATIONS = {"dapo": 4, "gspo": 4, "cispo": 4}
ISSUE_21_SAMPLES = 8


@pytest.mark.parametrize("name", sorted(ISSUE_21_ITERATIONS))
def test_2025_algorithm_runs(ray_session, tmp_path, name):
    from hybridflow.controller.trainer import Trainer

    run_dir = tmp_path / name
    overrides = ["trainer.progress=false", f"trainer.iterations={ISSUE_21_ITERATIONS[name]}",
                 f"models.actor.rollout.n={ISSUE_21_SAMPLES}",
                 "trainer.save_interval=0", "trainer.save_final=false", "trainer.val_interval=0"]
    graph = load_graph(ROOT / "graphs" / f"{name}.yaml", overrides)
    Trainer(graph, run_dir=str(run_dir)).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, ISSUE_21_ITERATIONS[name] + 1))
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
    if name == "dapo":  # dynamic sampling: the counts add up, every iteration
        prompts = graph.spec.data.prompts_per_iteration
        max_rounds = graph.node("dynamic_sampling").spec.options.max_rounds
        for row in rows:
            rounds = row["filter/rounds"]
            assert 1 <= rounds <= max_rounds and row["filter/generated_groups"] == prompts * rounds
            assert row["filter/kept_groups"] + row["filter/filled_groups"] == prompts
            assert row["filter/filled_groups"] == 0 or rounds == max_rounds
            assert row["filter/filtered_groups"] >= row["filter/filled_groups"]
        assert max(r["filter/rounds"] for r in rows) > 1  # it did refill
    if name == "gspo":
        assert any(r["actor/seq_clip_frac"] > 0 for r in rows)  # the sequence clip acted
    if name == "cispo":
        assert all(0.0 <= r["actor/clip_frac"] <= 1.0 for r in rows)
