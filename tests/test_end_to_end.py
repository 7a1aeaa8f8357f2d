"""End to end on real Ray, real gloo and a real transformers model: a short GRPO run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridflow.graph.dag import load_graph

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "graphs" / "grpo.yaml"

pytestmark = pytest.mark.slow


def test_short_grpo_run_learns_and_logs(ray_session, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.controller.trainer import Trainer
    from hybridflow.engines.models import build_causal_lm

    graph = load_graph(GRPO, ["trainer.iterations=12", "trainer.val_interval=6", "trainer.progress=false"])
    trainer = Trainer(graph, run_dir=str(tmp_path / "run"))
    summary = trainer.fit()

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, 13))
    for row in rows:
        bad = {k: v for k, v in row.items() if not math.isfinite(v)}
        assert not bad, f"non-finite metrics {bad}"
    expected = {
        "reward/mean", "reward/std", "actor/kl", "actor/entropy", "actor/clip_frac", "actor/grad_norm",
        "response_length/mean", "throughput/tokens_per_s", "timing/generate", "timing/update_actor",
        "timing/iteration",
    }
    assert expected <= set(rows[0]), expected - set(rows[0])
    # The colocated actor's transformers rollout is offloaded after every generation and
    # reloaded before the next (a no-op move on CPU, counted): 2 ranks, once each.
    assert all(r["colocation/rollout_offloads"] >= 2 for r in rows)
    assert rows[0]["colocation/rollout_reloads"] == 0 and all(r["colocation/rollout_reloads"] >= 2 for r in rows[1:])
    assert "val/reward/mean" in rows[5] and "val/reward/mean" in rows[11]
    rewards = [r["reward/mean"] for r in rows]
    assert max(rewards) - min(rewards) > 0.0, "the reward never moved"
    assert rows[-1]["actor/kl"] > 0.0  # the actor left the reference
    assert summary["iterations"] == 12
    assert not (tmp_path / "run" / "record").exists()  # trainer.record unset: nothing recorded

    # The actor's parameters changed: the saved HF model differs from its initial weights.
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "tokenizer")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "actor")
    initial = build_causal_lm(
        graph.spec.models["actor"].source, len(tokenizer), tokenizer.pad_token_id,
        tokenizer.eos_token_id, seed=graph.spec.trainer.seed,
    )
    diffs = [
        (p - initial.state_dict()[name]).abs().max().item() for name, p in saved.state_dict().items()
    ]
    assert max(diffs) > 1e-3
    resolved = (tmp_path / "run" / "graph.yaml").read_text()
    assert "resolved_layouts" in resolved and "iterations: 12" in resolved


def test_cli_run_bad_override_is_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli.main", "run", str(GRPO), "models.actor.rollout.n=zero"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "models.actor.rollout.n" in out.stderr
