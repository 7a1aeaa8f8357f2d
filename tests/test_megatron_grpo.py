"""graphs/grpo_megatron.yaml end to end: the actor trains under megatron-core TP=2 on two gloo
ranks (real Ray workers), generates at tg = 1 from the gathered full HF model, and learns."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from hybridflow.graph.dag import load_graph  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def test_grpo_megatron_tp2_trains_and_syncs(ray_session, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.controller.trainer import Trainer
    from hybridflow.engines.models import build_causal_lm

    overrides = ["trainer.iterations=6", "trainer.val_interval=0", "trainer.progress=false"]
    graph = load_graph(ROOT / "graphs" / "grpo_megatron.yaml", overrides)
    assert graph.spec.models["actor"].train.engine == "megatron"
    Trainer(graph, run_dir=str(tmp_path / "run")).fit()

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    for row in rows:
        assert all(math.isfinite(v) for v in row.values()), row
        assert row["actor/skipped_step"] == 0.0
    # Generation samples from the weights megatron just trained: after every update the full
    # model is gathered from the TP shards into the rollout model, so the rollout's log-probs
    # equal the training forward's (old_log_prob node) up to float32 noise.
    assert all(r["actor/rollout_log_prob_diff_max"] < 1e-4 for r in rows)
    assert rows[0]["actor/kl"] < 1e-6  # actor (megatron) == ref (torch) before any update
    assert rows[-1]["actor/kl"] > 0.0
    # The saved actor (gathered from the TP=2 shards) moved away from its initial weights.
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run" / "tokenizer")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "actor")
    initial = build_causal_lm(
        graph.spec.models["actor"].source, len(tokenizer), tokenizer.pad_token_id,
        tokenizer.eos_token_id, seed=graph.spec.trainer.seed,
    )
    diffs = [(p - initial.state_dict()[n]).abs().max().item() for n, p in saved.state_dict().items()]
    assert max(diffs) > 1e-3
