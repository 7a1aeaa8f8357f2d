"""``judge``: sequence scores of the responses from an LLM judge's verdicts
(``hybridflow.rewards.judge``), generated with the judge model's own rollout engine; then the
ending rule on the responses, as a score node applies it."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.data.batch import place_sequence_reward
from hybridflow.data.echo import shorten
from hybridflow.engines.base import SamplingParams
from hybridflow.graph.dag import Node
from hybridflow.rewards.ending import apply_ending_rule
from hybridflow.rewards.judge import fill_template, read_verdict
from hybridflow.rewards.rule import RewardError
from hybridflow.workers.context import WorkerContext
from hybridflow.workers.ops.samples import logged_samples


def judge(ctx: WorkerContext, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
    opts = node.spec.options  # JudgeOptions
    tokenizer = ctx.tokenizer
    responses = tokenizer.batch_decode(batch[K.RESPONSES] * batch[K.RESPONSE_MASK], skip_special_tokens=True)
    texts = [
        fill_template(opts.template, prompt, response, truth)
        for prompt, response, truth in zip(batch.get(K.PROMPT_TEXT).tolist(), responses, batch.get(K.GROUND_TRUTH).tolist())
    ]
    if opts.chat:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                 for t in texts]
    prompts, num_cut = _left_padded(texts, tokenizer, opts.max_prompt_length)
    rollout = ctx.spec.models[node.model].rollout
    params = SamplingParams(
        n=1, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
        max_new_tokens=opts.max_new_tokens, greedy=opts.greedy, log_prob_samples=0,
    )
    out = ctx.rollout_engines[node.model].generate(prompts, params)
    verdict_texts = tokenizer.batch_decode(out[K.RESPONSES] * out[K.RESPONSE_MASK], skip_special_tokens=True)
    ended = (~out[K.TRUNCATED].bool()).tolist()
    verdicts = [read_verdict(text, end, opts) for text, end in zip(verdict_texts, ended)]
    failed = [(i, v.failure) for i, v in enumerate(verdicts) if v.failure is not None]
    if failed and opts.on_error == "fail":
        i, failure = failed[0]
        why = (f"did not end within max_new_tokens={opts.max_new_tokens} (a timeout)" if failure == "timeout"
               else "holds no score (a parse error)")
        raise RewardError(f"judge node {node.name!r}: sample {i}: the verdict {shorten(verdict_texts[i], 80)!r} "
                          f"{why} (or options.on_error: default)")
    scores = torch.tensor([opts.default_reward if v.score is None else v.score for v in verdicts], dtype=torch.float32)
    scores, unfinished = apply_ending_rule(scores, batch, tokenizer, opts, node.role)
    prefix = node.role if node.outputs[0] in (K.SCORES, K.COSTS) else node.outputs[0]
    metrics = {
        f"{prefix}/mean": float(scores.mean()),
        f"{prefix}/sq_mean": float((scores**2).mean()),
        f"{prefix}/unfinished_frac": float(unfinished.float().mean()),
        "judge/verdict_length/mean": float(out[K.RESPONSE_MASK].sum(-1).float().mean()),
    }
    sums = {
        "judge/parse_errors": float(sum(f == "parse_error" for _, f in failed)),
        "judge/timeouts": float(sum(f == "timeout" for _, f in failed)),
        "judge/truncated_prompts": float(num_cut),
    }
    result = {node.outputs[0]: scores}
    if node.outputs[0] == K.SCORES:
        result[K.TOKEN_REWARDS] = place_sequence_reward(scores, batch[K.RESPONSE_MASK])
    samples = logged_samples(ctx, batch, scores, prefix, extra={"verdict": verdict_texts})
    return TensorDict(result, batch_size=batch.batch_size), {"metrics": metrics, "sums": sums, "samples": samples}


def _left_padded(texts: list[str], tokenizer, max_length: int) -> tuple[TensorDict, int]:
    """The judge's prompts as a left-padded batch (``prompt_ids``, ``prompt_mask``), each cut to
    its last ``max_length`` tokens, and how many were cut."""
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    num_cut = sum(len(ids) > max_length for ids in encoded)
    encoded = [ids[-max_length:] for ids in encoded]
    width = max(len(ids) for ids in encoded)
    prompt_ids = torch.full((len(texts), width), tokenizer.pad_token_id, dtype=torch.int64)
    prompt_mask = torch.zeros((len(texts), width), dtype=torch.int64)
    for row, ids in enumerate(encoded):
        if ids:
            prompt_ids[row, width - len(ids):] = torch.tensor(ids)
            prompt_mask[row, width - len(ids):] = 1
    batch = TensorDict({K.PROMPT_IDS: prompt_ids, K.PROMPT_MASK: prompt_mask}, batch_size=[len(texts)])
    return batch, num_cut
