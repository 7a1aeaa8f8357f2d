"""Exactly once across controller kills, read from ``RUN_DIR/prompts.jsonl``.

A controller of ``trainer.async.mode`` one_step_off or streaming (K = 2) is killed with SIGKILL
three times in one run (``tests/controller_kill.py``: during a generation, during an update,
during a checkpoint save) and resumed after each: every iteration is logged once, every prompt
drawn for the run's iterations is trained exactly once, in the iteration the uninterrupted run
trained it, and every metric but the machine's (times, memory) equals the uninterrupted run's.
With partial rollouts (vLLM on its own pool) one kill during a generation, the same counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.controller.checkpoint import complete_checkpoints
from hybridflow.controller.loggers import PromptLog
from hybridflow.graph.dag import load_graph

ROOT = Path(__file__).resolve().parent.parent
ASYNC = ROOT / "graphs" / "grpo_async.yaml"
SPLIT = ROOT / "graphs" / "grpo_split_rollout.yaml"
KILLER = Path(__file__).resolve().parent / "controller_kill.py"
PROMPTS = 4
ITERATIONS = 5
SMALL = [
    f"trainer.iterations={ITERATIONS}", "trainer.save_interval=1", "trainer.val_interval=0",
    "trainer.sample_interval=0", "trainer.progress=false", "trainer.save_final=false",
    f"data.prompts_per_iteration={PROMPTS}", "models.actor.rollout.n=4",
    f"resources={ROOT / 'resource_pools' / 'one_cpu.yaml'}",  # one worker process to start
]
MODES = {
    "one_step_off": ["trainer.async.mode=one_step_off"],
    "streaming": ["trainer.async.mode=streaming", "trainer.async.max_staleness=2"],
}


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def non_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "throughput/", "memory/", "colocation/"))}


def killed_run(run_dir: Path, overrides: list[str], address: str, kill: str, resume: bool, graph: Path = ASYNC) -> str:
    """Run the controller until it kills itself at ``kill``; returns its stderr."""
    cmd = [sys.executable, str(KILLER), str(graph), str(run_dir), *overrides, "--address", address,
           "--kill", kill, *(["--resume"] if resume else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    return proc.stderr


def each_iteration_and_prompt_once(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The run's prompts.jsonl and metrics.jsonl rows, having checked that each holds every
    iteration once and that every prompt drawn was trained exactly once."""
    trained, metrics = rows(run_dir / "prompts.jsonl"), rows(run_dir / "metrics.jsonl")
    assert [r["iteration"] for r in trained] == list(range(1, ITERATIONS + 1))
    uids = [uid for r in trained for uid in r["uids"]]
    assert sorted(uids) == list(range(ITERATIONS * PROMPTS))  # none skipped, none twice
    assert [r["iteration"] for r in metrics] == list(range(1, ITERATIONS + 1))
    return trained, metrics


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_three_controller_kills_train_every_prompt_exactly_once(ray_session, tmp_path, mode):
    from hybridflow.controller.trainer import Trainer

    overrides = [*SMALL, *MODES[mode]]
    Trainer(load_graph(ASYNC, overrides), run_dir=str(tmp_path / "full")).fit()
    address = ray_session.get_runtime_context().gcs_address

    run_dir = tmp_path / "killed"
    said = killed_run(run_dir, overrides, address, "generate:2", resume=False)
    assert "SIGKILL during generate (submitted in iteration 2), finished: False" in said, said[-2000:]
    assert [p.name for p in complete_checkpoints(run_dir)] == ["iter_00000001"]
    said = killed_run(run_dir, overrides, address, "update:3", resume=True)
    assert "SIGKILL during update_actor of iteration 3, finished: False" in said, said[-2000:]
    said = killed_run(run_dir, overrides, address, "save:4", resume=True)
    assert "SIGKILL during the checkpoint save of iteration 4" in said, said[-2000:]
    assert complete_checkpoints(run_dir)[-1].name == "iter_00000003"
    assert list((run_dir / "checkpoints").glob(".tmp-iter_00000004-*")), "the save was meant to be cut short"
    summary = Trainer(load_graph(ASYNC, overrides), run_dir=str(run_dir), resume=True).fit()
    assert summary["iterations"] == ITERATIONS

    trained, metrics = each_iteration_and_prompt_once(run_dir)
    assert trained == rows(tmp_path / "full" / "prompts.jsonl")
    full = rows(tmp_path / "full" / "metrics.jsonl")
    # after each resume the buffered generations came from the checkpoint: sampled before it
    assert max(r["async/staleness_max"] for r in metrics) == (2.0 if mode == "streaming" else 1.0)
    for a, b in zip(full, metrics):
        assert non_timing(a) == non_timing(b), a["iteration"]


@pytest.mark.slow
def test_a_controller_killed_during_a_partial_rollout_trains_every_prompt_once(ray_session, tmp_path):
    """Partial rollouts (streaming K = 2, vLLM on a rollout pool of its own, weights loaded into
    a generation in flight): the controller is killed during iteration 2's generation and
    resumed. Every iteration is logged once and every prompt of the run trained exactly once;
    the metrics are not compared, since a partial rollout's samples depend on when weights land."""
    pytest.importorskip("vllm")
    from hybridflow.controller.trainer import Trainer

    overrides = [o for o in SMALL if not o.startswith("resources=")] + [
        "trainer.async.mode=streaming", "trainer.async.max_staleness=2", "trainer.async.partial_rollout=abort",
        "models.actor.rollout.engine=vllm",
    ]
    run_dir = tmp_path / "killed"
    said = killed_run(run_dir, overrides, ray_session.get_runtime_context().gcs_address, "generate:2",
                      resume=False, graph=SPLIT)
    assert "SIGKILL during generate (submitted in iteration 2), finished: False" in said, said[-2000:]
    assert [p.name for p in complete_checkpoints(run_dir)] == ["iter_00000001"]
    summary = Trainer(load_graph(SPLIT, overrides), run_dir=str(run_dir), resume=True).fit()
    assert summary["iterations"] == ITERATIONS

    _, metrics = each_iteration_and_prompt_once(run_dir)
    assert all("rollout/partial_resumed" in r for r in metrics)  # the mode was on throughout


def test_prompt_log_rewind_keeps_whole_rows_up_to_the_checkpoint(tmp_path):
    """A resume cuts prompts.jsonl back to the checkpoint's iteration; a row cut short by a
    killed controller is dropped, not an error."""
    log = PromptLog(tmp_path / "prompts.jsonl")
    for iteration in (1, 2, 3):
        log.write(iteration, {"update_actor": [{"trained_uids": [2 * iteration, 2 * iteration + 1]},
                                               {"trained_uids": [2 * iteration + 1]}], "reward": [{}]})
    log.path.write_bytes(log.path.read_bytes() + b'{"iteration": 4, "ui')
    log.rewind(2)
    assert rows(log.path) == [{"iteration": 1, "uids": [2, 3]}, {"iteration": 2, "uids": [4, 5]}]
    log.write(3, {})
    assert rows(log.path)[-1] == {"iteration": 3, "uids": []}
