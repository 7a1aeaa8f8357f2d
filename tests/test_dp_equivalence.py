"""Data-parallel equivalence: one train_step at dp=2 (real gloo) equals one at dp=1.

The batch has very ragged responses and the halves are as unequal as possible (long responses on
rank 0, short on rank 1), so a per-rank token mean averaged over ranks would differ clearly from
the global token mean; micro_batch_size < local batch size exercises gradient accumulation.

AdamW's first step is close to ``lr * sign(grad)``: the parameter comparison catches wrong
*relative* weighting of tokens (a per-rank mean moves parameters ~2 * lr apart) but not a wrong
global scale of the gradient, which the ``grad_norm`` and ``loss`` comparisons catch.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

from hybridflow.algos import agg_loss, ppo_clip_policy_loss
from hybridflow.data import keys as K
from hybridflow.data.batch import build_rollout_fields

PAD, EOS, VOCAB = 0, 1, 16
LENGTHS = [8, 7, 6, 5, 1, 1, 2, 3]  # rank 0 gets the first half
NUM_PROMPT, NUM_RESPONSE = 4, 8
TOLERANCE = 1e-6

pytestmark = pytest.mark.slow


def _batch(vocab: int = VOCAB) -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    num = len(LENGTHS)
    prompt_ids = torch.randint(2, vocab, (num, NUM_PROMPT), generator=gen)
    prompt_ids[::2, :2] = PAD  # left padding on every other prompt
    responses = torch.randint(2, vocab, (num, NUM_RESPONSE), generator=gen)
    for row, length in enumerate(LENGTHS):
        if length < NUM_RESPONSE:
            responses[row, length - 1] = EOS
    fields = build_rollout_fields(prompt_ids, (prompt_ids != PAD).long(), responses, EOS, PAD)
    assert fields[K.RESPONSE_MASK].sum(-1).tolist() == LENGTHS
    mask = fields[K.RESPONSE_MASK].float()
    fields[K.ADVANTAGES] = torch.randn(num, NUM_RESPONSE, generator=gen) * mask
    # Behaviour log-probs off the current ones so that some tokens clip.
    fields[K.OLD_LOG_PROBS] = (-2.5 + 0.3 * torch.randn(num, NUM_RESPONSE, generator=gen)) * mask
    return TensorDict(fields, batch_size=[num])


def _ppo_loss(mb: TensorDict, out: dict[str, torch.Tensor]):
    loss_mat, metrics = ppo_clip_policy_loss(
        out["log_probs"], mb[K.OLD_LOG_PROBS], mb[K.ADVANTAGES], mb[K.RESPONSE_MASK], clip_ratio=0.2
    )
    return agg_loss(loss_mat, mb[K.RESPONSE_MASK], "token-mean", out["num_global_tokens"]), metrics


def _clip(vocab: int) -> float:
    """A clip norm below the first step's gradient norm (smaller with the wider head)."""
    return 1.0 if vocab == VOCAB else 0.005


def _train_once(
    batch: TensorDict, micro_batch_size: int, vocab: int = VOCAB, tied: bool = False
) -> tuple[dict, dict[str, torch.Tensor]]:
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.engines.torch_engine import TorchTrainEngine
    from hybridflow.spec.engines import TorchTrainSpec
    from hybridflow.spec.graph import ModelSource, OptimSpec

    model = build_causal_lm(ModelSource(config={"tie_word_embeddings": tied}), vocab, PAD, EOS, 0)
    spec = TorchTrainSpec(
        micro_batch_size=micro_batch_size, optim=OptimSpec(lr=1e-3, grad_clip=_clip(vocab))
    )
    engine = TorchTrainEngine(model, spec)
    metrics = engine.train_step(batch, _ppo_loss, temperature=0.7)
    return metrics, {k: v.clone() for k, v in engine.named_weights()}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, vocab: int, tied: bool) -> None:
    torch.set_num_threads(1)
    threads_before = _threads()
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        half = len(LENGTHS) // world_size
        local = _batch(vocab)[rank * half : (rank + 1) * half]
        metrics, weights = _train_once(local, micro_batch_size=3, vocab=vocab, tied=tied)
    finally:
        dist.destroy_process_group()
    # The engine is gone with _train_once's frame, so the group is too: no gloo thread may run
    # on into the interpreter's shutdown (a rank aborted there now and then when one did).
    threads_left = _threads() - threads_before
    torch.save(
        {"metrics": metrics, "weights": weights, "threads_left": threads_left},
        f"{out_dir}/rank{rank}.pt",
    )


# 2048 words, tied: the chunked log-prob read-out (train.logits_chunk_tokens) under DDP, its
# head gradient reaching the embedding through the tie.
@pytest.mark.parametrize("vocab, tied", [(VOCAB, False), (2048, True)])
def test_dp2_step_equals_dp1_step(tmp_path, vocab, tied):
    from hybridflow.engines.models import build_causal_lm
    from hybridflow.spec.graph import ModelSource

    torch.set_num_threads(1)
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), vocab, tied), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    single_metrics, single = _train_once(_batch(vocab), micro_batch_size=3, vocab=vocab, tied=tied)
    initial = dict(
        build_causal_lm(
            ModelSource(config={"tie_word_embeddings": tied}), vocab, PAD, EOS, 0
        ).named_parameters()
    )

    moved = max((single[k] - initial[k]).abs().max().item() for k in single)
    assert moved > 1e-4, "the step must move the parameters for the comparison to mean anything"
    for rank in ranks:
        assert rank["threads_left"] == 0, "the process group's threads outlived destroy_process_group"
        diff = max((rank["weights"][k] - single[k]).abs().max().item() for k in single)
        assert diff < TOLERANCE, f"dp=2 vs dp=1 max abs param diff {diff:.3g}"
        for key in ("loss", "grad_norm", "clip_frac", "lr"):
            assert rank["metrics"][key] == pytest.approx(single_metrics[key], rel=1e-5, abs=1e-7)
    assert 0 < single_metrics["clip_frac"] < 1, "some tokens should clip"
    assert single_metrics["grad_norm"] > _clip(vocab), "clipping should be active"
