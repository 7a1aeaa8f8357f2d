"""A standalone rollout (``rollout.pool``): the actor generates on a pool of its own and its
weights cross pools through the object store after every update (issue 20).

Fast tests: the spec's checks and where each node runs. Slow tests: short GRPO runs of
``graphs/grpo_split_rollout.yaml`` on real Ray, gloo and transformers models, one rank per pool.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.graph.dag import load_graph
from hybridflow.spec.loading import SpecError

ROOT = Path(__file__).resolve().parent.parent
SPLIT = ROOT / "graphs" / "grpo_split_rollout.yaml"
SHORT = [
    "trainer.val_interval=0", "trainer.progress=false", "trainer.save_final=false",
    "trainer.save_interval=0", "trainer.sample_interval=0",
    "data.prompts_per_iteration=8", "models.actor.rollout.n=8",
]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_generation_runs_on_the_rollout_pool_and_the_rest_on_the_training_pool():
    graph = load_graph(SPLIT)
    pools = {node.name: graph.pool_of(node) for node in graph.nodes}
    assert pools == {"generate": "rollout", "old_log_prob": "train", "ref_log_prob": "train",
                     "reward": "train", "advantage": "train", "update_actor": "train"}
    assert graph.used_pools() == ["train", "rollout"]
    assert graph.rollouts_on("rollout") == ["actor"] and graph.models_on("rollout") == []
    # without rollout.pool the hybrid engine: everything on the actor's pool
    hybrid = load_graph(SPLIT, ["models.actor.rollout.pool=null"])
    assert {hybrid.pool_of(node) for node in hybrid.nodes} == {"train"} and hybrid.rollout_pools == {}


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["models.actor.rollout.pool=gpu"], "models.actor.rollout.pool", "unknown pool 'gpu'"),
        (["models.actor.rollout.pool=train"], "models.actor.rollout.pool", "the one 'actor' trains on"),
        (["models.actor.train.engine=megatron"], "models.actor.rollout.pool", "torch train engine"),
        (["models.actor.train.lora={rank: 4}"], "models.actor.rollout.pool", "LoRA"),
        (["models.actor.rollout.sync_bucket_mb=0"], "models.actor.rollout.sync_bucket_mb", ""),
    ],
)
def test_bad_rollout_pools_are_one_line(overrides, field, words):
    with pytest.raises(SpecError) as info:
        load_graph(SPLIT, overrides)
    message = str(info.value)
    assert "\n" not in message and f".yaml: {field}:" in message and words in message


def test_prompts_must_split_over_the_rollout_ranks(tmp_path):
    pools = tmp_path / "pools.yaml"
    pools.write_text(
        "pools:\n"
        "  train: {nodes: 1, devices_per_node: 1, device: cpu}\n"
        "  rollout: {nodes: 1, devices_per_node: 3, device: cpu}\n"
    )
    with pytest.raises(SpecError, match=r"data.prompts_per_iteration: 16 prompts .* 3 ranks of rollout pool"):
        load_graph(SPLIT, [f"resources={pools}"])


@pytest.mark.slow
def test_split_rollout_one_step_off_overlaps_syncs_and_resumes(ray_session, tmp_path):
    """One-step off-policy on two pools, weights sent in buckets of 0.1 MiB (four of them):

    - generation k+1 (pool rollout) starts before update k (pool train) ends;
    - samples are exactly one update old from iteration 2 on: the rollout pool took every
      update's version (a missed sync would make them two old and stop the run);
    - resumed from the checkpoint of iteration 2, iteration 3 regenerates from the restored
      weights: its sampler equals the trainer (log-prob diff ~1e-7; the initial weights would
      differ by ~1e-2), staleness 0.
    """
    from hybridflow.controller.trainer import Trainer

    overrides = [*SHORT, "trainer.iterations=4", "trainer.save_interval=2", "trainer.trace_interval=1",
                 "models.actor.rollout.sync_bucket_mb=0.1"]
    run_dir = tmp_path / "run"
    Trainer(load_graph(SPLIT, overrides), run_dir=str(run_dir)).fit(stop_after=3)
    spans = {}
    for path in (run_dir / "trace").glob("*.json"):
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
        spans[events[0]["args"]["iteration"]] = {
            e["name"]: (e["args"]["wall_start"], e["args"]["wall_start"] + e["dur"] / 1e6) for e in events
        }
    assert spans[3]["generate"][0] < spans[2]["update_actor"][1]
    rows = _rows(run_dir)
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    for row in rows[1:]:
        assert row["actor/rollout_log_prob_diff_mean"] > 1e-4  # sampled by the previous weights

    Trainer(load_graph(SPLIT, overrides), run_dir=str(run_dir), resume=True).fit()
    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    assert rows[2]["actor/rollout_log_prob_diff_max"] < 1e-5, rows[2]["actor/rollout_log_prob_diff_max"]
    assert rows[0]["actor/rollout_log_prob_diff_max"] < 1e-5  # the first sync: the initial weights
    for row in rows:
        assert row["weight_sync/buckets"] == 4.0 and row["weight_sync/bytes"] == rows[0]["weight_sync/bytes"] > 0
