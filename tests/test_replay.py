"""Record and replay (``trainer.record``, ``hybridflow replay``): nodes of real GRPO (dp = 2) and
PPO runs are recorded on real Ray, and replayed without Ray, on local gloo processes of the
recorded world size, to exactly their recorded outputs; ``--pdb`` under a scripted debugger."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from hybridflow.cli.main import main
from hybridflow.graph.dag import load_graph
from hybridflow.spec.loading import SpecError
from hybridflow.workers.recording import INFO, OUTPUT, STATE, compare, rank_dir, record_dir

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "graphs" / "grpo.yaml"
PPO = ROOT / "graphs" / "ppo.yaml"
SHORT = [
    "trainer.val_interval=0", "trainer.progress=false", "trainer.save_final=false",
    "trainer.save_interval=0", "trainer.sample_interval=0", "trainer.iterations=2",
]
RECORD = "trainer.record={nodes: [advantage, update_actor], iterations: [2]}"


# -- the spec and the comparison (no run) ------------------------------------------------------


@pytest.mark.parametrize("override, field", [
    ("trainer.record={nodes: [advantages], iterations: [1]}", "trainer.record.nodes[0]"),
    ("trainer.record={nodes: [advantage], iterations: [1, 0]}", "trainer.record.iterations[1]"),
    ("trainer.record={nodes: [advantage], iterations: [3]}", "trainer.record.iterations[0]"),
    ("trainer.record={nodes: [], iterations: [1]}", "trainer.record.nodes"),
])
def test_record_spec_errors_name_the_field(override, field):
    with pytest.raises(SpecError) as err:
        load_graph(GRPO, ["trainer.iterations=2", override])
    assert f": {field}:" in str(err.value) and "\n" not in str(err.value)


def test_record_spec_loads():
    record = load_graph(GRPO, SHORT + [RECORD]).spec.trainer.record
    assert (record.nodes, record.iterations) == (["advantage", "update_actor"], [2])
    assert load_graph(GRPO, SHORT).spec.trainer.record is None


def _outputs(advantages: torch.Tensor, loss: float, weight: str = "aa") -> dict:
    out = TensorDict({"advantages": advantages}, batch_size=[advantages.shape[0]])
    meta = {"metrics": {"actor/loss": loss, "timing/weight_sync": loss * 7, "memory/rss_bytes": 1.0}}
    return {"out": out, "meta": meta, "weights": {"lm_head.weight": weight}}


def test_compare_finds_the_first_difference():
    base = torch.tensor([[0.5, float("nan")], [1.0, 2.0]])
    assert compare(_outputs(base, 0.25), _outputs(base.clone(), 0.25)) is None  # NaN equals NaN
    changed = base.clone()
    changed[1, 0] = 1.0000001
    assert compare(_outputs(base, 0.25), _outputs(changed, 0.25)) == "output advantages[1, 0]: recorded 1.0, replayed 1.0000001192092896"
    assert compare(_outputs(base, 0.25), _outputs(base, 0.5)) == "meta metrics/actor/loss: recorded 0.25, replayed 0.5"
    assert compare(_outputs(base, 0.25), _outputs(base, 0.25, "ab")) == "weights after the body: lm_head.weight differs"
    assert "recorded torch.float32 (2, 2), replayed torch.float64" in compare(_outputs(base, 0.25), _outputs(base.double(), 0.25))
    timing_only = _outputs(base, 0.25)
    timing_only["meta"]["metrics"]["timing/weight_sync"] = 99.0
    assert compare(_outputs(base, 0.25), timing_only) is None  # the machine's clocks are not compared


def _fake_record(run_dir: Path, iteration: int, node: str, world_size: int, outputs: int) -> None:
    path = record_dir(run_dir, iteration, node)
    path.mkdir(parents=True)
    (path / INFO).write_text(json.dumps({"world_size": world_size}))
    for rank in range(outputs):
        rank_dir(path, rank).mkdir()
        (rank_dir(path, rank) / OUTPUT).write_bytes(b"")


@pytest.mark.parametrize("args, field, says", [
    (["--iteration", "3", "--node", "advantage"], "--iteration",
     "iteration 3 was not recorded; recorded: iteration 2: advantage, update_actor; iteration 5: reward"),
    (["--iteration", "5", "--node", "advantage"], "--node",
     "node 'advantage' was not recorded at iteration 5; recorded: iteration 2: advantage, update_actor"),
    (["--iteration", "2", "--node", "advantage", "--rank", "2"], "--rank", "the call ran on 2 rank(s), 0 to 1"),
    (["--iteration", "2", "--node", "update_actor"], OUTPUT, "not written: the run stopped during this call"),
])
def test_replay_of_what_was_not_recorded_is_one_line(tmp_path, capsys, args, field, says):
    _fake_record(tmp_path, 2, "advantage", 2, 2)
    _fake_record(tmp_path, 2, "update_actor", 2, 1)  # rank 1 never finished
    _fake_record(tmp_path, 5, "reward", 1, 1)
    assert main(["replay", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f": {field}: " in err and says in err, err


def test_replay_of_a_run_without_record_is_one_line(tmp_path, capsys):
    assert main(["replay", str(tmp_path), "--iteration", "1", "--node", "advantage"]) == 2
    assert "trainer.record: the run recorded no node" in capsys.readouterr().err


# -- recorded runs, replayed --------------------------------------------------------------------


def _recorded_run(path: Path, graph_file: Path, overrides: list[str]) -> Path:
    from hybridflow.controller.trainer import Trainer

    Trainer(load_graph(graph_file, [*SHORT, RECORD, *overrides]), run_dir=str(path)).fit()
    assert sorted(p.name for p in (path / "record").iterdir()) == ["iter_2"]  # only what was asked
    assert sorted(p.name for p in (path / "record" / "iter_2").iterdir()) == ["advantage", "update_actor"]
    return path


@pytest.fixture(scope="module")
def grpo_run(ray_session, tmp_path_factory) -> Path:
    """GRPO on the default pool's two ranks (dp = 2)."""
    return _recorded_run(tmp_path_factory.mktemp("grpo"), GRPO, ["data.prompts_per_iteration=4"])


@pytest.fixture(scope="module")
def ppo_run(ray_session, tmp_path_factory) -> Path:
    """PPO on one rank: replayed in this process alone."""
    return _recorded_run(tmp_path_factory.mktemp("ppo"), PPO, [
        "data.prompts_per_iteration=8", f"resources={ROOT / 'resource_pools' / 'one_cpu.yaml'}",
    ])


@pytest.mark.slow
def test_grpo_update_actor_at_dp2_replays_exactly(grpo_run, capsys):
    info = json.loads((record_dir(grpo_run, 2, "update_actor") / INFO).read_text())
    assert info["world_size"] == 2 and info["options"]["clip_ratio"] == 0.2
    code = main(["replay", str(grpo_run), "--iteration", "2", "--node", "update_actor"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[-3:] == ["rank 0: equal", "rank 1: equal", "equal"], out


def _replay_cli(run_dir: Path, *args: str, commands: str = "") -> subprocess.CompletedProcess:
    """``hybridflow replay`` of iteration 2's advantage in a process of its own; everything it
    printed is in the failure if it does not end."""
    command = [sys.executable, "-m", "hybridflow.cli.main", "replay", str(run_dir), "--iteration", "2",
               "--node", "advantage", *args]
    try:
        return subprocess.run(command, input=commands, capture_output=True, text=True, timeout=240, cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"no end in 240 s; stdout:\n{err.stdout}\nstderr:\n{err.stderr}")


@pytest.mark.slow
def test_pdb_stops_in_the_ranks_body(grpo_run):
    """rank 1 of GRPO's advantage (rank 0 in a process of its own), under a scripted pdb."""
    done = _replay_cli(grpo_run, "--rank", "1", "--pdb",
                       commands="p node.name\np ctx.rank, ctx.world_size\np batch.batch_size\nn\nc\n")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "rank 1: stopped in hybridflow.workers.ops.advantage:advantage for node 'advantage'" in out
    assert "(Pdb) 'advantage'" in out
    assert "(Pdb) (1, 2)" in out
    assert "(Pdb) torch.Size([32])" in out  # 4 prompts x 16 samples over 2 ranks
    assert "-> reduce_sum = algo_steps.dp_sum" in out  # the body's first line, where pdb stopped
    assert "-> result, metrics, ratios = algo_steps.compute_advantages" in out  # `n`: the next one
    assert out.endswith("(Pdb) rank 0: equal\nrank 1: equal\nequal\n"), out  # `c`: to the end


@pytest.mark.slow
@pytest.mark.parametrize("node", ["advantage", "update_actor"])
def test_ppo_nodes_replay_exactly(ppo_run, capsys, node):
    code = main(["replay", str(ppo_run), "--iteration", "2", "--node", node])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[-2:] == ["rank 0: equal", "equal"], out


@pytest.mark.slow
def test_a_replay_that_differs_says_where(ppo_run, capsys):
    """The record's advantages altered at one element: the replay names it and exits 1."""
    output = rank_dir(record_dir(ppo_run, 2, "advantage"), 0) / OUTPUT
    recorded = torch.load(output, weights_only=False)
    original = output.read_bytes()
    recorded["out"]["advantages"][3, 1] += 0.5
    torch.save(recorded, output)
    try:
        assert main(["replay", str(ppo_run), "--iteration", "2", "--node", "advantage"]) == 1
    finally:
        output.write_bytes(original)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("rank 0: output advantages[3, 1]: recorded ") and lines[-1] == "differs on rank(s) [0]"


@pytest.mark.slow
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "pdb"])
def test_a_rank_that_fails_stops_the_replay_with_its_traceback(grpo_run, capsys, debug):
    """Rank 0's saved state unreadable: the replay ends at once with rank 0's error, whether the
    other rank is a spawned process or the one held in this process's debugger (which then waits
    at a rendezvous rank 0 never reaches)."""
    state = rank_dir(record_dir(grpo_run, 2, "advantage"), 0) / STATE
    original = state.read_bytes()
    state.write_bytes(b"not a torch file")
    try:
        if debug:
            done = _replay_cli(grpo_run, "--rank", "1", "--pdb", commands="c\n")
            code, err = done.returncode, done.stderr
        else:
            code = main(["replay", str(grpo_run), "--iteration", "2", "--node", "advantage"])
            err = capsys.readouterr().err
    finally:
        state.write_bytes(original)
    assert code == 1, err
    assert "rank 0's replay raised:" in err and "UnpicklingError" in err, err
