"""CLI entry points that need no Ray: schema, docs, plot, graph (with the batch plan)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from hybridflow.cli.main import main
from hybridflow.graph.batching import batch_plan
from hybridflow.graph.dag import load_graph
from hybridflow.spec.loading import SpecError

ROOT = Path(__file__).resolve().parent.parent
GRAPH_FILES = sorted((ROOT / "graphs").glob("*.yaml"))
POOL_FILES = sorted((ROOT / "resource_pools").glob("*.yaml"))


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridflow.cli.main", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.fixture(scope="module")
def schemas(tmp_path_factory) -> dict[str, dict]:
    """The schemas as `hybridflow schema --out-dir DIR` writes them (the real entry point)."""
    out = tmp_path_factory.mktemp("schema")
    done = _cli("schema", "--out-dir", str(out))
    assert done.returncode == 0, done.stderr
    return {kind: json.loads((out / f"{kind}.schema.json").read_text()) for kind in ("graph", "pool")}


@pytest.mark.parametrize("path", GRAPH_FILES, ids=lambda p: p.name)
def test_schema_validates_shipped_graph_files(schemas, path):
    jsonschema.Draft202012Validator.check_schema(schemas["graph"])
    errors = list(jsonschema.Draft202012Validator(schemas["graph"]).iter_errors(yaml.safe_load(path.read_text())))
    assert not errors, [e.message for e in errors]


@pytest.mark.parametrize("path", POOL_FILES, ids=lambda p: p.name)
def test_schema_validates_shipped_pool_files(schemas, path):
    errors = list(jsonschema.Draft202012Validator(schemas["pool"]).iter_errors(yaml.safe_load(path.read_text())))
    assert not errors, [e.message for e in errors]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda g: g["trainer"].update(iterationz=3),  # unknown field
        lambda g: g["nodes"][0].update(op="fly"),  # unknown op
        lambda g: g["data"].update(prompts_per_iteration=0),  # below the bound
        lambda g: g["models"]["actor"].update(role="judge"),  # not a role
        lambda g: g.pop("nodes"),  # required field
    ],
    ids=["unknown-field", "unknown-op", "bound", "enum", "required"],
)
def test_schema_rejects_what_the_loader_rejects(schemas, mutate):
    graph = copy.deepcopy(yaml.safe_load((ROOT / "graphs" / "grpo.yaml").read_text()))
    mutate(graph)
    assert list(jsonschema.Draft202012Validator(schemas["graph"]).iter_errors(graph))


def test_schema_kind_prints_one_schema(capsys):
    assert main(["schema", "pool"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "hybridflow pool file" and "pools" in schema["properties"]


def test_docs_check_reports_stale(tmp_path, capsys):
    assert main(["docs", "--out-dir", str(tmp_path)]) == 0
    assert main(["docs", "--check", "--out-dir", str(tmp_path)]) == 0
    (tmp_path / "graph-file.md").write_text("old\n")
    assert main(["docs", "--check", "--out-dir", str(tmp_path)]) == 1
    assert "graph-file.md" in capsys.readouterr().err


def _fake_run(run_dir: Path, rewards: list[float]) -> Path:
    """A metrics.jsonl in the format the trainer writes (for plot input only)."""
    run_dir.mkdir(parents=True)
    rows = []
    for i, reward in enumerate(rewards, start=1):
        row = {"iteration": i, "reward/mean": reward, "actor/kl": 0.01 * i, "actor/entropy": 2.0 - 0.1 * i,
               "response_length/mean": 5.0, "timing/generate": 0.2, "timing/update_actor": 0.3,
               "timing/iteration": 0.6}
        if i % 2 == 0:
            row["val/reward/mean"] = reward
        rows.append(json.dumps(row))
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return run_dir


def test_plot_one_and_several_runs(tmp_path):
    a = _fake_run(tmp_path / "a", [0.1, 0.2, 0.4, 0.5])
    b = _fake_run(tmp_path / "b", [0.1, 0.15, 0.2, 0.3])
    done = _cli("plot", str(a))
    assert done.returncode == 0, done.stderr
    png = a / "plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = tmp_path / "cmp" / "compare.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_plot_draws_the_metrics(tmp_path):
    import matplotlib.pyplot as plt

    from hybridflow.cli import plot

    run = _fake_run(tmp_path / "r", [0.1, 0.3, 0.5])
    drawn = {}
    original = plt.Figure.savefig

    def capture(fig, *args, **kwargs):
        drawn.update({ax.get_title(): [list(line.get_ydata()) for line in ax.lines] for ax in fig.axes})
        return original(fig, *args, **kwargs)

    plt.Figure.savefig = capture
    try:
        plot.plot_runs([run], tmp_path / "p.png")
    finally:
        plt.Figure.savefig = original
    assert drawn["reward"] == [[0.1, 0.3, 0.5], [0.3]]  # train, then val (iteration 2 only)
    assert drawn["KL(actor || ref)"] == [[0.01, 0.02, 0.03]]
    assert len(drawn["time per node (s)"]) == 2  # generate and update_actor, not the iteration


def test_plot_not_a_run_dir_is_one_line(tmp_path):
    done = _cli("plot", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "metrics.jsonl" in done.stderr


def test_graph_prints_batch_plan():
    done = _cli("graph", "graphs/grpo.yaml", "data.prompts_per_iteration=8", "models.actor.rollout.n=4")
    assert done.returncode == 0, done.stderr
    assert "8 prompts/iteration" in done.stdout and "= 32 samples/iteration" in done.stdout
    assert "16 samples/rank" in done.stdout


def test_batch_plan_totals():
    graph = load_graph(ROOT / "graphs" / "grpo.yaml", [
        "data.prompts_per_iteration=8", "models.actor.rollout.n=4",
        "nodes.update_actor.options.mini_batches=2", "models.actor.train.micro_batch_size=3",
    ])
    plan = batch_plan(graph.spec, graph.layouts, graph.file)
    assert plan.samples_per_iteration == 32
    (update,) = plan.updates
    assert (update.dp, update.samples_per_rank, update.samples_per_step) == (2, 16, 16)
    assert (update.samples_per_rank_step, update.micro_batches_per_step, update.steps_per_iteration) == (8, 3, 2)


@pytest.mark.parametrize(
    "override, field",
    [
        ("data.prompts_per_iteration=3", "data.prompts_per_iteration"),
        ("nodes.update_actor.options.mini_batches=3", "nodes[4].options.mini_batches"),
    ],
)
def test_batch_sizes_that_do_not_divide_are_one_line(override, field):
    with pytest.raises(SpecError) as info:
        load_graph(ROOT / "graphs" / "grpo.yaml", [override])
    assert info.value.field == field
    assert "\n" not in str(info.value) and "grpo.yaml" in str(info.value)


def test_run_into_a_dir_that_holds_a_run_is_refused(tmp_path, capsys, monkeypatch):
    """A second run into the same --run-dir would mix its metrics into the first's: refused in
    one line before anything starts, the first run's files untouched."""
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"iteration": 1}\n')
    code = main(["run", "graphs/grpo.yaml", "--run-dir", str(run_dir)])
    assert code == 2
    assert capsys.readouterr().err == (
        f"error: {run_dir}: already holds a run (metrics.jsonl); --resume continues it, or choose "
        "another --run-dir\n"
    )
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
    assert (run_dir / "metrics.jsonl").read_text() == '{"iteration": 1}\n'


# -- the three first-run trips of issue 17 ---------------------------------------------------------


def test_validate_applies_overrides_to_every_file(capsys):
    """Arguments with '=' are overrides (as for `run`), applied to each graph file given."""
    assert main(["validate", "graphs/grpo.yaml", "models.actor.rollout.engine=vllm"]) == 0
    assert capsys.readouterr().out == "graphs/grpo.yaml: ok (5 nodes, 3 models)\n"
    files = ["graphs/grpo.yaml", "graphs/rloo.yaml"]
    assert main(["validate", *files, "trainer.iterations=3"]) == 0
    # An override every file rejects: the first file names it (applied, not taken for a file).
    assert main(["validate", *files, "data.prompts_per_iteration=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "graphs/grpo.yaml: data.prompts_per_iteration" in err
    assert main(["validate", "trainer.iterations=3"]) == 2
    assert "no graph file" in capsys.readouterr().err


def test_an_override_changes_one_alias_of_a_yaml_anchor_only():
    """grpo.yaml's actor and ref both name the &tiny source; overriding the ref's leaves the
    actor's as written (deepcopy kept the YAML's sharing, so both changed)."""
    from hybridflow.graph.plugins import load_graph_spec

    spec = load_graph_spec("graphs/grpo.yaml", ["models.ref.source.config.hidden_size=32"])
    assert spec.models["ref"].source.config["hidden_size"] == 32
    assert spec.models["actor"].source.config["hidden_size"] == 64


@pytest.mark.parametrize("key", ["nodes.update_actor", "nodes.4", "nodes[4]"])
def test_a_node_override_by_name_or_by_index_as_errors_print_it(key):
    """Errors name a node's field as ``nodes[4].options.kl_coef``: an override may use that
    path as printed, as well as ``nodes.4`` or the node's name."""
    from hybridflow.graph.plugins import load_graph_spec

    spec = load_graph_spec("graphs/grpo.yaml", [f"{key}.options.kl_coef=0.25"])
    assert spec.nodes[4].name == "update_actor" and spec.nodes[4].options.kl_coef == 0.25


def test_validate_command_with_override_exits_0():
    done = _cli("validate", "graphs/grpo.yaml", "models.actor.rollout.engine=vllm")
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout


@pytest.mark.parametrize("size", [None, "7b"])
def test_plan_scales_the_batch_to_the_chosen_layout(capsys, size):
    """`hybridflow plan graphs/ppo.yaml --pool resource_pools/a100_16x8.yaml`: 32 prompts do not
    split over the 128 GPUs' data-parallel ranks; the batch grows to the fewest that the chosen
    plan splits evenly, said in one line, and the plan is printed."""
    import re

    from hybridflow.graph.batching import _batch_problem, smallest_even_batch
    from hybridflow.graph.dag import build_graph
    from hybridflow.placement.automapper import plan_dp, plan_even_batch
    from hybridflow.graph.plugins import load_graph_spec

    pool_file = "resource_pools/a100_16x8.yaml"
    args = ["plan", "graphs/ppo.yaml", "--pool", pool_file, *(["--model-size", size] if size else [])]
    assert main(args) == 0
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("batch scaled:")]
    prompts = int(re.search(r"32 -> (\d+) prompts", line).group(1))
    assert f"data.prompts_per_iteration={prompts}" in line and "plan: " in out

    spec = load_graph_spec(ROOT / "graphs" / "ppo.yaml")
    graph = build_graph(spec, ROOT / "graphs" / "ppo.yaml", ROOT / pool_file, check_batch=False)
    _, plans, found = plan_even_batch(graph, graph.pools["default"], size)
    dp = plan_dp(plans[0])
    assert found == prompts == smallest_even_batch(spec, dp) and max(dp.values()) > 1
    assert _batch_problem(spec, prompts, dp) is None
    assert all(_batch_problem(spec, p, dp) is not None for p in range(32, prompts))


def test_auto_placement_in_a_run_refuses_a_batch_its_plan_cannot_split(capsys, tmp_path):
    """`placement: auto` never changes the batch: one line naming both fixes, before any start."""
    code = main(["run", "graphs/ppo.yaml", "placement=auto", "--pools", "resource_pools/a100_16x8.yaml",
                 "--run-dir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "graphs/ppo.yaml: placement: auto:" in err
    assert "does not split 32 prompts" in err
    assert "set data.prompts_per_iteration=" in err and "place the models yourself" in err
    assert not (tmp_path / "run").exists()


def test_summary_prints_as_a_table():
    from hybridflow.cli.main import format_summary

    summary = {"run_dir": "runs/x", "iterations": 2, "reward_first10": 0.08812, "reward_last10": 0.5,
               "val_reward_final": None, "restarts": 0, "seconds": 3.5}
    assert format_summary(summary).splitlines() == [
        "run summary",
        "  run_dir           runs/x",
        "  iterations        2",
        "  reward_first10    0.0881",
        "  reward_last10     0.5",
        "  val_reward_final  -",
        "  restarts          0",
        "  seconds           3.5",
    ]


def test_options_may_come_between_the_graph_and_its_overrides(capsys):
    """`run GRAPH --run-dir D OVERRIDE` as users write it: the override after the option is
    applied (argparse alone stops a positional list at the first option)."""
    pools = "resource_pools/local_cpu.yaml"
    assert main(["graph", "graphs/grpo.yaml", "--pools", pools, "data.prompts_per_iteration=3"]) == 2
    assert "data.prompts_per_iteration" in capsys.readouterr().err
    assert main(["graph", "--pools", pools, "graphs/grpo.yaml", "data.prompts_per_iteration=3"]) == 2
    assert "data.prompts_per_iteration" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an unknown option is still argparse's one line
        main(["graph", "graphs/grpo.yaml", "--bogus", "trainer.iterations=3"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_eval_with_samples_0_scores_the_greedy_responses_only(tmp_path, capsys, monkeypatch):
    """`--samples 0`: the greedy pass alone (the same greedy responses as with samples), no
    pass@k; with `--pairs-out`, which ranks samples, it is one line and exit 2."""
    monkeypatch.chdir(ROOT)
    results = {}
    for name, extra in (("greedy", ["--samples", "0"]), ("sampled", ["--k", "2"])):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "graphs/grpo.yaml", "--limit", "6", "--engine", "hf", *extra, "--json", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    greedy, sampled = results["greedy"], results["sampled"]
    assert [p["greedy"] for p in greedy["prompts"]] == [p["greedy"] for p in sampled["prompts"]]
    assert greedy["summary"]["greedy_accuracy"] == sampled["summary"]["greedy_accuracy"]
    assert greedy["summary"]["samples_per_prompt"] == 0 and "pass@1" not in greedy["summary"]
    assert {"pass@1", "pass@2"} <= set(sampled["summary"])
    assert "eval: 6 prompts, greedy only (hf)" in capsys.readouterr().err
    code = main(["eval", "graphs/grpo.yaml", "--samples", "0", "--pairs-out", str(tmp_path / "p.jsonl")])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "error: graphs/grpo.yaml: --samples: --pairs-out ranks sampled responses: give --samples >= 2")
