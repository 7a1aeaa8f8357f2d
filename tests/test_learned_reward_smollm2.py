"""SmolLM2 against a learned reward (docs/learned-rewards.md, "SmolLM2"), shrunk:
graphs/reward_model_smollm2.yaml trains LoRA adapters and a value head on the SmolLM2 backbone
from arith_words pairs, saves a plain scalar model, and graphs/grpo_smollm2_rm.yaml runs GRPO
scored by it, with the answer checker logged only; `hybridflow eval` on that graph grades with
the checker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
# 8-token answers: the overlong buffer (the graph's last 16 of 32 tokens) shrinks with them
SHORT = ["data.max_response_length=8", "nodes.reward.options.overlong_buffer=4"]
NO_CHECKPOINT = ["trainer.save_interval=0"]  # the final models are still saved (trainer.save_final)


def _pairs(problems: list[dict], path: Path) -> Path:
    """The right answer against a wrong one: the shape `eval --pairs-out` writes."""
    rows = [{"prompt": p["prompt"], "chosen": str(p["extra_info"]["answer"]),
             "rejected": str(p["extra_info"]["answer"] + 7)} for p in problems]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_smollm2_reward_model_then_grpo_against_it(ray_session, tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForTokenClassification

    from hybridflow.data.arith_words import make_problems

    monkeypatch.chdir(ROOT)
    problems = make_problems(24, seed=0)  # inside the training split (the first 2000)
    train, val = _pairs(problems[:16], tmp_path / "train.jsonl"), _pairs(problems[16:], tmp_path / "val.jsonl")
    rm_dir = tmp_path / "rm"
    assert main(["run", "graphs/reward_model_smollm2.yaml", f"data.train_files={train}", f"data.val_files={val}",
                 "trainer.iterations=1", "trainer.val_interval=1", "data.prompts_per_iteration=8", *NO_CHECKPOINT,
                 "--run-dir", str(rm_dir)]) == 0
    rows = [json.loads(line) for line in (rm_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and 0.0 <= rows[0]["rm/accuracy"] <= 1.0
    assert 0.0 <= rows[-1]["val/rm/accuracy"] <= 1.0
    # LoRA saved merged: a plain scalar model with the backbone's 30 layers
    saved = AutoModelForTokenClassification.from_pretrained(rm_dir / "reward")
    assert saved.config.num_labels == 1 and saved.config.num_hidden_layers == 30
    assert not (rm_dir / "reward" / "adapter_config.json").exists()

    run_dir = tmp_path / "grpo"
    assert main(["run", "graphs/grpo_smollm2_rm.yaml", f"models.reward.source.run={rm_dir}",
                 # the transformers rollout: no vLLM start (tests/test_smollm2.py runs the vLLM one)
                 "models.actor.rollout={engine: hf, n: 2, temperature: 0.7}", "trainer.iterations=1",
                 "data.prompts_per_iteration=2", *SHORT, *NO_CHECKPOINT, "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the learned reward is normalised (mean 0 over what it has seen); the checker is logged
    assert len(rows) == 1 and "reward/raw_mean" in rows[0] and 0.0 <= rows[0]["rule/reward_mean"] <= 1.0

    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert main(["eval", "graphs/grpo_smollm2_rm.yaml", "--actor", str(run_dir), "--engine", "hf",
                 "--limit", "2", "--samples", "0", *SHORT, "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    # graded by the checker: accuracy is a fraction of the 2 prompts, 0/1 scores
    assert summary["prompts"] == 2 and summary["greedy_accuracy"] in (0.0, 0.5, 1.0)
    assert summary["greedy_mean_score"] == summary["greedy_accuracy"]
