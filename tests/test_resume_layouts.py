"""Checkpoints that outlive their layout: saved under one tp x pp x dp, loaded under another with
the weights, optimizer state and LR schedule equal (bitwise) after the load.

- The torch engine through the CLI: a grpo.yaml run on two data-parallel ranks resumes on one
  (`--pools resource_pools/one_cpu.yaml --resume`), the data position carried over.
- The torch (DDP) engine and FSDP2 through the CLI: a run saved under one resumes under the
  other and back.
- The megatron engine on real gloo ranks: tp=2 -> tp=1 (dp=2) -> tp=2 -> pp=2, each checkpoint
  written by the workers' own save path (``workers/checkpointing.py``).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoint_harness import saved_state
from hybridflow.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "trainer.progress=false", "trainer.val_interval=0", "data.num_val=0", "data.prompts_per_iteration=4",
    "models.actor.rollout.n=4",
]

pytestmark = pytest.mark.slow


def test_run_saved_at_dp2_resumes_at_dp1(ray_session, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(ROOT)
    run = str(tmp_path / "run")
    one = "resource_pools/one_cpu.yaml"
    assert main(["run", "graphs/grpo.yaml", *SMALL, "trainer.iterations=2", "--run-dir", run]) == 0
    saved_actor = tmp_path / "actor_dp2"
    shutil.move(tmp_path / "run" / "actor", saved_actor)  # the dp=2 weights after iteration 2
    graph = yaml_graph(tmp_path / "run")
    assert graph["resolved_layouts"]["actor"]["dp"] == 2
    # `hybridflow eval` of the run directory (no actor/ now: its newest checkpoint) scores the
    # same weights as the saved actor: prompt for prompt, the same greedy responses.
    evals = {}
    for name, actor in [("actor", saved_actor), ("checkpoint", tmp_path / "run")]:
        out = tmp_path / f"eval_{name}.json"
        assert main(["eval", "graphs/grpo.yaml", *SMALL, "data.num_val=8", "--actor", str(actor), "--limit", "8", "--k", "2",
                     "--json", str(out)]) == 0
        evals[name] = json.loads(out.read_text())
    assert evals["checkpoint"]["prompts"] == evals["actor"]["prompts"]
    assert evals["checkpoint"]["summary"] == evals["actor"]["summary"]

    # Resumed at dp=1 with nothing left to run: the final actor is the state just loaded.
    with caplog.at_level(logging.WARNING):
        assert main(["run", "graphs/grpo.yaml", *SMALL, "trainer.iterations=2", "--pools", one,
                     "--run-dir", run, "--resume"]) == 0
    changed = [r.getMessage() for r in caplog.records if "under another layout" in r.getMessage()]
    assert changed == [
        "resuming iteration 2 under another layout: actor tp=1 pp=1 dp=2 -> tp=1 pp=1 dp=1; ref tp=1 "
        "pp=1 dp=2 -> tp=1 pp=1 dp=1; reward tp=1 pp=1 dp=2 -> tp=1 pp=1 dp=1; pool 'default' 2 -> 1 "
        "ranks (per-rank RNG streams restart from trainer.seed, rank and iteration; weights, "
        "optimizer, LR schedule and data position carry over)"
    ]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "actor").state_dict()
    expected = AutoModelForCausalLM.from_pretrained(saved_actor).state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)

    # The command: the run continues at dp=1 to iteration 4.
    assert main(["run", "graphs/grpo.yaml", "trainer.iterations=4", *SMALL, "--pools", one,
                 "--run-dir", run, "--resume"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert yaml_graph(tmp_path / "run")["resolved_layouts"]["actor"]["dp"] == 1
    # the data position carried over: iterations 3 and 4 saw the prompts after iteration 2's
    state = torch.load(tmp_path / "run" / "checkpoints" / "iter_00000004" / "controller.pt", weights_only=False)
    assert state["dataset"] == _dataset_after(4)
    optim = saved_state(tmp_path / "run" / "checkpoints" / "iter_00000004")["optim"]
    assert {float(v) for k, v in optim.items() if k.endswith(".step")} == {4.0}  # one step per iteration


def yaml_graph(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "graph.yaml").read_text())


def test_a_run_saved_under_ddp_resumes_under_fsdp2_and_back(ray_session, tmp_path, monkeypatch):
    """grpo.yaml: 2 iterations on the torch engine (DDP over two ranks), the 3rd resumed under
    FSDP2, the 4th under DDP again. Each resume trains on from the loaded actor: its KL to the
    (untrained) reference is far from the 0 of a freshly built actor."""
    monkeypatch.chdir(ROOT)
    run = str(tmp_path / "run")
    for iterations, engine, resume in [(2, "torch", []), (3, "fsdp2", ["--resume"]), (4, "torch", ["--resume"])]:
        assert main(["run", "graphs/grpo.yaml", *SMALL, f"trainer.iterations={iterations}", "trainer.save_interval=1",
                     f"models.actor.train.engine={engine}", "--run-dir", run, *resume]) == 0
        assert yaml_graph(tmp_path / "run")["models"]["actor"]["train"]["engine"] == engine
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["actor/kl"] < 1e-6  # the actor before any update is the reference
    assert all(r["actor/kl"] > 1e-5 for r in rows[2:]), [r["actor/kl"] for r in rows]
    assert all(r["actor/skipped_step"] == 0.0 for r in rows)


def _dataset_after(iterations: int) -> dict:
    """The dataset state of an uninterrupted SMALL grpo run after ``iterations`` batches."""
    from hybridflow.data.datasets import PromptDataset, load_prompt_rows
    from hybridflow.data.tasks import get_task
    from hybridflow.graph.dag import load_graph

    spec = load_graph(ROOT / "graphs" / "grpo.yaml", SMALL).spec
    rows, _ = load_prompt_rows(spec.data.source, str(ROOT), spec.data.num_train, spec.data.num_val, spec.data.seed)
    dataset = PromptDataset(rows, get_task("copy").tokenizer(), spec.data.max_prompt_length,
                            spec.data.prompts_per_iteration, spec.data.shuffle, spec.data.seed)
    for _ in range(iterations):
        dataset.next_batch()
    return dataset.state_dict()


# -- megatron: tp=2 -> tp=1 -> tp=2 -> pp=2 -----------------------------------------------------


def _pieces_match(state, saved, where: str = "") -> None:
    """Every tensor of an engine state equals its part of the checkpoint's full tensor (a
    pipeline stage holds its own layers' entries only)."""
    if isinstance(state, dict):
        assert set(state) <= set(saved), where
        for key in sorted(state):
            _pieces_match(state[key], saved[key], f"{where}.{key}")
    elif isinstance(state, torch.Tensor):
        whole = state.full_tensor() if hasattr(state, "full_tensor") else state  # a DTensor's all-gather
        assert torch.equal(whole.cpu(), saved), where
    else:
        assert state == saved, where


def _phase(rank, world, port, tp, pp, load_from, save_to, seed, backend="gloo"):
    from megatron_harness import init_dist, pg_loss, random_batch, tiny_hf

    from hybridflow.engines.megatron import MegatronTrainEngine
    from hybridflow.spec.graph import OptimSpec, TrainEngineSpec
    from hybridflow.spec.layout import ParallelLayout
    from hybridflow.workers import checkpointing

    init_dist(rank, world, port, backend)
    optim = OptimSpec(lr=1e-2, warmup_steps=2, schedule="cosine", weight_decay=0.1)
    spec = TrainEngineSpec(engine="megatron", layout=ParallelLayout(tp=tp, pp=pp), micro_batch_size=2, optim=optim)
    # Every phase starts from other weights: what it has after the load came from the checkpoint.
    engine = MegatronTrainEngine(tiny_hf(seed=seed), spec, total_steps=10)
    if load_from is not None:
        checkpointing.load_engines(load_from, {"actor": engine})
        expected = torch.load(Path(load_from) / "full_hf.pt")
        full = engine.full_hf_state()
        for name, tensor in expected.items():
            assert torch.equal(full[name].cpu(), tensor), name
        saved = saved_state(load_from)
        state = engine.state_dict()
        _pieces_match(state, saved)
        assert state["schedule"] == saved["schedule"] and state["schedule"]["step_count"] > 0
        assert state["optim"]["step"] == saved["optim"]["step"] > 0
    if save_to is None:
        return
    for step in range(2):
        engine.train_step(random_batch(8, seed=10 * seed + step).chunk(world)[rank], pg_loss)
    checkpointing.save(save_to, "default", rank, {"actor": engine}, {})
    full = engine.full_hf_state()
    if rank == 0:
        torch.save({n: t.cpu() for n, t in full.items()}, Path(save_to) / "full_hf.pt")


def checkpoints_across_layouts(tmp_path: Path, backend: str = "gloo") -> None:
    """Train and save under each layout in turn, each loading the previous one's checkpoint."""
    from megatron_harness import spawn

    start_method = "forkserver" if backend == "gloo" else "spawn"
    layouts = [(2, 1), (1, 1), (2, 1), (1, 2)]  # tp=2 -> tp=1 (dp=2) -> tp=2 -> pp=2
    previous = None
    for i, (tp, pp) in enumerate(layouts):
        target = tmp_path / f"ckpt{i}" if i < len(layouts) - 1 else None
        if target is not None:
            (target / "pool_default").mkdir(parents=True)
        spawn(_phase, 2, tp, pp, None if previous is None else str(previous),
              None if target is None else str(target), i + 1, backend, start_method=start_method)
        previous = target


def test_megatron_checkpoint_loads_across_tp_and_pp(tmp_path):
    pytest.importorskip("megatron.core")
    from megatron_harness import tiny_hf

    from hybridflow.workers.checkpointing import read_hf_weights

    checkpoints_across_layouts(tmp_path)
    # What `hybridflow eval` reads from a megatron checkpoint: the full HF weights, in one process.
    config = tiny_hf().config
    for saved in sorted(tmp_path.glob("ckpt*")):
        expected = torch.load(saved / "full_hf.pt")
        read = read_hf_weights(saved, "actor", config)
        assert read.keys() == expected.keys() | {"lm_head.weight"}  # tied: the embedding's
        assert all(torch.equal(read[k], expected[k]) for k in expected), saved
