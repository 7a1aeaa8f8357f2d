"""``hybridflow eval``: greedy accuracy and pass@k of an actor on a graph's validation split.

    hybridflow eval GRAPH [key.path=value ...] [--actor DIR] [--k K] [--samples N]
                          [--limit N] [--json FILE] [--engine NAME]

The actor is the graph's base actor (its ``source``), or ``--actor DIR``: a saved actor (the
``actor/`` directory a run writes, or any HF directory), a run directory (its ``actor/``, or
its newest checkpoint when it has none), or a checkpoint directory
(``RUN_DIR/checkpoints/iter_N``: the trained actor's weights, saved by either train engine under
any layout, on top of the graph's actor). A LoRA actor (saved adapters, or a checkpoint of a
graph with ``train.lora``) is merged into the graph's actor source first.
The prompts are the validation split of the graph's data (the built-in task's test prompts, or
every row of ``data.val_files``; ``data.val_files=FILE`` as an override scores any file), in
the graph's chat rendering. Each prompt gets one greedy response and ``--samples`` sampled ones
(the actor's rollout temperature, top-p, top-k; ``--samples 0``: the greedy response only,
half the generation, no pass@k); every response is scored by the graph's reward (the model
of its first score node with a rule or ``compute_score`` source, with that node's options: on a
learned-reward graph, the rule it logs), in the same process, without Ray. A response is
correct when its score is at least ``--threshold`` (default 1.0). The score node's ending rule
(``options.unfinished``) is a training signal and is not applied: a truncated response whose
answer is right counts as right; ``truncated_frac`` reports them.

- ``greedy_accuracy``: correct greedy responses / prompts;
- ``pass@k``: the unbiased estimate ``1 - C(n - c, k) / C(n, k)`` averaged over prompts, with
  ``n`` samples of which ``c`` are correct (Chen et al. 2021), for every k up to ``--k``
  printed as 1 and ``--k``;
- ``mean_score`` (greedy), ``response_length`` and ``truncated_frac`` (greedy).

Printed as a table; ``--json FILE`` writes the same numbers (and per-prompt results) as JSON.
``--pairs-out FILE`` also writes preference pairs (JSONL, ``{prompt, chosen, rejected}``, the
rows ``graphs/reward_model.yaml`` trains on) from each prompt's sampled responses ranked by
the graph's scorer: repeated responses once, best against worst inward, ties dropped.

On a graph that trains a scalar model on pairs (``graphs/reward_model.yaml``), eval scores the
held-out pairs instead: ``pairwise_accuracy`` of the graph's model, or of ``--actor`` (a saved
scalar model, or the run directory holding it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from pathlib import Path

from hybridflow.spec.engines import engine_names, engine_record
from hybridflow.spec.graph import RolloutSpec

THRESHOLD = 1.0
# A saved actor: an HF model directory, or a LoRA actor's adapters (peft's files).
SAVED_ACTOR_FILES = ("config.json", "adapter_config.json")


def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="greedy accuracy and pass@k of an actor on the validation split")
    ev.add_argument("graph", help="graph YAML file")
    ev.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.val_files=test.parquet")
    ev.add_argument("--actor", help="saved actor directory or run directory (default: the graph's actor source)")
    ev.add_argument("--k", type=int, default=8, help="pass@k's k (default 8)")
    ev.add_argument("--samples", type=int, help="sampled responses per prompt, >= k (default k); "
                    "0: greedy responses only, no pass@k")
    ev.add_argument("--limit", type=int, help="score only the first N prompts")
    ev.add_argument("--threshold", type=float, default=THRESHOLD, help="score that counts as correct")
    ev.add_argument("--engine", choices=engine_names("rollout"), help="rollout engine (default: the actor's)")
    ev.add_argument("--json", dest="json_out", help="also write the results as JSON here")
    ev.add_argument("--pairs-out", help="write preference pairs {prompt, chosen, rejected} (JSONL) from each "
                    "prompt's sampled responses ranked by the graph's scorer, ties dropped")
    ev.set_defaults(func=cmd_eval)


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``1 - C(n - c, k) / C(n, k)``."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def _actor_weights(actor: str, model: str) -> tuple[Path | None, Path | None]:
    """``(HF directory, None)`` of a saved actor, or ``(None, checkpoint directory)`` of a run
    checkpoint that holds ``model``'s trained weights."""
    from hybridflow.controller.checkpoint import META, latest_intact_checkpoint
    from hybridflow.spec.loading import SpecError
    from hybridflow.workers.checkpointing import MODELS

    path = Path(actor)
    if any((path / "actor" / name).is_file() for name in SAVED_ACTOR_FILES):  # a run directory
        path = path / "actor"
    if any((path / name).is_file() for name in SAVED_ACTOR_FILES):
        return path, None
    checkpoint = latest_intact_checkpoint(path) if (path / "checkpoints").is_dir() else path
    if checkpoint is None or not (checkpoint / META).is_file():
        raise SpecError(actor, "--actor", "expected a saved actor (HF directory with config.json), a run "
                        "directory or a checkpoint directory")
    if not (checkpoint / MODELS / model).is_dir():
        raise SpecError(actor, "--actor", f"no trained weights of model {model!r} in {checkpoint} (a "
                        "checkpoint from an older hybridflow, or a run that does not train it)")
    return None, checkpoint


def cmd_eval(args: argparse.Namespace) -> int:
    from hybridflow.graph.dag import load_graph
    from hybridflow.spec.loading import SpecError

    samples = args.k if args.samples is None else args.samples
    if samples == 0 and args.pairs_out:
        raise SpecError(args.graph, "--samples", "--pairs-out ranks sampled responses: give --samples >= 2")
    if args.k < 1 or 0 < samples < args.k or samples < 0:
        raise SpecError(args.graph, "--k", f"expected 1 <= k <= samples (or samples 0), got k={args.k}, "
                        f"samples={samples}")
    if load_graph(args.graph, args.overrides).reads_pairs:
        results = evaluate_pairs(args.graph, args.overrides, args.actor, args.limit)
    else:
        results = evaluate(args.graph, args.overrides, args.actor, args.k, samples, args.limit,
                           args.threshold, args.engine, args.pairs_out)
    print(format_table(results))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json_out}")
    return 0


def format_table(results: dict) -> str:
    summary = results["summary"]
    rows = [(key, f"{value:.4f}" if isinstance(value, float) else str(value)) for key, value in summary.items()]
    width = max(len(k) for k, _ in rows)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  -----"]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def evaluate(
    graph_file: str,
    overrides: list[str],
    actor: str | None,
    k: int,
    samples: int,
    limit: int | None,
    threshold: float = THRESHOLD,
    engine: str | None = None,
    pairs_out: str | None = None,
) -> dict:
    """The eval's numbers (module docstring) as a dict: ``summary`` and per-prompt ``prompts``."""
    import torch

    from hybridflow.controller.preflight import check_model_paths, run_tokenizer
    from hybridflow.data.datasets import DataError, collate_prompts, load_data
    from hybridflow.graph.dag import load_graph
    from hybridflow.rewards.ending import scorer_options
    from hybridflow.rewards.remote import RewardSources, row_fields
    from hybridflow.spec.loading import SpecError

    graph = load_graph(graph_file, overrides)
    spec = graph.spec
    actor_name = graph.actor
    actor_spec = spec.models[actor_name]
    score_nodes = [n for n in graph.nodes if graph.op(n).scores]
    if not score_nodes:
        raise SpecError(graph.file, "nodes", "eval needs a score node to grade responses")
    # Graded by a rule: on a learned-reward graph, the rule it logs beside the learned model.
    score_node = next((n for n in score_nodes if spec.models[n.model].source.is_scorer), None)
    if score_node is None:
        raise SpecError(graph.file, f"models.{score_nodes[0].model}.source",
                        "eval grades with a rule or compute_score reward; the graph has none")
    reward_spec = spec.models[score_node.model]
    check_model_paths(graph, [actor_name, score_node.model])  # not a learned reward it does not use
    tokenizer = run_tokenizer(graph)
    try:
        _, rows = load_data(spec.data, graph.file, all_val_files=True)
    except DataError as exc:
        raise SpecError(graph.file, exc.field, str(exc)) from None
    rows = rows[:limit] if limit else rows
    if not rows:
        raise SpecError(graph.file, "data.num_val", "no validation prompts to evaluate")
    try:
        prompts = collate_prompts(rows, tokenizer, spec.data.max_prompt_length,
                                  system_prompt=spec.data.system_prompt)
    except DataError as exc:
        raise SpecError(graph.file, exc.field, str(exc)) from None

    torch.set_num_threads(os.cpu_count() or 1)
    source, checkpoint, adapters = actor_spec.source, None, None
    if actor is not None:
        directory, checkpoint = _actor_weights(actor, actor_name)
        if directory is not None and (directory / "adapter_config.json").is_file():
            adapters = directory  # merged into the graph's actor source
        elif directory is not None:
            source = source.model_copy(update={"config": None, "path": str(directory), "gguf": None, "package": None})
    rollout = actor_spec.rollout
    engine = engine or (rollout.engine if rollout is not None else RolloutSpec.model_fields["engine"].default)
    temperature = rollout.temperature if rollout else 1.0
    if engine_record("rollout", engine).caps.standalone is None:
        raise SpecError(graph.file, "--engine", f"rollout engine {engine!r} generates only inside a worker")
    trained = None if checkpoint is None else (checkpoint, actor_name)
    generate = _generator(engine, source, tokenizer, spec, temperature, trained, adapters,
                          actor_spec.train.adapters)

    from hybridflow.engines.base import SamplingParams

    max_new = spec.data.max_response_length
    then = f", then {samples} samples each at temperature {temperature:g}" if samples else " only"
    print(f"eval: {len(rows)} prompts, greedy{then} ({engine})", file=sys.stderr)
    greedy = generate(prompts, SamplingParams(n=1, max_new_tokens=max_new, greedy=True))
    sampled = generate(prompts, SamplingParams(
        n=samples, temperature=temperature,
        top_p=rollout.top_p if rollout else 1.0, top_k=rollout.top_k if rollout else 0,
        max_new_tokens=max_new,
    )) if samples else None

    scorer = RewardSources(reward_spec.source)
    options = scorer_options(score_node.spec.options)
    try:
        greedy_scores, greedy_texts = _score(scorer, greedy, tokenizer, options, row_fields)
        if sampled is not None:
            sample_scores, sample_texts = _score(scorer, sampled, tokenizer, options, row_fields)
    finally:
        scorer.close()

    from hybridflow.data import keys as K

    num = len(rows)
    correct = (greedy_scores >= threshold).tolist()
    sample_correct = (sample_scores >= threshold).view(num, samples).sum(-1).tolist() if samples else [None] * num
    lengths = greedy[K.RESPONSE_MASK].sum(-1).float()
    summary = {"prompts": num, "greedy_accuracy": sum(correct) / num, "greedy_mean_score": float(greedy_scores.mean())}
    if samples:
        summary["pass@1"] = sum(pass_at_k(samples, c, 1) for c in sample_correct) / num
        summary[f"pass@{k}"] = sum(pass_at_k(samples, c, k) for c in sample_correct) / num
    summary.update(samples_per_prompt=samples, response_length=float(lengths.mean()),
                   truncated_frac=float(greedy[K.TRUNCATED].float().mean()))
    if pairs_out is not None:
        summary["pairs_written"] = _write_pairs(pairs_out, rows, sample_texts, sample_scores.tolist(), samples)
    per_prompt = [
        {"origin": row["origin"], "ground_truth": row["ground_truth"], "greedy": text,
         "greedy_score": float(score), "samples_correct": c}
        for row, text, score, c in zip(rows, greedy_texts, greedy_scores.tolist(), sample_correct)
    ]
    return {
        "graph": str(graph_file),
        "overrides": list(overrides),
        "actor": str(actor) if actor else "base",
        "engine": engine,
        "summary": summary,
        "prompts": per_prompt,
    }


def evaluate_pairs(graph_file: str, overrides: list[str], model: str | None, limit: int | None) -> dict:
    """A graph that trains a scalar model on pairs: ``pairwise_accuracy`` (chosen scored above
    rejected) of its model on every held-out pair, with the pairs' mean scores. ``model``: a
    saved scalar model directory or the run directory holding one (``RUN_DIR/<model>``);
    default the graph's source."""
    import torch

    from hybridflow.algos.preference import pairwise_metrics
    from hybridflow.controller.preflight import check_model_paths, run_tokenizer
    from hybridflow.data.datasets import DataError
    from hybridflow.data.preferences import collate_pairs, load_pair_data, pair_forward_batch, split_pair_scores
    from hybridflow.engines.models import build_value_model
    from hybridflow.graph.dag import load_graph
    from hybridflow.spec.loading import SpecError

    graph = load_graph(graph_file, overrides)
    spec = graph.spec
    node = next(n for n in graph.nodes if "pairs" in n.inputs)
    name, model_spec = node.model, spec.models[node.model]
    check_model_paths(graph)
    tokenizer = run_tokenizer(graph)
    kind = "cost" if model_spec.role == "cost" else "reward"
    data = spec.data.model_copy(update={"num_val": 10**9})  # every held-out pair
    try:
        _, rows = load_pair_data(data, graph.file, kind)
        rows = rows[:limit] if limit else rows
        if not rows:
            raise SpecError(graph.file, "data.val_files", "no held-out pairs to evaluate")
        pairs = collate_pairs(rows, tokenizer, spec.data.max_prompt_length, spec.data.max_response_length,
                              system_prompt=spec.data.system_prompt)
    except DataError as exc:
        raise SpecError(graph.file, exc.field, str(exc)) from None
    source = model_spec.source
    if model is not None:
        directory = Path(model) / name if (Path(model) / name / "config.json").is_file() else Path(model)
        if not (directory / "config.json").is_file():
            raise SpecError(model, "--actor", f"expected a saved scalar model (HF directory with config.json) or a "
                            f"run directory holding {name}/")
        source = source.model_copy(update={"config": None, "path": str(directory.resolve()), "gguf": None,
                                           "package": None})
    torch.set_num_threads(os.cpu_count() or 1)
    module = build_value_model(source, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id,
                               seed=spec.trainer.seed).eval()
    with torch.no_grad():
        scores = torch.cat([last_token_scores(module, pair_forward_batch(chunk)) for chunk in pairs.split(64)])
    chosen, rejected = split_pair_scores(scores)
    metrics = pairwise_metrics(chosen, rejected)
    summary = {"pairs": len(rows), "pairwise_accuracy": metrics["rm/accuracy"],
               "margin_mean": metrics["rm/margin_mean"], "chosen_mean": metrics["rm/chosen_mean"],
               "rejected_mean": metrics["rm/rejected_mean"]}
    return {"graph": str(graph_file), "overrides": list(overrides), "model": str(model) if model else "base",
            "summary": summary}


def last_token_scores(module, samples) -> "torch.Tensor":
    """(N,) a scalar model's output at each sample's last response token, as the score op reads
    it (``samples``: rollout-shaped, left-padded prompts, right-padded responses)."""
    from hybridflow.data import keys as K

    out = module(input_ids=samples[K.INPUT_IDS], attention_mask=samples[K.ATTENTION_MASK],
                 position_ids=samples[K.POSITION_IDS]).logits[..., 0].float()
    last = samples[K.PROMPT_IDS].shape[1] + samples[K.RESPONSE_MASK].sum(-1) - 1
    return out.gather(1, last[:, None])[:, 0]


def _write_pairs(path: str, rows: list[dict], texts: list[str], scores: list[float], samples: int) -> int:
    """``pairs_from_samples`` of each prompt's ``samples`` responses, as JSONL at ``path``;
    returns the number of pairs."""
    from hybridflow.data.preference_pairs import pairs_from_samples

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with out.open("w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            span = slice(i * samples, (i + 1) * samples)
            for pair in pairs_from_samples(row["prompt"], texts[span], scores[span]):
                f.write(json.dumps({key: pair[key] for key in ("prompt", "chosen", "rejected")}) + "\n")
                count += 1
    return count


def _score(scorer, batch, tokenizer, options, row_fields):
    from hybridflow.data import keys as K

    texts = tokenizer.batch_decode(batch[K.RESPONSES] * batch[K.RESPONSE_MASK], skip_special_tokens=True)
    result = scorer.score(
        batch.get(K.PROMPT_TEXT).tolist(), texts, batch.get(K.GROUND_TRUTH).tolist(),
        **options, **row_fields(batch),
    )
    return result.scores, texts


def _generator(engine: str, source, tokenizer, spec, temperature: float, trained: tuple[Path, str] | None = None,
               adapters: Path | None = None, lora=None):
    """``generate(prompts, params) -> batch`` on one in-process rollout engine, with a progress
    bar; ``temperature``: the sampled calls' (vLLM fixes its log-prob mode for it at start);
    ``trained``: (checkpoint, model) whose weights are loaded over the source's, whichever engine
    and layout saved them; ``adapters``: a saved LoRA actor's directory. LoRA adapters (saved, or
    a checkpoint's under the graph's ``lora``) are merged into the base before generating."""
    from hybridflow.engines.models import build_causal_lm, model_dir
    from hybridflow.workers.checkpointing import read_hf_weights

    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id

    def build():
        module = build_causal_lm(source, len(tokenizer), pad_id, eos_id, seed=spec.trainer.seed)
        if adapters is not None:
            from peft import PeftModel

            return PeftModel.from_pretrained(module, str(adapters)).merge_and_unload()
        if trained is not None:
            weights = read_hf_weights(*trained, module.config)
            if lora is None:
                module.load_state_dict(weights)
                return module
            from hybridflow.engines.lora import add_lora

            peft = add_lora(module, lora)  # the checkpoint holds the adapters only
            unexpected = module.load_state_dict(weights, strict=False).unexpected_keys
            if unexpected:
                raise ValueError(f"{trained[0]}: not adapters of the graph's lora: {unexpected[:3]}")
            return peft.merge_and_unload()
        return module

    module, _, function = engine_record("rollout", engine).caps.standalone.partition(":")
    return getattr(importlib.import_module(module), function)(
        build, tokenizer, source_dir=lambda: model_dir(source) if trained is None and adapters is None else None,
        max_model_len=spec.data.max_prompt_length + spec.data.max_response_length,
        seed=spec.trainer.seed, temperature=temperature,
    )
