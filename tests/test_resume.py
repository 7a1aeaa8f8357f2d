"""Exact resume and worker-crash recovery on real Ray: a run stopped after iteration 3 and
resumed, and a run whose worker is SIGKILLed mid-iteration, log iteration by iteration the same
non-timing metrics (bitwise) as the same run done in one go."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import psutil
import pytest
import ray

from hybridflow.controller.checkpoint import complete_checkpoints, latest_checkpoint
from hybridflow.graph.dag import load_graph

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "graphs" / "grpo.yaml"
SMALL = [
    "trainer.iterations=6", "trainer.val_interval=3", "trainer.progress=false",
    "trainer.save_interval=3", "trainer.save_final=false", "data.prompts_per_iteration=4",
    "data.num_val=4", "models.actor.rollout.n=4", "trainer.sample_interval=1", "trainer.trace_interval=1",
]

pytestmark = pytest.mark.slow


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sample_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def non_timing(row: dict) -> dict:
    """The row without what measures the machine rather than the run (times, resident memory,
    how often a colocated rollout engine was moved in or out: a resumed worker loads it anew)."""
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "throughput/", "memory/", "colocation/"))}


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory):
    """The reference: the SMALL run done in one go (shared by the tests of this module)."""
    from hybridflow.controller.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("full")
    Trainer(load_graph(GRPO, SMALL), run_dir=str(run_dir)).fit()
    return run_dir


def test_stop_at_3_cut_the_last_row_and_resume_equals_uninterrupted(uninterrupted, tmp_path):
    from hybridflow.controller.trainer import Trainer

    graph = load_graph(GRPO, SMALL)

    Trainer(graph, run_dir=str(tmp_path / "split")).fit(stop_after=3)
    assert [r["iteration"] for r in metric_rows(tmp_path / "split")] == [1, 2, 3]
    assert latest_checkpoint(tmp_path / "split").name == "iter_00000003"
    # A process killed while writing its last row leaves half a line: the resume drops that row
    # (the checkpoint's offset points past it) and appends whole rows after it.
    data = (tmp_path / "split" / "metrics.jsonl").read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    (tmp_path / "split" / "metrics.jsonl").write_bytes(data[: last + (len(data) - last) // 2])
    summary = Trainer(graph, run_dir=str(tmp_path / "split"), resume=True).fit()
    assert summary["iterations"] == 6

    text = (tmp_path / "split" / "metrics.jsonl").read_bytes()
    assert b"\0" not in text and text.endswith(b"\n")
    full, split = metric_rows(uninterrupted), metric_rows(tmp_path / "split")
    assert [r["iteration"] for r in split] == [1, 2, 4, 5, 6]
    assert "val/reward/mean" in full[2] and "val/reward/mean" in split[4]
    for a, b in zip([row for row in full if row["iteration"] != 3], split):
        assert non_timing(a) == non_timing(b), a["iteration"]
    # the run clock goes on from the rows kept, in the resumed process too
    wall = [r["timing/wall_s"] for r in split]
    assert wall == sorted(wall) and wall[2] > wall[1], wall
    # iterations 4-6 learned something: the metrics are not trivially constant
    assert len({r["reward/mean"] for r in split}) > 1
    assert [p.name for p in complete_checkpoints(tmp_path / "split")] == ["iter_00000003", "iter_00000006"]


def test_worker_sigkill_mid_run_recovers_with_equal_metrics(uninterrupted, tmp_path):
    """SIGKILL of a worker process during iteration 4 (checkpoint at 2): the run restarts the
    workers, goes back to iteration 2, and its metrics equal the uninterrupted run's; so do its
    samples, and its traces are one per iteration (the rows after the checkpoint are cut, not
    logged twice)."""
    from hybridflow.controller.trainer import Trainer

    graph = load_graph(GRPO, [*SMALL, "trainer.save_interval=2", "trainer.max_restarts=1"])
    trainer = Trainer(graph, run_dir=str(tmp_path / "killed"))
    killed = []

    def kill_during_next_iteration(trainer, iteration, metrics):
        if iteration != 3 or killed:
            return
        worker = trainer.groups["default"].workers[1]
        pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))
        # After the callback returns the controller starts iteration 4 at once.
        threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()
        killed.append(pid)

    trainer.callbacks.append(kill_during_next_iteration)
    summary = trainer.fit()

    assert killed and not psutil.pid_exists(killed[0])
    assert summary["restarts"] == 1
    events = [json.loads(line) for line in (tmp_path / "killed" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["worker_lost"]
    assert events[0]["resume_from"].endswith(("iter_00000002", "iter_00000004"))
    rows = metric_rows(tmp_path / "killed")
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(metric_rows(uninterrupted), rows):
        assert non_timing(a) == non_timing(b), a["iteration"]
    samples = sample_rows(tmp_path / "killed")
    assert sorted({r["iteration"] for r in samples}) == [1, 2, 3, 4, 5, 6]
    assert samples == sample_rows(uninterrupted)
    traces = sorted(p.name for p in (tmp_path / "killed" / "trace").iterdir())
    assert traces == [f"iteration_{i:05d}.json" for i in range(1, 7)]


def test_repeated_worker_loss_stops_after_max_restarts(ray_session, tmp_path):
    """With max_restarts=0 a dead worker stops the run with a message (no silent retry loop)."""
    from hybridflow.controller.recovery import RunStopped
    from hybridflow.controller.trainer import Trainer

    graph = load_graph(GRPO, [*SMALL, "trainer.iterations=3", "trainer.max_restarts=0", "data.num_val=0"])
    trainer = Trainer(graph, run_dir=str(tmp_path / "run"))

    def kill_now(trainer, iteration, metrics):
        if iteration == 1:
            ray.kill(trainer.groups["default"].workers[0])

    trainer.callbacks.append(kill_now)
    with pytest.raises(RunStopped, match=r"^a worker died \(.*\); trainer.max_restarts=0, so the run does not recover$"):
        trainer.fit()
