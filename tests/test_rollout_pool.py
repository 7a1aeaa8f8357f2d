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


def test_graph_pictures_show_the_rollout_pool_and_how_far_ahead(tmp_path):
    from hybridflow.graph.render import _residents, describe, draw

    graph = load_graph(SPLIT, ["trainer.async.mode=streaming", "trainer.async.max_staleness=2"])
    text = describe(graph)
    assert "pool=train      tp=1 pp=1 dp=1 rollout pool=rollout" in text
    assert "(streaming: submitted for 2 iterations ahead before this one's updates)" in text
    assert _residents(graph, "rollout") == ["actor (rollout)"]
    assert _residents(graph, "train") == ["actor", "ref", "reward"]
    assert draw(graph, tmp_path / "dag.png").stat().st_size > 0
    partial = load_graph(SPLIT, ["trainer.async.partial_rollout=continue", "models.actor.rollout.engine=vllm"])
    assert "new weights load while it runs, partial rollouts continue)" in describe(partial)


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["models.actor.rollout.pool=gpu"], "models.actor.rollout.pool", "unknown pool 'gpu'"),
        (["models.actor.rollout.pool=train"], "models.actor.rollout.pool", "the one 'actor' trains on"),
        (["models.actor.train.engine=megatron"], "models.actor.rollout.pool", "torch train engine"),
        (["models.actor.rollout.sync_bucket_mb=0"], "models.actor.rollout.sync_bucket_mb", ""),
        (["trainer.async.partial_rollout=abort", "models.actor.rollout.engine=vllm", "trainer.async.mode=sync"],
         "trainer.async.partial_rollout", "off-policy mode"),
        (["trainer.async.partial_rollout=continue", "models.actor.rollout.engine=vllm", "models.actor.rollout.pool=null"],
         "trainer.async.partial_rollout", "pool of its own"),
        (["trainer.async.partial_rollout=abort"], "trainer.async.partial_rollout", "rollout.engine vllm"),
        (["trainer.async.partial_rollout=sometimes"], "trainer.async.partial_rollout", "'off', 'continue' or 'abort'"),
    ],
)
def test_bad_rollout_pools_are_one_line(overrides, field, words):
    with pytest.raises(SpecError) as info:
        load_graph(SPLIT, overrides)
    message = str(info.value)
    assert "\n" not in message and f".yaml: {field}:" in message and words in message


def test_partial_rollout_defaults_to_off_and_reads_a_bare_yaml_off():
    assert load_graph(SPLIT).spec.trainer.async_.partial_rollout == "off"
    # YAML 1.1 reads a bare `off` as false
    assert load_graph(SPLIT, ["trainer.async.partial_rollout=off"]).spec.trainer.async_.partial_rollout == "off"
    spec = load_graph(SPLIT, ["trainer.async.partial_rollout=abort", "models.actor.rollout.engine=vllm"]).spec
    assert spec.trainer.async_.partial_rollout == "abort"


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
def test_split_rollout_streaming_overlaps_syncs_and_resumes(ray_session, tmp_path):
    """Streaming with K = 2 on two pools, weights sent in buckets of 0.1 MiB (four of them):

    - two generations are queued ahead: iteration 3's (pool rollout) starts before update 2
      (pool train) ends;
    - staleness 0, 1, 2: the rollout pool took every update's version in turn (one missed
      would make samples three updates old and stop the run);
    - the checkpoint of iteration 2 holds the two generations queued ahead and the data
      position after their prompts;
    - resumed from it, iteration 3 trains the saved generation (sampled by earlier weights) and
      logs what it logged before the stop.
    """
    from hybridflow.controller.checkpoint import checkpoint_dir, load_controller_state
    from hybridflow.controller.trainer import Trainer

    overrides = [*SHORT, "trainer.iterations=4", "trainer.save_interval=2", "trainer.trace_interval=1",
                 "trainer.async.mode=streaming", "trainer.async.max_staleness=2",
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
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 2.0]
    for row in rows[1:]:
        assert row["actor/rollout_log_prob_diff_mean"] > 1e-4  # sampled by earlier weights
    state = load_controller_state(checkpoint_dir(run_dir, 2))["dataset"]
    assert (state["dataset"]["position"], state["dataset"]["next_uid"]) == (4 * 8, 4 * 8)
    assert len(state["buffered"]) == 2
    stopped = rows[2]

    Trainer(load_graph(SPLIT, overrides), run_dir=str(run_dir), resume=True).fit()
    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert _non_timing(rows[2]) == _non_timing(stopped)
    assert rows[0]["actor/rollout_log_prob_diff_max"] < 1e-5  # the first sync: the initial weights
    # a load's metrics land in the iteration that collects it (loads wait behind the queue)
    syncs = [r for r in rows if "weight_sync/buckets" in r]
    assert syncs
    for row in syncs:
        assert row["weight_sync/buckets"] == 4.0 and row["weight_sync/bytes"] == syncs[0]["weight_sync/bytes"] > 0


def test_ahead_generation_keeps_k_batches_queued_and_checkpoints_them(monkeypatch):
    """The bookkeeping of generation ahead (streaming, K = 2), launches recorded instead of
    submitted: K batches queued after each take, none past the run's end; the checkpointed
    state is the dataset's position after the queued batches and the batches themselves, which
    a restore queues again (an older checkpoint's position before them draws them again)."""
    from hybridflow.controller import ahead

    class Counter:  # a dataset: batch i is the number i
        def __init__(self):
            self.position = 0

        def next_batch(self):
            self.position += 1
            return self.position

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            self.position = state["position"]

    class Put:  # a batch in the object store
        def __init__(self, batch):
            self.batch = batch

        def fetch(self):
            return self.batch

    launched = []
    monkeypatch.setattr(ahead, "launch", lambda graph, nodes, groups, prompts: launched.append(prompts.batch) or {})
    monkeypatch.setattr(ahead, "generation_nodes", lambda graph: [])
    dataset = Counter()
    gen = ahead.AheadGeneration(None, dataset, put=Put, depth=2)
    taken = []
    for iteration in range(1, 6):
        prompts, nodes = gen.take({}, remaining=5 - iteration)
        taken.append(prompts.batch)
        assert gen.queued == min(2, 5 - iteration)
        if iteration == 2:  # batches 3 and 4 queued: saved with the checkpoint
            saved = gen.state_dict()
            assert saved == {"dataset": {"position": 4},
                             "buffered": [{"prompts": 3, "nodes": {}}, {"prompts": 4, "nodes": {}}]}
    assert taken == [1, 2, 3, 4, 5] and launched == [1, 2, 3, 4, 5]
    assert gen.state_dict() == {"dataset": {"position": 5}, "buffered": []}
    gen.load_state_dict(saved)
    assert gen.queued == 2 and [gen.take({}, remaining=3)[0].batch for _ in range(3)] == [3, 4, 5]
    assert launched == [1, 2, 3, 4, 5, 5, 6, 7]  # 3 and 4 came back, not generated again
    gen.load_state_dict({"position": 1})
    assert gen.queued == 0 and gen.take({}, remaining=3)[0].batch == 2


@pytest.mark.slow
def test_streaming_with_partial_rollouts_resumes_generations_on_new_weights(ray_session, tmp_path):
    """Streaming K = 2 with the vLLM rollout on its own pool and partial_rollout=abort, weights
    sent in 0.1 MiB buckets; decoding slowed to 0.2 s a step, and from the second generation on
    its second step waits for the update's weights to be staged (however slow the update ran),
    so each update's weights reach the rollout pool while the next generation is in flight:

    - they load on the rollout pool's side thread during the generation: from iteration 2 on
      the samples still running then are resumed (rollout/partial_resumed > 0) and their last
      tokens come from newer weights (async/staleness_last_mean < async/staleness_mean);
    - staleness stays within K = 2 (the update asserts it) and is 1, not 2, in iteration 3:
      the generation queued behind started on the weights loaded meanwhile;
    - iteration 1 samples from the weights the trainer sent at the start: vLLM's log-probs
      equal the trainer's: the four buckets loaded into vLLM as one set of weights (loaded one
      by one they would leave a packed q/k/v layer NaN and every update skipped).
    """
    pytest.importorskip("vllm")
    import ray

    from fault_hooks import FaultyTrainer

    overrides = [*SHORT, "trainer.iterations=3", "trainer.async.mode=streaming", "trainer.async.max_staleness=2",
                 "trainer.async.partial_rollout=abort", "models.actor.rollout.engine=vllm",
                 "models.actor.rollout.sync_bucket_mb=0.1"]

    class SlowDecoding(FaultyTrainer):
        def _start_groups(self):
            super()._start_groups()
            ray.get(self.groups["rollout"].call("inject_step_delay", model="actor", seconds=0.2,
                                                        hold_for_weights=True))

    SlowDecoding(load_graph(SPLIT, overrides), run_dir=str(tmp_path / "run")).fit()
    rows = _rows(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[0]["rollout/partial_resumed"] == 0.0 and rows[0]["async/staleness_max"] == 0.0
    assert rows[0]["actor/rollout_log_prob_diff_max"] < 1e-5
    for row in rows[1:]:
        assert row["rollout/partial_resumed"] > 0.0 and row["rollout/weight_loads_in_flight"] >= 1.0
        assert row["async/staleness_last_mean"] < row["async/staleness_mean"] <= 2.0
    assert rows[2]["async/staleness_max"] == 1.0
    assert all(r["weight_sync/buckets"] == 4.0 for r in rows if "weight_sync/buckets" in r)


@pytest.mark.slow
def test_a_rollout_worker_killed_on_the_split_recovers_and_trains_each_batch_once(ray_session, tmp_path):
    """SIGKILL of the rollout pool's worker during iteration 4 (one_step_off, checkpoint at 2):
    every group restarts, the rollout pool takes the restored weights, the buffered generation
    comes back from the checkpoint, and iteration i trains the dataset's i-th batch."""
    from checkpoint_harness import assert_each_batch_trained_once, kill_worker_after

    from hybridflow.controller.trainer import Trainer

    overrides = [*SHORT, "trainer.iterations=5", "trainer.save_interval=2", "trainer.max_restarts=1",
                 "trainer.sample_interval=1"]
    trainer = Trainer(load_graph(SPLIT, overrides), run_dir=str(tmp_path / "killed"))
    trainer.callbacks.append(kill_worker_after(3, pool="rollout", rank=0))
    assert trainer.fit()["restarts"] == 1
    run_dir = tmp_path / "killed"
    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert rows[2]["actor/rollout_log_prob_diff_mean"] > 1e-4  # the saved generation, one update old
    assert_each_batch_trained_once(trainer, run_dir, iterations=5, prompts_per_iteration=8)


def _non_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "throughput/", "memory/", "weight_sync/"))}


@pytest.mark.slow
def test_sync_split_rollout_resumes_and_recovers_bit_for_bit(ray_session, tmp_path):
    """Synchronous split, checkpoint at 2: stopped after 2 and resumed, and with the rollout
    pool's worker SIGKILLed during iteration 3 and recovered, the run logs what one done in one
    go logs. The rollout ranks' sampling RNG comes back with them (it was reseeded: iterations
    3-4 sampled other responses to the same prompts)."""
    from checkpoint_harness import kill_worker_after

    from hybridflow.controller.trainer import Trainer

    overrides = [*SHORT, "trainer.iterations=4", "trainer.save_interval=2", "trainer.max_restarts=1",
                 "trainer.async.mode=sync", "data.prompts_per_iteration=4", "models.actor.rollout.n=4"]
    graph = load_graph(SPLIT, overrides)
    Trainer(graph, run_dir=str(tmp_path / "full")).fit()
    Trainer(graph, run_dir=str(tmp_path / "split")).fit(stop_after=2)
    Trainer(graph, run_dir=str(tmp_path / "split"), resume=True).fit()
    killed = Trainer(graph, run_dir=str(tmp_path / "killed"))
    killed.callbacks.append(kill_worker_after(2, pool="rollout", rank=0))
    assert killed.fit()["restarts"] == 1
    full = [_non_timing(r) for r in _rows(tmp_path / "full")]
    assert [r["iteration"] for r in full] == [1, 2, 3, 4]
    assert len({r["reward/mean"] for r in full}) > 1
    for name in ("split", "killed"):
        assert [_non_timing(r) for r in _rows(tmp_path / name)] == full, name


def test_a_lora_actor_on_a_rollout_pool_needs_merged_weights():
    graph = load_graph(SPLIT, ["models.actor.train.lora.rank=4"])
    assert graph.rollout_pools == {"actor": "rollout"}
    with pytest.raises(SpecError) as info:
        load_graph(SPLIT, ["models.actor.train.lora.rank=4", "models.actor.rollout.engine=vllm"])
    assert info.value.field == "models.actor.rollout.lora_sync" and "merged" in str(info.value)
    load_graph(SPLIT, ["models.actor.train.lora.rank=4", "models.actor.rollout.engine=vllm",
                       "models.actor.rollout.lora_sync=merged"])


@pytest.mark.slow
def test_a_lora_actor_generates_on_its_rollout_pool_from_the_merged_weights(ray_session, tmp_path):
    """A LoRA actor's weights reach the standalone rollout pool with the adapters merged in,
    each update, one_step_off: the pool's engine samples what the trainer computes (the
    probe verified after each load, the rollout's recorded log-probs equal to the trainer's
    on iteration 1), and the adapters learn."""
    from hybridflow.controller.trainer import Trainer

    overrides = [*SHORT, "trainer.iterations=3", "models.actor.train.lora.rank=8", "trainer.async.mode=one_step_off",
                 "models.actor.train.optim.lr=0.01"]
    Trainer(load_graph(SPLIT, overrides), run_dir=str(tmp_path / "run")).fit()
    rows = _rows(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    synced = [r for r in rows if "weight_sync/verified" in r]
    assert synced and all(r["weight_sync/verified"] == 1.0 and r["weight_sync/probe_diff_max"] < 1e-4 for r in synced)
    assert rows[0]["actor/rollout_log_prob_diff_max"] < 1e-5
    assert rows[-1]["async/staleness_max"] == 1.0
    assert len({round(r["actor/pg_loss"], 8) for r in rows}) > 1
