"""``multi_turn_generate``: episodes of model turns and environment steps
(``hybridflow.envs.rollout``); the environment's rewards are the scores."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.data.batch import repeat_interleave_td
from hybridflow.engines.base import SamplingParams
from hybridflow.graph.dag import Node
from hybridflow.workers.context import WorkerContext
from hybridflow.workers.ops.samples import logged_samples


def generate_multi_turn(ctx: WorkerContext, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    from hybridflow.envs.base import env_factory
    from hybridflow.envs.rollout import (
        TurnLimits, env_rows, episode_fields, episode_metrics, make_episodes, run_episodes, unpadded,
    )

    opts = node.spec.options  # MultiTurnOptions
    rollout = ctx.spec.models[node.model].rollout
    params = SamplingParams(
        temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k, greedy=opts.greedy
    )
    batch = repeat_interleave_td(batch, 1 if opts.greedy else rollout.n)
    make_env = env_factory(opts.env, opts.env_kwargs)
    ctx.staged.load(node.model, ctx.rollout_engines[node.model])  # partial rollouts: loaded whole, before
    engine, tok = ctx.rollout_engines[node.model], ctx.tokenizer
    episodes = make_episodes(unpadded(batch[K.PROMPT_IDS], batch[K.PROMPT_MASK]), env_rows(batch), make_env, tok)
    stop = episodes[0].env.stop_strings() if episodes else []
    width = ctx.spec.data.max_response_length
    run_episodes(
        episodes,
        lambda contexts, budgets: engine.generate_turns(contexts, budgets, params, stop),
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        lambda text: tok.encode(text, add_special_tokens=False),
        TurnLimits(opts.max_turns, width, tok.eos_token_id, opts.step_timeout_s),
        overlap=opts.overlap,
        num_env_workers=opts.num_env_workers,
    )
    batch.update(episode_fields(episodes, batch[K.PROMPT_IDS], batch[K.PROMPT_MASK], width, tok.pad_token_id))
    batch[K.WEIGHT_VERSION] = torch.full((batch.batch_size[0],), ctx.rollout_versions[node.model], dtype=torch.int64)
    batch[K.WEIGHT_VERSION_LAST] = batch[K.WEIGHT_VERSION].clone()
    lengths = batch[K.RESPONSE_MASK].sum(-1).float()
    scores = batch[K.SCORES]
    metrics = {
        **episode_metrics(episodes),
        "response_length/mean": float(lengths.mean()),
        "reward/mean": float(scores.mean()),
        "reward/sq_mean": float((scores**2).mean()),
    }
    sums = {
        "rollout/num_tokens": float(batch[K.RESPONSE_MASK].sum()),
        "tool/errors": float(sum(e.tool_errors for e in episodes)),
    }
    samples = logged_samples(ctx, batch, scores, "reward", observations=True)
    return batch, {"metrics": metrics, "sums": sums, "samples": samples}
