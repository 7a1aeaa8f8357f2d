"""The docs cannot drift: generated references match the spec models, and every command and code
block in README.md and docs/*.md runs.

Fenced blocks by language:

- ``bash``: every command line runs in a scratch directory that links the repository's graphs,
  pools, examples and venv, in document order (a later command may read an earlier one's run
  directory). Runs are shrunk: ``iterations=N`` becomes ``iterations=2``, ``hybridflow run`` gets
  small batch overrides, ``hybridflow eval`` scores 4 prompts at k = 2 and
  ``python examples/*.py`` gets ``--iterations 2``. A few commands are
  exempt below, each with the reason and where it is exercised instead: a run another test
  already makes is not made twice, and ``test_exempt_commands_are_run_elsewhere`` checks that
  the test it names still makes it (and that a run exempt as, shrunk, the same as another
  documented run still resolves to the same graph).
- ``python``: run as a script in the same directory (``iterations=N`` shrunk the same way).
- ``yaml``: a graph or pool file (``...`` items dropped) must validate against the JSON schema.
- ``text`` (or no language): output shown to the reader; not run.

After each file: every ``--run-dir D`` holds a metrics.jsonl with finite values, every plot
command wrote a PNG, every example printed a summary.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from hybridflow.spec.docgen import json_schemas, stale_files

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)
RUN_LANGS = {"bash", "sh", "shell", "python", "yaml"}
SHOWN_LANGS = {"", "text", "console-output"}

# command (regex) -> why it is not run here; each is exercised elsewhere or cannot be here.
EXEMPT = {
    r"^make install\b": "CI's .ci/run runs it to build the environment the tests run in",
    r"^make test(-fast)?\b": "CI's .ci/run runs `make test`, which runs this file",
    r"--address auto\b": "needs a running Ray cluster; `ray.init(address=...)` is Ray's own code path",
    r"^tensorboard\b": "starts a web server; the event files it reads are checked in tests/test_loggers.py",
    r"grpo_judge\.yaml": "tests/test_judge.py runs grpo_judge.yaml for 3 iterations, shrunk, on Ray",
    r"reward_model_smollm2\.yaml|grpo_smollm2_rm\.yaml|--pairs-out runs/pairs/smollm2": (
        "tests/test_learned_reward_smollm2.py runs both graphs and the eval, shrunk, on pairs of the "
        "shape --pairs-out writes; tests/test_reward_model_graph.py runs --pairs-out"
    ),
    r"--run-dir runs/(rm|grpo-rm|cm|safe-learned)$|--actor runs/(rm|cm)$": (
        "tests/test_reward_model_graph.py runs the learned-rewards page's tiny commands in order, with "
        "their run directories, shrunk, on one Ray instead of one per command"
    ),
    r"grpo_smollm2\.yaml|runs/smollm2\b": "tests/test_smollm2.py runs the SmolLM2 run, both evals and the plot, shrunk",
    r"grpo_smollm2_lora\.yaml|runs/lora\b": "tests/test_lora.py runs the LoRA graph and an eval of its adapters, shrunk",
    r"distill_smollm2\.yaml|runs/smollm2_distill\b": (
        "its teacher is a run of grpo_smollm2.yaml; tests/test_distill.py runs the graph shrunk, from a teacher run"
    ),
    # Runs another test already makes (`test_exempt_commands_are_run_elsewhere` checks it still does).
    r"^hybridflow run graphs/(ppo|rloo|safe_rlhf)\.yaml --run-dir runs/\w+$": (
        "tests/test_algorithms_learn.py runs each graph's full default run"
    ),
    r"--run-dir runs/ckpt\b": (
        "tests/test_resume_layouts.py runs save, resume and the dp 2 -> 1 resume through the CLI"
    ),
    r"--run-dir runs/n4 --resume$": (
        "tests/test_resume_layouts.py runs save, resume and the dp 2 -> 1 resume through the CLI"
    ),
    r"^hybridflow run graphs/grpo\.yaml models\.actor\.rollout\.engine=vllm$": (
        "tests/test_vllm.py runs grpo.yaml with exactly this override"
    ),
    r"^hybridflow run graphs/grpo_megatron\.yaml$": "tests/test_megatron_grpo.py runs grpo_megatron.yaml",
    r"^hybridflow run graphs/grpo_megatron_tg2\.yaml$": (
        "tests/test_megatron_grpo.py runs grpo_megatron_tg2.yaml (shrunk) and checks its reshard/* bytes"
    ),
    r"^hybridflow run graphs/grpo_tool\.yaml --run-dir runs/tool$": (
        "tests/test_envs.py runs grpo_tool.yaml shrunk and checks its tool metrics"
    ),
    r"^hybridflow run graphs/grpo\.yaml --pools resource_pools/local_cpu\.yaml$": (
        "grpo.yaml's own pool file: the same run as the first command's"
    ),
    r"^python examples/remax\.py --iterations 0 --run-dir runs/\w+$": (
        "the graph of graphs/remax.yaml (tests/test_graph.py checks the builder equals the file); "
        "tests/test_algorithms_learn.py runs its full default run"
    ),
    r"^PYTHONPATH=\S+ hybridflow run graphs/ppo\.yaml models\.reward\.source\.rule=custom_reward:": (
        "examples/custom_reward.py makes this run: PPO with this rule, the module put on the "
        "workers' PYTHONPATH before Ray starts"
    ),
}
# A documented run that is, once shrunk, the same run as another documented one (run directory
# aside): made once, as the other; its run directory, if it names one, is the other's.
N4_RUN = "hybridflow run graphs/grpo.yaml trainer.iterations=20 models.actor.rollout.n=4 --run-dir runs/n4"
SAME_RUN = {
    r"^\.venv/bin/hybridflow run graphs/grpo\.yaml$": N4_RUN,
    r"^hybridflow run graphs/grpo\.yaml trainer\.iterations=\d+ models\.actor\.rollout\.n=4 --run-dir runs/grpo-n4$": N4_RUN,
}
# Where an exempt run is exercised instead, and what that file must hold for it to be so.
COVERED_BY = {
    "tests/test_algorithms_learn.py": ['["grpo", "ppo", "remax", "rloo", "safe_rlhf"]', "run_default("],
    "tests/test_resume_layouts.py": ['"resource_pools/one_cpu.yaml"', '"--resume"', 'main(["run", "graphs/grpo.yaml"'],
    "tests/test_vllm.py": ['"models.actor.rollout.engine=vllm"', "GRPO = "],
    "tests/test_megatron_grpo.py": ['"grpo_megatron.yaml"', '"grpo_megatron_tg2.yaml"', ".fit()"],
    "tests/test_loggers.py": ["def test_tensorboard_writes_scalars"],
    "tests/test_smollm2.py": ['main(["eval", GRAPH', 'main(["plot"'],
    "tests/test_learned_reward_smollm2.py": ['"graphs/reward_model_smollm2.yaml"', '"graphs/grpo_smollm2_rm.yaml"',
                                             'main(["eval", "graphs/grpo_smollm2_rm.yaml"'],
    "tests/test_reward_model_graph.py": ['"--pairs-out"', "def test_eval_pairs_out_writes_ranked_pairs_a_pair_graph_reads",
                                         "def test_the_tiny_learned_reward_commands_in_order",
                                         '"graphs/reward_model.yaml", "--run-dir", "runs/rm"',
                                         '"graphs/reward_model.yaml", "--actor", "runs/rm"',
                                         '"graphs/grpo_learned_reward.yaml", "--run-dir", "runs/grpo-rm"',
                                         '"graphs/cost_model.yaml", "--run-dir", "runs/cm"',
                                         '"graphs/cost_model.yaml", "--actor", "runs/cm"',
                                         '"graphs/safe_rlhf_learned.yaml", "--run-dir", "runs/safe-learned"'],
    "tests/test_lora.py": ['main(["run", "graphs/grpo_smollm2_lora.yaml"', 'main(["eval", "graphs/grpo_smollm2_lora.yaml"'],
    "tests/test_graph.py": ["def test_python_builder_equals_yaml"],
    "tests/test_distill.py": ['"graphs/distill_smollm2.yaml"', "def test_distill_smollm2_runs_two_iterations"],
    "tests/test_judge.py": ['"grpo_judge.yaml"', '"trainer.iterations=3"', "def test_grpo_judge_runs_3_iterations"],
    "tests/test_envs.py": ['"grpo_tool.yaml"', "def test_grpo_tool_graph_runs_and_logs_tool_metrics"],
    "examples/custom_reward.py": ['REWARD = "custom_reward:exact_or_partial"', '"ppo"', 'os.environ["PYTHONPATH"]'],
}
SMALL_RUN = [
    "trainer.iterations=2", "trainer.val_interval=2", "data.prompts_per_iteration=4",
    "models.actor.rollout.n=4", "data.num_val=4",
]


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    return [(lang.lower(), body) for lang, body in FENCE.findall(path.read_text())]


def commands(body: str) -> list[str]:
    """Command lines of a shell block: continuations joined, comments and blank lines dropped."""
    out, pending = [], ""
    for line in body.splitlines():
        line = pending + line
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        if shlex.split(line, comments=True):
            out.append(re.sub(r"\s+#\s.*$", "", line).strip())  # as typed: globs stay globs
    return out


def _has_redirect(line: str) -> bool:
    return bool(re.search(r"\s[>|]\s", line.split(" #")[0]))


def same_run(command: str) -> str | None:
    return next((other for pattern, other in SAME_RUN.items() if re.search(pattern, command)), None)


def exempt_reason(command: str) -> str | None:
    other = same_run(command)
    if other:
        return f"shrunk, the same run as `{other}`"
    return next((why for pattern, why in EXEMPT.items() if re.search(pattern, command)), None)


def _run_dir(command: str) -> str | None:
    tokens = shlex.split(command)
    return tokens[tokens.index("--run-dir") + 1] if "--run-dir" in tokens else None


def _shrunk_run(command: str) -> tuple:
    """What a `hybridflow run` command runs once shrunk: its resolved graph spec and its options
    other than the run directory."""
    from hybridflow.graph.plugins import load_graph_spec

    tokens = shlex.split(shrink(command))
    at = next(i for i, t in enumerate(tokens) if t.endswith("hybridflow")) + 1
    assert tokens[at] == "run", command
    rest = tokens[at + 2 :]
    if "--run-dir" in rest:
        del rest[rest.index("--run-dir") : rest.index("--run-dir") + 2]
    overrides = [t for t in rest if "=" in t and not t.startswith("--")]
    options = [t for t in rest if t not in overrides]
    return load_graph_spec(ROOT / tokens[at + 1], overrides), options


def small_run(command: str) -> list[str]:
    """``SMALL_RUN`` for the graph the command runs; a graph without an actor (it trains a
    reward or cost model on pairs) has no rollout to shrink."""
    graph = re.search(r"hybridflow run\s+(\S+\.yaml)", command)
    path = ROOT / graph.group(1) if graph else None
    if path is not None and path.is_file():
        models = (yaml.safe_load(path.read_text()) or {}).get("models", {})
        if not any(isinstance(m, dict) and m.get("role") == "actor" for m in models.values()):
            return [o for o in SMALL_RUN if not o.startswith("models.actor.")]
    return SMALL_RUN


def shrink(command: str) -> str:
    """The command made small, edited as text so quoting, globs and $VARS stay as typed."""
    command = re.sub(r"iterations=\d+", "iterations=2", command)
    command = re.sub(r"--iterations \d+", "--iterations 2", command)
    if re.match(r"^(\w+=\S+\s+)*\S*hybridflow run\s", command):
        # After the file's own overrides (later ones win), before the --options.
        option = re.search(r"\s--[a-z]", command)
        at = option.start() if option else len(command)
        return f"{command[:at]} {' '.join(small_run(command))}{command[at:]}"
    if re.match(r"^python examples/", command) and "--iterations" not in command:
        return command + " --iterations 2"
    if re.match(r"^\S*hybridflow eval\s", command):
        return command + " --limit 4 --k 2"
    return command


def test_generated_reference_is_current():
    stale = stale_files(ROOT / "docs")
    assert not stale, f"stale generated docs {stale}: run `hybridflow docs` (or `make docs`)"


def test_reference_lists_every_field_with_its_default():
    from hybridflow.spec.docgen import _sections, generate_all
    from hybridflow.spec.graph import DataSpec, GraphSpec
    from hybridflow.spec.pool import PoolsFile

    files = generate_all()
    for root, doc in ((GraphSpec, files["graph-file.md"]), (PoolsFile, files["pool-file.md"])):
        parts = doc.split("\n## ")
        for section in _sections(root, ""):
            body = next(p for p in parts if p.startswith(section.title + "\n"))
            for attr, field in section.model.model_fields.items():
                name = field.alias or attr
                assert f"| `{name}` |" in body, f"{section.title}.{name} missing from the reference"
    data = next(p for p in files["graph-file.md"].split("\n## ") if p.startswith("DataSpec\n"))
    default = DataSpec.model_fields["prompts_per_iteration"].default
    assert f"| `prompts_per_iteration` | int (>= 1) | `{default}` |" in data


def test_every_block_has_a_known_language():
    for path in DOC_FILES:
        for lang, body in fenced_blocks(path):
            assert lang in RUN_LANGS | SHOWN_LANGS, f"{path.name}: block in unknown language {lang!r}:\n{body}"


def test_yaml_blocks_validate():
    schemas = json_schemas()
    checked = 0
    for path in DOC_FILES:
        for lang, body in fenced_blocks(path):
            if lang != "yaml":
                continue
            data = yaml.safe_load(body)
            if isinstance(data, dict):
                for value in data.values():
                    if isinstance(value, list):
                        value[:] = [item for item in value if item != "..."]
            kind = "pool" if isinstance(data, dict) and "pools" in data else "graph"
            errors = list(jsonschema.Draft202012Validator(schemas[kind]).iter_errors(data))
            assert not errors, f"{path.name}: {[e.message for e in errors]}\n{body}"
            checked += 1
    assert checked >= 1


def test_exempt_commands_are_run_elsewhere():
    """Every exemption matches a documented command, and the test it names runs that command."""
    documented = [
        c for path in DOC_FILES for lang, body in fenced_blocks(path) if lang in ("bash", "sh", "shell")
        for c in commands(body)
    ]
    for pattern, why in EXEMPT.items():
        assert any(re.search(pattern, c) for c in documented), f"exemption {pattern!r} matches no command"
        for name in re.findall(r"(?:tests|examples)/\w+\.py", why):
            text = (ROOT / name).read_text()
            missing = [needle for needle in COVERED_BY[name] if needle not in text]
            assert not missing, f"{name} no longer runs what {pattern!r} exempts: {missing}"
    for pattern, other in SAME_RUN.items():
        matched = [c for c in documented if re.search(pattern, c)]
        assert matched and other in documented, f"{pattern!r} or `{other}` is no longer documented"
        assert all(_shrunk_run(c) == _shrunk_run(other) for c in matched), (
            f"shrunk, {matched} is no longer the same run as `{other}`"
        )
    assert yaml.safe_load((ROOT / "graphs" / "grpo.yaml").read_text())["resources"] == "resource_pools/local_cpu.yaml"


def test_doc_commands_are_parsed():
    """The extraction itself: a README command list that the runner will see."""
    readme = [c for lang, body in fenced_blocks(ROOT / "README.md") if lang == "bash" for c in commands(body)]
    assert "hybridflow validate graphs/*.yaml" in readme
    assert any(c.startswith("hybridflow plot") for c in readme)
    assert shrink("hybridflow run graphs/grpo.yaml trainer.iterations=20 --run-dir runs/x").startswith(
        "hybridflow run graphs/grpo.yaml trainer.iterations=2 trainer.iterations=2"
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A scratch directory that looks like the repository root to the documented commands."""
    work = tmp_path_factory.mktemp("docs-run")
    for name in ("graphs", "resource_pools", "examples", "docs", ".venv"):
        if (ROOT / name).exists():
            (work / name).symlink_to(ROOT / name)
    return work


def _env(work: Path) -> dict[str, str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    # The trackers a page turns on stay off the network: wandb offline, MLflow's telemetry off.
    env.pop("WANDB_API_KEY", None)
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", MLFLOW_DISABLE_TELEMETRY="true")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # The documented way to make a custom reward module importable by the workers.
    env["PYTHONPATH"] = os.pathsep.join([str(work / "examples"), str(ROOT)])
    return env


def _check_outputs(command: str, done: subprocess.CompletedProcess, work: Path) -> None:
    tokens = shlex.split(command) if not _has_redirect(command) else []
    while tokens and re.match(r"^\w+=", tokens[0]):  # leading VAR=value assignments
        tokens.pop(0)
    if tokens[:2] == ["hybridflow", "run"]:
        # The summary table, one key per row, and nothing printed as a raw Python dict.
        shown = re.search(r"^run summary\n(?:  .*\n?)*?  iterations +(\d+)$", done.stdout, re.M)
        assert shown and "{'" not in done.stdout, done.stdout[-2000:]
        # A run that finished well ends quietly: no worker's traceback on the way out.
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        if "--run-dir" in tokens:
            run_dir = work / _run_dir(command)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert rows and all(math.isfinite(v) for row in rows for v in row.values()), run_dir
            assert len(rows) == int(shown.group(1)), (len(rows), done.stdout[-2000:])
            # a graph without an actor saves the reward or cost models it trained instead
            saved = [run_dir / "actor"] if small_run(command) is SMALL_RUN else [
                run_dir / model for model in ("reward", "cost") if (run_dir / model).is_dir()]
            assert saved and all((d / "config.json").is_file() for d in saved), "the trained model was not saved"
    if tokens[:2] == ["hybridflow", "plot"]:
        png = Path(tokens[tokens.index("--out") + 1]) if "--out" in tokens else Path(tokens[2]) / "plot.png"
        assert (work / png).read_bytes()[:4] == b"\x89PNG", png
    if tokens[:1] == ["python"] and tokens[1].startswith("examples/"):
        assert "'iterations': 2" in done.stdout, done.stdout[-2000:]


def _run_command(path: Path, command: str, work: Path) -> str:
    small = shrink(command)
    done = subprocess.run(["bash", "-c", small], cwd=work, env=_env(work), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{path.name}: `{small}` exited {done.returncode}:\n{done.stderr[-3000:]}"
    _check_outputs(small, done, work)
    return small


def _share_run_dir(path: Path, command: str, work: Path) -> None:
    """A same-run command's run directory is the other run's, made first if no earlier file
    made it (a file run alone)."""
    other = same_run(command)
    mine, theirs = _run_dir(command), _run_dir(other)
    if mine is None or (work / mine).exists():
        return
    if not (work / theirs / "metrics.jsonl").is_file():
        _run_command(path, other, work)
    (work / mine).parent.mkdir(parents=True, exist_ok=True)
    (work / mine).symlink_to(work / theirs)


@pytest.mark.slow
@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_blocks_run(path, workdir):
    ran, exempt = [], []
    for index, (lang, body) in enumerate(fenced_blocks(path)):
        if lang in ("bash", "sh", "shell"):
            for command in commands(body):
                reason = exempt_reason(command)
                if reason:
                    exempt.append((command, reason))
                    if same_run(command):
                        _share_run_dir(path, command, workdir)
                    continue
                ran.append(_run_command(path, command, workdir))
        elif lang == "python":
            script = workdir / f"{path.stem}-block{index}.py"
            script.write_text(re.sub(r"iterations=\d+", "iterations=2", body))
            done = subprocess.run(
                [sys.executable, str(script)], cwd=workdir, env=_env(workdir), capture_output=True, text=True,
                timeout=900,
            )
            assert done.returncode == 0, f"{path.name} python block {index}:\n{done.stderr[-3000:]}"
            ran.append(f"python block {index}")
    print(f"{path.name}: ran {len(ran)}, exempt {exempt}")
