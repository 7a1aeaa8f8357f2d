"""Engines as registered records: graph files name them, code outside ``hybridflow/engines``
asks their capabilities (never their names), the rollout contract is whole, colocation moves
rollout engines, and ``placement`` plans without Ray."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from hybridflow.graph.dag import load_graph
from hybridflow.spec.engines import EngineCaps, EngineRecord, engine_names, register_engine, unregister_engine
from hybridflow.spec.loading import SpecError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hybridflow"
GRPO = ROOT / "graphs" / "grpo.yaml"

# Uses of a string equal to an engine name that do not pick engine behaviour, by file and line text.
ALLOWED = {
    ("hybridflow/workers/recording.py",
     'return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}'),
}


def _engine_name_uses(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """Comparisons with, dict keys equal to and ``Literal[...]`` of engine names in ``path``."""
    tree = ast.parse(path.read_text())
    found = []

    def named(node) -> bool:
        if isinstance(node, ast.Constant) and node.value in names:
            return True
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(named(e) for e in node.elts)

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(named(n) for n in [node.left, *node.comparators]):
            found.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(k is not None and named(k) for k in node.keys):
            found.append(node.lineno)
        elif isinstance(node, ast.Subscript) and getattr(node.value, "id", getattr(node.value, "attr", None)) == "Literal":
            if named(node.slice):
                found.append(node.lineno)
    lines = path.read_text().splitlines()
    return [(n, lines[n - 1].strip()) for n in sorted(set(found))]


def test_no_engine_name_selects_behaviour_outside_engines():
    names = set(engine_names("train")) | set(engine_names("rollout"))
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        inside = rel.startswith("hybridflow/engines/")
        for lineno, text in _engine_name_uses(path, names):
            literal = "Literal[" in text
            if (literal or not inside) and (rel, text) not in ALLOWED:
                offenders.append(f"{rel}:{lineno}: {text}")
    assert not offenders, "ask the engine record's caps instead:\n" + "\n".join(offenders)


def test_the_scan_finds_a_name_comparison(tmp_path):
    """The scan above can fail: each form it looks for is found."""
    code = 'if x.engine == "vllm": pass\nd = {"torch": 1}\ny = a in ("hf", "b")\nT = Literal["torch", "megatron"]\n'
    (tmp_path / "m.py").write_text(code)
    assert [n for n, _ in _engine_name_uses(tmp_path / "m.py", {"vllm", "torch", "hf", "megatron"})] == [1, 2, 3, 4]


def test_graph_sections_are_unions_of_the_registered_configs():
    from hybridflow.spec.engines import MegatronTrainSpec, TorchTrainSpec, VLLMRolloutSpec

    spec = load_graph(GRPO).spec
    assert type(spec.models["actor"].train) is TorchTrainSpec  # the default engine's config
    # The torch engine's options keep their paths (graph files and overrides before records).
    spec = load_graph(GRPO, ["models.actor.train.compute_dtype=bfloat16", "models.actor.train.share_prompts=true"]).spec
    assert (spec.models["actor"].train.compute_dtype, spec.models["actor"].train.share_prompts) == ("bfloat16", True)
    spec = load_graph(GRPO, ["models.actor.train.engine=megatron", "models.actor.rollout.engine=vllm",
                             "models.actor.rollout.lora_sync=merged"]).spec
    assert type(spec.models["actor"].train) is MegatronTrainSpec and type(spec.models["actor"].rollout) is VLLMRolloutSpec
    with pytest.raises(SpecError, match=r"^.*grpo\.yaml: models\.actor\.train\.share_prompts: share_prompts is for train\.engine 'torch' or 'fsdp2' \(engine is 'megatron'\)$"):
        load_graph(GRPO, ["models.actor.train.engine=megatron", "models.actor.train.share_prompts=true"])
    with pytest.raises(SpecError, match=r"grpo\.yaml: models\.actor\.rollout\.engine: unknown rollout engine 'jax'; known: hf, vllm"):
        load_graph(GRPO, ["models.actor.rollout.engine=jax"])
    with pytest.raises(SpecError, match=r"grpo\.yaml: models\.actor\.train\.torch_only: unknown field"):
        load_graph(GRPO, ["models.actor.train.torch_only=1"])


def test_a_registered_engine_is_named_by_a_graph_and_refused_once_gone():
    from hybridflow.spec.graph import RolloutSpec

    class NoopRolloutSpec(RolloutSpec):
        speed: int = 1

    register_engine(EngineRecord("noop", "rollout", "no.such:Engine", NoopRolloutSpec, EngineCaps()))
    try:
        spec = load_graph(GRPO, ["models.actor.rollout.engine=noop", "models.actor.rollout.speed=3"]).spec
        assert spec.models["actor"].rollout.speed == 3
        # its capabilities decide, not its name: without caps.lora a LoRA actor cannot use it
        with pytest.raises(SpecError, match=r"models\.actor\.rollout\.engine: 'noop' takes no LoRA adapters \(train\.lora\); use rollout\.engine hf or vllm"):
            load_graph(GRPO, ["models.actor.rollout.engine=noop", "models.actor.train.lora.rank=4"])
    finally:
        unregister_engine("rollout", "noop")
    with pytest.raises(SpecError, match="unknown rollout engine 'noop'"):
        load_graph(GRPO, ["models.actor.rollout.engine=noop"])


def test_preflight_asks_the_record():
    """Preflight reads the capabilities: a missing optional package, CUDA on a CPU pool."""
    from hybridflow.controller.preflight import check_engines_installed
    from hybridflow.spec.graph import TrainEngineSpec

    class CudaSpec(TrainEngineSpec):
        pass

    class PackagedSpec(TrainEngineSpec):
        pass

    register_engine(EngineRecord("cuda_only", "train", "no.such:Engine", CudaSpec, EngineCaps(needs_cuda=True)))
    register_engine(EngineRecord("packaged", "train", "no.such:Engine", PackagedSpec,
                                 EngineCaps(package="no_such_package_x", install="pip install x")))
    try:
        with pytest.raises(SpecError, match=r"models\.actor\.train\.engine: 'cuda_only' runs on CUDA devices only; pool 'default' is a cpu pool"):
            check_engines_installed(load_graph(GRPO, ["models.actor.train.engine=cuda_only"]))
        with pytest.raises(SpecError, match=r"models\.actor\.train\.engine: 'packaged' needs no_such_package_x, which is not installed: pip install x"):
            check_engines_installed(load_graph(GRPO, ["models.actor.train.engine=packaged"]))
    finally:
        unregister_engine("train", "cuda_only")
        unregister_engine("train", "packaged")


def test_rollout_contract_refuses_what_an_engine_cannot_do():
    import torch

    from hybridflow.engines.base import SamplingParams, WeightUpdates
    from hybridflow.engines.hf_rollout import HFRolloutEngine

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="tp 1 only"):
        HFRolloutEngine.build(model, _Tok(), max_model_len=8, max_num_seqs=1, seed=0, tp_ranks=[0, 1])
    engine = HFRolloutEngine.build(model, _Tok(), max_model_len=8, max_num_seqs=1, seed=0, tp_ranks=[0])
    with pytest.raises(ValueError, match="partial rollouts"):
        engine.generate(None, SamplingParams(), WeightUpdates(poll=lambda: None))


class _Tok:
    eos_token_id, pad_token_id = 1, 0


def test_placement_plans_without_ray():
    code = (
        "import sys, hybridflow.placement.automapper, hybridflow.placement.simulator, "
        "hybridflow.placement.profiles; import pkgutil, importlib, hybridflow.placement as p; "
        "[importlib.import_module('hybridflow.placement.' + m.name) for m in pkgutil.iter_modules(p.__path__)]; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'vllm', 'megatron'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_device_check_dry_run_lists_and_skips():
    script = ROOT / "tests" / "gpu" / "device_check.sh"
    assert script.stat().st_mode & 0o111, "device_check.sh must be executable"
    out = subprocess.run([str(script), "--dry-run"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("would run: ") for line in lines), out.stdout
    assert any(line.startswith("skip: ") and "vLLM" in line for line in lines), out.stdout
    # the FSDP2 engine's one-device step against the torch engine's (no Ray, no vLLM)
    assert any(line.startswith("would run: fsdp2-cuda ") and "tests/gpu/test_fsdp2_cuda.py" in line
               for line in lines), out.stdout


@pytest.mark.slow
def test_plugin_rollout_engine_runs_a_graph(ray_session, tmp_path):
    """A graph file names an engine its ``plugins:`` module registers (tests/plugins/
    counting_engine.py). The loader imports the module in the controller; the workers import it
    from the same folder before they read the graph."""
    import ray

    from hybridflow.controller.trainer import Trainer

    graph = load_graph(ROOT / "tests" / "plugins" / "grpo_counting.yaml", ["data.num_val=0"])
    assert graph.spec.models["actor"].rollout.label == "mine"
    assert type(graph.spec.models["actor"].rollout).__module__ == "counting_engine"
    seen = []
    trainer = Trainer(graph, run_dir=str(tmp_path / "run"))

    def probe(t, iteration, metrics):
        worker = t.groups[graph.placement["actor"]].workers[0]
        seen.append(ray.get(worker.__ray_call__.remote(
            lambda w: (type(w.rollout_engines["actor"]).__name__, w.rollout_engines["actor"].calls,
                       w.spec.models["actor"].rollout.label))))

    trainer.callbacks.append(probe)
    try:
        trainer.fit()
    finally:  # the registry is process-wide: later tests list the built-in engines only
        unregister_engine("rollout", "counting")
    assert seen == [("CountingRollout", 1, "mine"), ("CountingRollout", 2, "mine")]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["colocation/rollout_offloads"] for r in rows] == [r["colocation/rollout_offloads"] for r in rows[:1]] * 2
    assert rows[0]["colocation/rollout_offloads"] >= 1 and rows[1]["colocation/rollout_reloads"] >= 1


def test_fsdp2_section_takes_the_torch_update_options_and_refuses_lora_and_compile():
    from hybridflow.spec.engines import FSDP2TrainSpec, caps_of

    spec = load_graph(GRPO, ["models.actor.train.engine=fsdp2", "models.actor.train.share_prompts=true",
                             "models.actor.train.compute_dtype=bfloat16", "models.actor.train.sync_bucket_mb=8"]).spec
    train = spec.models["actor"].train
    assert type(train) is FSDP2TrainSpec and (train.share_prompts, train.sync_bucket_mb) == (True, 8)
    assert caps_of(train).sharded_data_parallel and not caps_of(train).model_parallel
    assert train.adapters is None and not train.compiles
    for option in ("lora={rank: 4}", "compile=true"):
        name = option.split("=")[0]
        with pytest.raises(SpecError, match=rf"^.*grpo\.yaml: models\.actor\.train\.{name}: {name} is for "
                                            rf"train\.engine 'torch' \(engine is 'fsdp2'\)$"):
            load_graph(GRPO, ["models.actor.train.engine=fsdp2", f"models.actor.train.{option}"])
