"""Loggers chosen by ``trainer.loggers``: console lines, TensorBoard scalars, wandb and MLflow runs
(read back with their own tools), sample generations."""

from __future__ import annotations

import json
import sys

import pytest

from hybridflow.controller.loggers import ConsoleLogger, RunLoggers, SampleWriter, samples_from_metas
from hybridflow.spec.graph import TrainerSpec
from hybridflow.spec.loading import SpecError, validate_model


def _record(i: int) -> dict:
    return {"iteration": i, "reward/mean": 0.25 * i, "actor/kl": 0.5, "timing/iteration": 1.0}


def test_console_prints_every_interval_and_the_last(capsys):
    logger = ConsoleLogger(interval=2, iterations=5)
    for i in range(1, 6):
        logger.log(_record(i))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"]
    assert "reward 0.500" in lines[0] and "kl 0.500" in lines[0] and "s/it 1.000" in lines[0]


def test_run_loggers_always_write_jsonl_and_samples_when_due(tmp_path):
    trainer = TrainerSpec(loggers=[], sample_interval=2, num_logged_samples=2, iterations=3)
    loggers = RunLoggers(trainer, tmp_path, "g.yaml")
    metas = {
        "reward": [
            {"samples": [{"prompt": "ab=", "response": "ab", "reward": 1.0}, {"prompt": "c=", "response": "x", "reward": 0.0}]},
            {"samples": [{"prompt": "d=", "response": "d", "reward": 1.0}]},
        ],
        "generate": [{"metrics": {}}],
    }
    for i in range(1, 4):
        loggers.log(_record(i), metas)
    loggers.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(s["iteration"], s["prompt"]) for s in samples] == [(2, "ab="), (2, "c="), (3, "ab="), (3, "c=")]
    assert samples[0] == {"iteration": 2, "node": "reward", "prompt": "ab=", "response": "ab", "reward": 1.0}


def test_samples_off_writes_nothing(tmp_path):
    writer = SampleWriter(tmp_path / "s.jsonl", interval=0, iterations=4, limit=4)
    assert writer.write(4, samples_from_metas({"reward": [{"samples": [{"prompt": "a"}]}]})) == 0
    assert not (tmp_path / "s.jsonl").exists()


def test_unknown_logger_is_a_one_line_spec_error():
    with pytest.raises(SpecError) as info:
        validate_model(TrainerSpec, {"loggers": ["neptune"]}, "g.yaml")
    assert info.value.field == "loggers[0]" and "\n" not in str(info.value)


def test_tensorboard_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    with pytest.raises(SpecError) as info:
        RunLoggers(TrainerSpec(loggers=["tensorboard"]), tmp_path, "g.yaml")
    assert info.value.field == "trainer.loggers" and "pip install tensorboard" in str(info.value)


def test_tensorboard_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loggers = RunLoggers(TrainerSpec(loggers=["tensorboard"]), tmp_path, "g.yaml")
    for i in range(1, 4):
        loggers.log(_record(i))
    loggers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert rewards == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert "iteration" not in events.Tags()["scalars"]


def test_rewind_cuts_samples_and_hides_tensorboard_steps_after_the_checkpoint(tmp_path):
    """A resume or a recovery goes back to iteration 2 after 4 were logged: iterations 3-4 are
    logged again, and each file then holds every iteration once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = TrainerSpec(loggers=["tensorboard"], sample_interval=1, num_logged_samples=1, iterations=5)
    metas = {"reward": [{"samples": [{"prompt": "ab=", "response": "ab", "reward": 1.0}]}]}
    loggers = RunLoggers(trainer, tmp_path, "g.yaml")
    for i in range(1, 5):
        loggers.log(_record(i), metas)
    loggers.rewind(2)
    for i in range(3, 6):
        loggers.log({**_record(i), "reward/mean": 1.0 + i}, metas)
    loggers.close()
    samples = [json.loads(line)["iteration"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [1, 2, 3, 4, 5]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert rewards == [(1, 0.25), (2, 0.5), (3, 4.0), (4, 5.0), (5, 6.0)]


def _tracked_records(n: int, start: int = 1) -> list[dict]:
    # Shaped like metrics.jsonl rows: namespaced keys, ints and floats, the step as "iteration".
    return [
        {"iteration": i, "reward/mean": 0.25 * i, "actor/kl": 0.5 / i, "timing/iteration": 1.0,
         "rollout/num_tokens": 64 * i, "val/reward/mean": 0.1 * i}
        for i in range(start, start + n)
    ]


def _mlflow_history(run_dir) -> tuple[str, dict[str, list[tuple[int, float]]]]:
    from mlflow.tracking import MlflowClient

    run_id = (run_dir / "mlflow" / "run_id").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    run = client.get_run(run_id)
    return run_id, {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in run.data.metrics
    }


def test_mlflow_holds_every_metric_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # no network
    (tmp_path / "graph.yaml").write_text("name: g\n")
    trainer = TrainerSpec(loggers=["mlflow"], iterations=5, tracking={"project": "proj", "tags": ["smoke"]})
    loggers = RunLoggers(trainer, tmp_path, "g.yaml", name="g")
    records = _tracked_records(3)
    for record in records:
        loggers.log(record)
    loggers.close()
    run_id, history = _mlflow_history(tmp_path)
    expected = {k: [(r["iteration"], float(r[k])) for r in records] for k in records[0] if k != "iteration"}
    assert history == expected

    loggers = RunLoggers(trainer, tmp_path, "g.yaml", name="g")  # a resume: the same run dir
    more = _tracked_records(2, start=4)
    for record in more:
        loggers.log(record)
    loggers.close()
    again, history = _mlflow_history(tmp_path)
    assert again == run_id
    assert history["reward/mean"] == [(i, 0.25 * i) for i in range(1, 6)]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.info.run_name == tmp_path.name and run.data.tags["smoke"] == "true"
    assert run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run_id)] == ["graph.yaml"]


def test_mlflow_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    monkeypatch.setitem(sys.modules, "mlflow.entities", None)
    with pytest.raises(SpecError) as info:
        RunLoggers(TrainerSpec(loggers=["mlflow"]), tmp_path, "g.yaml")
    assert info.value.field == "trainer.loggers" and "hybridflow[mlflow]" in str(info.value)


def test_wandb_offline_run_holds_every_metric_and_the_graph(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tests.wandb_records import history, run_records

    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "graph.yaml").write_text("name: g\ntrainer: {iterations: 3}\n")
    trainer = TrainerSpec(loggers=["wandb"], iterations=3, tracking={"tags": ["smoke"]})
    loggers = RunLoggers(trainer, tmp_path, "g.yaml", name="g")
    records = _tracked_records(3)
    for record in records:
        loggers.log(record)
    loggers.close()
    logged = history(tmp_path / "wandb")
    assert sorted(logged) == [1, 2, 3]
    for record in records:
        assert logged[record["iteration"]] == pytest.approx({k: v for k, v in record.items() if k != "iteration"})
    (run,) = run_records(tmp_path / "wandb")
    assert run.project == "g" and run.display_name == tmp_path.name and list(run.tags) == ["smoke"]
    config = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in run.config.update}
    assert config["name"] == "g" and config["trainer"] == {"iterations": 3}


def test_wandb_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SpecError) as info:
        RunLoggers(TrainerSpec(loggers=["wandb"]), tmp_path, "g.yaml")
    assert info.value.field == "trainer.loggers" and "hybridflow[wandb]" in str(info.value)


def test_mlflow_tracking_uri_wins_over_the_run_dir_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = tmp_path / "shared.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    loggers = RunLoggers(TrainerSpec(loggers=["mlflow"]), run_dir, "g.yaml", name="g")
    loggers.log(_tracked_records(1)[0])
    loggers.close()
    assert store.is_file() and not (run_dir / "mlflow" / "mlflow.db").exists()
    run_id = (run_dir / "mlflow" / "run_id").read_text().strip()
    history = MlflowClient(tracking_uri=f"sqlite:///{store}").get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25)]


def test_rank_metrics_combine_as_weighted_means_sums_and_ratios():
    from hybridflow.controller.metrics import reduce_metas

    metas = [
        {"num_samples": 3, "metrics": {"reward/mean": 1.0, "reward/sq_mean": 1.0},
         "sums": {"reward/num_errors": 1.0}, "ratios": {"advantage/abs_mean": [6.0, 4.0], "empty": [0.0, 0.0]}},
        {"num_samples": 1, "metrics": {"reward/mean": 0.0, "reward/sq_mean": 0.0},
         "sums": {"reward/num_errors": 2.0}, "ratios": {"advantage/abs_mean": [0.0, 2.0], "empty": [0.0, 0.0]}},
    ]
    out = reduce_metas(metas)
    assert out["reward/mean"] == pytest.approx(0.75)  # weighted by samples
    assert out["reward/std"] == pytest.approx((0.75 - 0.75**2) ** 0.5)
    assert out["reward/num_errors"] == 3.0
    assert out["advantage/abs_mean"] == pytest.approx(1.0)  # (6 + 0) / (4 + 2) tokens, not (1.5 + 0) / 2
    assert out["empty"] == 0.0
