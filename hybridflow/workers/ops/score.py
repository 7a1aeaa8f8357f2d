"""``score``: sequence scores of the responses from a rule / compute_score / remote scorer, or
from a learned reward (cost) model's last value, optionally normalised or squashed; then the
ending rule and overlong penalty."""

from __future__ import annotations

from tensordict import TensorDict

from hybridflow.algos.preference import squash_scores
from hybridflow.data import keys as K
from hybridflow.data.batch import place_sequence_reward
from hybridflow.data.preferences import responses_as_text_tokens
from hybridflow.graph.dag import Node
from hybridflow.rewards.ending import apply_ending_rule, scorer_options
from hybridflow.rewards.overlong import overlong_penalty
from hybridflow.rewards.remote import row_fields
from hybridflow.workers.algo_steps import dp_sum
from hybridflow.workers.context import WorkerContext
from hybridflow.workers.ops.samples import logged_samples


def score(ctx: WorkerContext, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    model = node.model
    output_key = node.outputs[0] if node.outputs else None  # None: the node only logs
    spec = ctx.spec
    # "reward" / "cost"; a second score of the same model (ReMax's baseline) by its key
    role = spec.models[model].role
    opts = node.spec.options  # ScoreOptions
    if output_key is None:
        prefix = f"{opts.log_prefix or node.name}/{role}"
    else:
        prefix = role if output_key in (K.SCORES, K.COSTS) else output_key
    fields, metrics, sums = {}, {}, {}
    if model in ctx.rules:
        responses = ctx.tokenizer.batch_decode(
            batch[K.RESPONSES] * batch[K.RESPONSE_MASK], skip_special_tokens=True
        )
        scored = ctx.rules[model].score(
            batch.get(K.PROMPT_TEXT).tolist(),
            responses,
            batch.get(K.GROUND_TRUTH).tolist(),
            **scorer_options(opts),
            **row_fields(batch),
        )
        for name, values in scored.extras.items():  # other keys of compute_score dicts
            metrics[f"{prefix}/{name}/mean"] = float(values.mean())
        scores = scored.scores
        for name, values in scored.components.items():
            fields[f"{output_key}/{name}"] = values  # e.g. scores/<component>
            metrics[f"{prefix}/{name}/mean"] = float(values.mean())
        sums = {f"{prefix}/num_errors": float(scored.num_errors)}
        if spec.models[model].source.remote is not None:
            sums[f"{prefix}/num_retries"] = float(scored.num_retries)
    else:
        read = responses_as_text_tokens(batch, ctx.tokenizer) if opts.read == "text" else batch
        scores = ctx.train_engines[model].forward(read)["last_values"]
        moments = ctx.extra_state.get(f"score_moments/{node.name}")
        if moments is not None:  # options.normalize
            metrics[f"{prefix}/raw_mean"] = float(scores.mean())
            moments.update(scores, dp_sum(ctx.dp_group(model)))
            scores = moments.normalize(scores)
    if opts.squash is not None:  # e.g. a cost model's cost -> P(unsafe)
        metrics[f"{prefix}/raw_mean"] = float(scores.mean())
        scores = squash_scores(scores, opts.squash)
    scores, unfinished = apply_ending_rule(scores, batch, ctx.tokenizer, opts, role)
    metrics[f"{prefix}/unfinished_frac"] = float(unfinished.float().mean())
    if opts.overlong_buffer is not None:
        lengths = batch[K.RESPONSE_MASK].sum(-1)
        penalty = overlong_penalty(lengths, spec.data.max_response_length, opts.overlong_buffer, opts.overlong_penalty)
        scores = scores - penalty
        metrics[f"{prefix}/overlong_penalty/mean"] = float(penalty.mean())
    if output_key is None:
        result = TensorDict({}, batch_size=batch.batch_size)
        metrics[f"{prefix}_mean"] = float(scores.mean())  # e.g. rule/reward_mean
    else:
        result = TensorDict(
            {output_key: scores, K.TOKEN_REWARDS: place_sequence_reward(scores, batch[K.RESPONSE_MASK]), **fields},
            batch_size=batch.batch_size,
        )
    metrics.update({f"{prefix}/mean": float(scores.mean()), f"{prefix}/sq_mean": float((scores**2).mean())})
    return result, {"metrics": metrics, "sums": sums, "samples": logged_samples(ctx, batch, scores, prefix)}
