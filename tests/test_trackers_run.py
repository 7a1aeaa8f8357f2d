"""A real `hybridflow run` with the trackers on, its output piped (as under CI or nohup), then
resumed: MLflow and wandb hold what metrics.jsonl holds, the resume continues the MLflow run,
and the console carries no progress-bar redraws and no worker library warnings unless
``--verbose``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WARNING = "noisy-reward-says-hello"
SMALL = [
    # One rank, no validation: the smallest run that still runs every node on a worker.
    "data.prompts_per_iteration=4", "models.actor.rollout.n=4", "trainer.val_interval=0",
    "trainer.log_interval=1", "trainer.save_interval=2", "trainer.loggers=[console,mlflow,wandb]",
    "models.reward.source.rule=noisy_reward:reward",
]


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    # No network: MLflow's usage telemetry off (wandb is offline without an API key).
    env.update(RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", WANDB_SILENT="true", MLFLOW_DISABLE_TELEMETRY="true")
    # The reward module must be importable on the workers: on PYTHONPATH before Ray starts.
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    cmd = [
        sys.executable, "-m", "hybridflow.cli.main", "run", str(ROOT / "graphs" / "grpo.yaml"), *SMALL, *args,
        "--pools", str(ROOT / "resource_pools" / "one_cpu.yaml"),
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_trackers_and_quiet_console_across_a_resume(tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    from hybridflow.controller.loggers import mlflow_key
    from tests.wandb_records import history

    (tmp_path / "noisy_reward.py").write_text(
        "import warnings\n"
        "from hybridflow.data.tasks import copy_reward\n\n\n"
        "def reward(*args, **kwargs):\n"
        f"    warnings.warn({WARNING!r})\n"
        "    return copy_reward(*args, **kwargs)\n"
    )
    run_dir = tmp_path / "run"
    first = _run(tmp_path, "trainer.iterations=2", "--run-dir", str(run_dir))
    console = first.stdout + first.stderr
    assert "\r" not in console, "a progress bar redrew into a pipe"
    assert [line.split()[1] for line in first.stdout.splitlines() if line.startswith("iter ")] == ["1/2", "2/2"]
    assert WARNING not in console
    assert WARNING in (run_dir / "workers.log").read_text()

    second = _run(tmp_path, "trainer.iterations=3", "--run-dir", str(run_dir), "--resume", "--verbose")
    assert WARNING in second.stdout + second.stderr  # --verbose: the workers' output on the console

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [1, 2, 3]
    run_id = (run_dir / "mlflow" / "run_id").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    assert [r.info.run_id for r in client.search_runs([client.get_experiment_by_name("grpo").experiment_id])] == [run_id]
    keys = {key for row in rows for key in row if key != "iteration"}
    assert keys and keys == {k for k in keys if isinstance(rows[-1].get(k, 0.0), (int, float))}
    for key in keys:
        expected = [(row["iteration"], float(row[key])) for row in rows if key in row]
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, mlflow_key(key)))
        assert got == expected, key

    logged = history(run_dir / "wandb")
    assert sorted(logged) == [1, 2, 3]
    for row in rows:
        assert logged[row["iteration"]] == pytest.approx({k: v for k, v in row.items() if k != "iteration"})


def test_worker_output_redirect_catches_python_and_c_level_writes(tmp_path):
    from hybridflow.workers.output import LOG_ENV

    script = (
        "import os, sys, warnings\n"
        "from hybridflow.workers.output import redirect_to_log\n"
        "redirect_to_log()\n"
        "print('to stdout'); warnings.warn('a library warning'); os.write(2, b'from C\\n')\n"
    )
    log = tmp_path / "workers.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{LOG_ENV: str(log)})
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", (done.stdout, done.stderr)
    text = log.read_text()
    assert "to stdout" in text and "a library warning" in text and "from C" in text
    # A node without the run directory keeps its output where it was.
    env[LOG_ENV] = str(tmp_path / "no" / "such" / "dir" / "workers.log")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert "to stdout" in done.stdout and "from C" in done.stderr
