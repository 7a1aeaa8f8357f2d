"""A resume checks the graph against the checkpointed run's (``controller/run_dir.py``): what it
can honour is applied and logged, anything else is refused in one line before a file is written."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from hybridflow.cli.main import main
from hybridflow.controller.checkpoint import latest_checkpoint
from hybridflow.controller.run_dir import RunDir, resume_changes
from hybridflow.graph.dag import load_graph
from hybridflow.spec.loading import SpecError

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "graphs" / "grpo.yaml"


def resolved(path: Path = GRPO, overrides: tuple[str, ...] = (), pools: str | None = None) -> dict:
    return RunDir.resolved_config(load_graph(path, list(overrides), pools_file=pools))


def test_the_same_graph_changes_nothing():
    assert resume_changes(resolved(), resolved()) == ([], [])


def test_length_bookkeeping_lr_and_layouts_are_honoured():
    honoured, refused = resume_changes(
        resolved(),
        resolved(overrides=("trainer.iterations=6", "trainer.save_interval=3", "trainer.keep_last=1",
                            "models.actor.train.optim.lr=0.01", "models.actor.train.optim.warmup_steps=2",
                            "trainer.loggers=[console,tensorboard]")),
    )
    assert refused == []
    assert "models.actor.train.optim.lr: 0.001 -> 0.01" in honoured
    assert "trainer.iterations: 400 -> 6" in honoured
    assert len(honoured) == 6, honoured


def test_another_pool_file_is_honoured():
    honoured, refused = resume_changes(resolved(), resolved(pools=str(ROOT / "resource_pools" / "one_cpu.yaml")))
    assert refused == [] and any(c.startswith("resolved_layouts.actor.dp: 2 -> 1") for c in honoured), honoured


@pytest.mark.parametrize(
    "change, field",
    [
        (("models.actor.source.config.hidden_size=128",), "models.actor.source.config.hidden_size: 64 -> 128"),
        (("data.num_train=1000",), "data.num_train: "),
        (("trainer.seed=3",), "trainer.seed: 0 -> 3"),
        (("nodes.update_actor.options.kl_coef=0.5",), "nodes.update_actor.options.kl_coef: "),
    ],
)
def test_what_a_checkpoint_cannot_follow_is_refused(change, field):
    _, refused = resume_changes(resolved(), resolved(overrides=change))
    assert refused and refused[0].startswith(field), refused


def test_another_algorithm_is_refused():
    _, refused = resume_changes(resolved(), resolved(ROOT / "graphs" / "ppo.yaml"))
    assert refused[0] == "name: grpo -> ppo"
    assert any(r.startswith("models.critic: (none) -> {") for r in refused), refused


def _checkpointed_run(tmp_path: Path) -> RunDir:
    """A run directory as a finished 2-iteration run leaves it: graph.yaml and a checkpoint."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_resolved_config(load_graph(GRPO, ["trainer.iterations=2"]))
    ckpt = run.path / "checkpoints" / "iter_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text('{"iteration": 2}')
    return run


def test_check_resume_refuses_in_one_line_and_leaves_graph_yaml(tmp_path, caplog):
    run = _checkpointed_run(tmp_path)
    assert latest_checkpoint(run.path) is not None
    before = run.config.read_text()
    with pytest.raises(SpecError) as info:
        run.check_resume(load_graph(ROOT / "graphs" / "ppo.yaml", ["trainer.iterations=4"]))
    message = str(info.value)
    assert "\n" not in message and "--resume" in message and "name: grpo -> ppo" in message
    assert len(message) < 600, message
    assert run.config.read_text() == before
    with caplog.at_level(logging.WARNING):
        run.check_resume(load_graph(GRPO, ["trainer.iterations=4", "models.actor.train.optim.lr=0.01"]))
    assert [r.getMessage() for r in caplog.records if r.name.startswith("hybridflow")] == [
        "resuming with a changed graph: trainer.iterations: 2 -> 4",
        "resuming with a changed graph: models.actor.train.optim.lr: 0.001 -> 0.01",
    ]


def test_cli_resume_with_another_algorithm_exits_2_before_ray(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    run = _checkpointed_run(tmp_path)
    before = run.config.read_text()
    assert main(["run", "graphs/ppo.yaml", "--run-dir", str(run.path), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "graph.yaml" in err and "name: grpo -> ppo" in err, err
    assert run.config.read_text() == before


def test_traces_after_the_checkpoint_are_dropped(tmp_path):
    run = RunDir(tmp_path)
    for i in (1, 2, 3, 12):
        run.trace(i).parent.mkdir(exist_ok=True)
        run.trace(i).write_text("{}")
    run.drop_traces_after(2)
    assert sorted(p.name for p in (tmp_path / "trace").iterdir()) == ["iteration_00001.json", "iteration_00002.json"]


@pytest.mark.parametrize("before, after", [("torch", "fsdp2"), ("fsdp2", "torch")])
def test_a_train_engine_of_the_same_checkpoint_format_is_honoured(before, after):
    """DDP and FSDP2 write the same layout-free checkpoints: a resume may swap them, with the
    options only one of them has; an option both have still may not change, nor may megatron
    (another checkpoint format) take over."""
    honoured, refused = resume_changes(
        resolved(overrides=(f"models.actor.train.engine={before}",)),
        resolved(overrides=(f"models.actor.train.engine={after}",)),
    )
    assert refused == [], refused
    assert f"models.actor.train.engine: {before} -> {after}" in honoured
    assert any(c.startswith("models.actor.train.sync_bucket_mb: ") for c in honoured), honoured
    _, refused = resume_changes(
        resolved(overrides=(f"models.actor.train.engine={before}",)),
        resolved(overrides=(f"models.actor.train.engine={after}", "models.actor.train.remove_padding=false")),
    )
    assert refused == ["models.actor.train.remove_padding: True -> False"]
    _, refused = resume_changes(resolved(), resolved(overrides=("models.actor.train.engine=megatron",)))
    assert "models.actor.train.engine: torch -> megatron" in refused


def test_a_checkpoint_of_the_torch_engine_loads_under_fsdp2_and_back_not_under_megatron():
    from hybridflow.controller.checkpoint import _same_checkpoint_format

    assert _same_checkpoint_format("torch", "fsdp2") and _same_checkpoint_format("fsdp2", "torch")
    assert not _same_checkpoint_format("torch", "megatron") and not _same_checkpoint_format("megatron", "fsdp2")
    assert not _same_checkpoint_format("gone", "torch")
