"""Micro-batches by token budget (train.micro_batch_tokens): the cut, and an update equal to the
fixed-count micro-batching's under every loss aggregation whose normalisers are global."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from hybridflow.algos import LOSS_AGGS, agg_loss, masked_mean
from hybridflow.data import keys as K
from hybridflow.engines.base import SamplingParams
from hybridflow.engines.hf_rollout import HFRolloutEngine
from hybridflow.engines.models import build_causal_lm
from hybridflow.engines.packing import token_budget_micro_batches
from hybridflow.engines.torch_engine import TorchTrainEngine
from hybridflow.graph.batching import batch_plan
from hybridflow.graph.dag import load_graph
from hybridflow.spec.engines import TorchTrainSpec
from hybridflow.spec.graph import ModelSource, OptimSpec, TrainEngineSpec
from hybridflow.spec.loading import SpecError

PAD, EOS, VOCAB = 0, 1, 12
TINY = ModelSource(config={})

torch.set_num_threads(1)


def test_budget_cut_hand_case():
    # 17 tokens, budget 10: two micro-batches to start with, 9 + 8.
    assert token_budget_micro_batches([5, 4, 3, 3, 2], 10) == [[0, 3], [1, 2, 4]]
    # A sample over the budget goes alone; the rest are still cut.
    assert token_budget_micro_batches([12, 3, 3], 10) == [[0], [1, 2]]
    assert token_budget_micro_batches([], 10) == []
    with pytest.raises(ValueError, match="token budget"):
        token_budget_micro_batches([1], 0)


@pytest.mark.parametrize("seed", range(20))
def test_budget_cut_covers_each_sample_once_within_budget(seed):
    rng = random.Random(seed)
    tokens = [rng.randint(1, 60) for _ in range(rng.randint(1, 40))]
    budget = rng.randint(60, 200)
    groups = token_budget_micro_batches(tokens, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(tokens)))
    loads = [sum(tokens[i] for i in g) for g in groups]
    assert max(loads) <= budget
    # Balanced and not wasteful: within one longest sample of each other, and no two
    # micro-batches that would fit into one.
    assert max(loads) - min(loads) <= max(tokens)
    assert len(groups) == 1 or sorted(loads)[0] + sorted(loads)[1] > budget


def _batch() -> TensorDict:
    """Rollouts of ragged lengths: a budget cut differs from a count cut."""
    ids = torch.tensor([[PAD, PAD, 5, 6, 7], [3, 4, 5, 6, 7], [PAD, 9, 2, 3, 10], [PAD] * 4 + [8]])
    prompts = TensorDict(
        {
            K.PROMPT_IDS: ids,
            K.PROMPT_MASK: (ids != PAD).long(),
            K.UID: torch.arange(4),
            K.PROMPT_TEXT: NonTensorStack(*"abcd"),
            K.GROUND_TRUTH: NonTensorStack(*"abcd"),
        },
        batch_size=[4],
    )
    torch.manual_seed(0)
    rollout = HFRolloutEngine(build_causal_lm(TINY, VOCAB, PAD, EOS, seed=3), eos_id=EOS, pad_id=PAD)
    out = rollout.generate(prompts, SamplingParams(n=3, max_new_tokens=10, temperature=1.5))
    assert out[K.RESPONSE_MASK].sum(-1).min() < 5  # ragged
    gen = torch.Generator().manual_seed(1)
    out[K.ADVANTAGES] = torch.randn(out[K.RESPONSES].shape, generator=gen) * out[K.RESPONSE_MASK]
    return out


def _loss(mode: str):
    def loss_fn(mb, out):
        value = -out["log_probs"] * mb[K.ADVANTAGES] - 0.1 * out["entropy"]
        loss = agg_loss(value, mb[K.RESPONSE_MASK], mode, out["num_global_tokens"], out["num_global_seqs"])
        # A per-micro-batch token mean: the engine's token-weighted average makes it the batch's.
        return loss, {"mean_log_prob": float(masked_mean(out["log_probs"].detach(), mb[K.RESPONSE_MASK]))}

    return loss_fn


def _engine(remove_padding: bool, **cut) -> TorchTrainEngine:
    spec = TorchTrainSpec(remove_padding=remove_padding, optim=OptimSpec(grad_clip=None), **cut)
    engine = TorchTrainEngine(build_causal_lm(TINY, VOCAB, PAD, EOS, seed=2), spec)
    engine.optimizer = torch.optim.SGD(engine.module.parameters(), lr=1.0)  # weights move by -grad
    return engine


@pytest.mark.parametrize("mode", sorted(set(LOSS_AGGS.names()) - {"bnpo"}))
@pytest.mark.parametrize("remove_padding", [True, False])
def test_budget_update_equals_count_update(mode, remove_padding):
    batch = _batch()
    width = batch[K.ATTENTION_MASK].shape[1]
    budget = 40 if remove_padding else 3 * width  # padded: 3 samples per micro-batch
    count, tokens = _engine(remove_padding, micro_batch_size=5), _engine(remove_padding, micro_batch_tokens=budget)
    cut = tokens._micro_batch_rows(batch)
    assert len(cut) > 1 and sorted(torch.cat(cut).tolist()) == list(range(len(batch)))
    assert [len(r) for r in cut] != [5, 5, 2]  # not the count cut
    # The forward gives each sample's outputs in the batch's order.
    a, b = count.forward(batch, temperature=0.8), tokens.forward(batch, temperature=0.8)
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0)
    start = [p.detach().clone() for p in count.module.parameters()]
    ma = count.train_step(batch, _loss(mode), temperature=0.8)
    mb = tokens.train_step(batch, _loss(mode), temperature=0.8)
    assert abs(ma["loss"] - mb["loss"]) < 1e-6 and abs(ma["mean_log_prob"] - mb["mean_log_prob"]) < 1e-5
    moved = max((p - q).abs().max().item() for p, q in zip(count.module.parameters(), start))
    diff = max((p - q).abs().max().item() for p, q in zip(count.module.parameters(), tokens.module.parameters()))
    assert moved > 1e-3 and diff < 1e-5 * max(1.0, moved), (diff, moved)


def test_budget_micro_batches_hold_at_most_the_budget():
    batch = _batch()
    lengths = batch[K.ATTENTION_MASK].sum(-1)
    rows = _engine(True, micro_batch_tokens=30)._micro_batch_rows(batch)
    assert len(rows) > 1 and all(int(lengths[r].sum()) <= 30 for r in rows)


def test_bnpo_with_a_token_budget_is_refused():
    root = Path(__file__).resolve().parents[1]
    overrides = ["models.actor.train.micro_batch_tokens=512", "nodes.update_actor.options.loss_agg=bnpo"]
    with pytest.raises(SpecError, match=r"models\.actor\.train\.micro_batch_tokens: .*'bnpo'"):
        graph = load_graph(root / "graphs" / "grpo.yaml", overrides)
        batch_plan(graph.spec, graph.layouts, graph.file)
    graph = load_graph(root / "graphs" / "grpo.yaml", overrides[:1])
    assert "micro-batches of <= 512 tokens" in batch_plan(graph.spec, graph.layouts, graph.file).describe()


def test_micro_batch_tokens_is_refused_for_megatron():
    with pytest.raises(ValueError, match="micro_batch_tokens is for train.engine 'torch'"):
        TrainEngineSpec(engine="megatron", micro_batch_tokens=512)
