"""A few decoded generations for RUN_DIR/samples.jsonl, spread over a rank's prompts.

Decoded on the worker, where the tokens are, so the controller gets short strings in the meta
and never the rollout tensors.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.workers.context import WorkerContext


def logged_samples(
    ctx: WorkerContext, batch: TensorDict, scores: torch.Tensor, score_name: str, observations: bool = False,
    extra: dict[str, list[str]] | None = None,
) -> list[dict]:
    """Rows ``{prompt, response, <score_name>, ground_truth}``; with ``observations``
    (multi-turn) the environment's tokens are shown in the response too; ``extra``: more
    per-sample strings by name (a judge's verdicts)."""
    trainer = ctx.spec.trainer
    if not trainer.sample_interval or K.PROMPT_TEXT not in batch.keys():
        return []
    count = min(len(scores), math.ceil(trainer.num_logged_samples / ctx.world_size))
    rows = torch.linspace(0, len(scores) - 1, count).round().long().tolist()
    width = batch[K.RESPONSES].shape[1]
    mask = batch[K.ATTENTION_MASK][:, -width:] if observations else batch[K.RESPONSE_MASK]
    responses = ctx.tokenizer.batch_decode(batch[K.RESPONSES][rows] * mask[rows], skip_special_tokens=True)
    prompts = batch.get(K.PROMPT_TEXT).tolist()
    truths = batch.get(K.GROUND_TRUTH).tolist() if K.GROUND_TRUTH in batch.keys() else None
    return [
        {"prompt": prompts[r], "response": text, score_name: round(float(scores[r]), 4)}
        | ({"ground_truth": truths[r]} if truths is not None else {})
        | {name: values[r] for name, values in (extra or {}).items()}
        for r, text in zip(rows, responses)
    ]
