"""``generate``: single-turn rollouts on the actor's rollout engine."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.engines.base import SamplingParams, WeightUpdates
from hybridflow.graph.dag import Node
from hybridflow.workers.context import WorkerContext


def generate(ctx: WorkerContext, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    """``rollout.n`` samples per prompt (1 when greedy), each tagged with the weight version
    that generated it; with partial rollouts, weights arriving meanwhile load between two
    decoding steps (``weight_version_last``: the version of a sample's last token)."""
    spec = ctx.spec
    rollout = spec.models[node.model].rollout
    greedy = node.spec.options.greedy
    params = SamplingParams(
        n=1 if greedy else rollout.n,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=spec.data.max_response_length,
        greedy=greedy,
        min_new_tokens=spec.data.max_response_length if rollout.fixed_length and not greedy else 0,
        # A greedy generation's log-probs are dropped (its key carries no rollout_log_probs).
        log_prob_samples=0 if greedy else (
            None if ctx.graph.reads_rollout_log_probs(node.model) else rollout.log_prob_check_samples
        ),
    )
    ctx.staged.load(node.model, ctx.rollout_engines[node.model])
    versions = [ctx.rollout_versions[node.model]]  # at the start, then one per load in flight
    updates = _weight_updates(ctx, node.model, versions)
    engine = ctx.rollout_engines[node.model]
    out = engine.generate(batch, params, updates)
    out[K.WEIGHT_VERSION] = torch.full((out.batch_size[0],), versions[0], dtype=torch.int64)
    loads = out.pop(K.WEIGHT_LOADS) if K.WEIGHT_LOADS in out.keys() else torch.zeros_like(out[K.WEIGHT_VERSION])
    out[K.WEIGHT_VERSION_LAST] = torch.tensor(versions, dtype=torch.int64)[loads]
    response_mask = out[K.RESPONSE_MASK]
    lengths = response_mask.sum(-1).float()
    metrics = {
        "response_length/mean": float(lengths.mean()),
        "response/truncated_frac": float(out[K.TRUNCATED].float().mean()),
    }
    sums = {"rollout/num_tokens": float(response_mask.sum())}
    if updates is not None:
        sums.update({"rollout/partial_continued": float(updates.continued),
                     "rollout/partial_resumed": float(updates.resumed),
                     "rollout/weight_loads_in_flight": float(len(versions) - 1)})
    return out, {"metrics": metrics, "sums": sums}


def _weight_updates(ctx: WorkerContext, model: str, versions: list[int]) -> WeightUpdates | None:
    """Partial rollouts of a standalone rollout: the weights staged while it generates."""
    mode = ctx.spec.trainer.async_.partial_rollout
    if mode == "off" or model not in ctx.graph.rollout_pools:
        return None
    return ctx.staged.updates(model, mode, versions)
