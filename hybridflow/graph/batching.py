"""Batch sizes: the four settings a user chooses, the totals they imply, and their divisibility.

The settings (and nothing else) decide every batch size of an iteration:

- prompts per iteration  ``data.prompts_per_iteration``            P
- samples per prompt     ``models.<actor>.rollout.n``               n
- mini-batches per update ``nodes[<update>].options.mini_batches``  M  (optimizer steps per epoch)
- micro-batch per device ``models.<model>.train.micro_batch_size``  m  (samples per forward/backward)

Derived, for a model trained on ``dp`` data-parallel ranks: ``P * n`` samples per iteration,
``P * n / dp`` per rank, ``P * n / M`` per optimizer step (``P * n / (M * dp)`` per rank, run as
``ceil(that / m)`` micro-batches of gradient accumulation), ``M * epochs`` optimizer steps per
iteration. Validation rejects settings that do not divide: the prompts of an iteration must split
evenly over every model's DP ranks (all samples of a prompt stay on one rank), and each rank's
samples over the mini-batches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hybridflow.graph.ops import OPS
from hybridflow.spec.graph import GraphSpec, UpdateOptions
from hybridflow.spec.layout import ParallelLayout
from hybridflow.spec.loading import SpecError


@dataclass(frozen=True)
class UpdatePlan:
    node: str
    model: str
    dp: int
    mini_batches: int
    epochs: int
    micro_batch_size: int
    samples_per_rank: int
    samples_per_step: int  # one mini-batch over all ranks
    samples_per_rank_step: int
    micro_batches_per_step: int  # gradient-accumulation steps on one rank (at most, by tokens)
    micro_batch_tokens: int | None = None  # train.micro_batch_tokens: cut by a token budget

    @property
    def steps_per_iteration(self) -> int:
        return self.mini_batches * self.epochs


@dataclass(frozen=True)
class BatchPlan:
    prompts_per_iteration: int
    samples_per_prompt: int
    updates: tuple[UpdatePlan, ...]
    pairs: bool = False  # the data are preference pairs (a graph training scalar models)

    @property
    def samples_per_iteration(self) -> int:
        return self.prompts_per_iteration * self.samples_per_prompt

    def describe(self) -> str:
        """The plan in a few lines, printed at the start of a run."""
        lines = [
            f"batch: {self.prompts_per_iteration} pairs/iteration (data.prompts_per_iteration), each a "
            "chosen and a rejected response" if self.pairs else
            f"batch: {self.prompts_per_iteration} prompts/iteration (data.prompts_per_iteration) x "
            f"{self.samples_per_prompt} samples/prompt (rollout.n) = {self.samples_per_iteration} samples/iteration"
        ]
        for u in self.updates:
            micro = (
                f"{u.micro_batches_per_step} micro-batches of <= {u.micro_batch_size})"
                if u.micro_batch_tokens is None
                else f"micro-batches of <= {u.micro_batch_tokens} tokens)"
            )
            lines.append(
                f"  {u.node} ({u.model}, dp={u.dp}): {u.samples_per_rank} samples/rank; "
                f"{u.mini_batches} mini-batches x {u.epochs} epochs = {u.steps_per_iteration} optimizer "
                f"steps/iteration of {u.samples_per_step} samples ({u.samples_per_rank_step}/rank = "
                + micro
            )
        return "\n".join(lines)


def _samples_per_prompt(spec: GraphSpec) -> int:
    """``rollout.n`` of the actor; 1 for a graph without one (it trains scalar models on pairs)."""
    actor = next((name for name, m in spec.models.items() if m.role == "actor"), None)
    rollout = spec.models[actor].rollout if actor is not None else None
    return rollout.n if rollout is not None else 1


def _batch_problem(spec: GraphSpec, prompts: int, dp_of: Mapping[str, int]) -> tuple[str, str] | None:
    """``(field, message)`` of the first batch size that does not divide over the data-parallel
    ranks ``dp_of`` (model -> dp) at ``prompts`` prompts per iteration; None when all divide."""
    n = _samples_per_prompt(spec)
    for model in dict.fromkeys(node.model for node in spec.nodes):
        dp = dp_of[model]
        if prompts % dp:
            return "data.prompts_per_iteration", (
                f"{prompts} prompts do not split evenly over the {dp} data-parallel ranks of model "
                f"{model!r}; use a multiple of {dp}"
            )
    for i, node in enumerate(spec.nodes):
        if not isinstance(node.options, UpdateOptions):  # its mini-batches split the batch
            continue
        dp = dp_of[node.model]
        per_rank = prompts * n // dp
        if per_rank % node.options.mini_batches:
            return f"nodes[{i}].options.mini_batches", (
                f"node {node.name!r}: {node.options.mini_batches} mini-batches do not divide the "
                f"{per_rank} samples per rank ({prompts} prompts x {n} samples / {dp} ranks)"
            )
    return None


def smallest_even_batch(spec: GraphSpec, dp_of: Mapping[str, int]) -> int:
    """The fewest prompts per iteration, no fewer than the graph's, that split evenly over the
    data-parallel ranks ``dp_of`` (model -> dp) as ``batch_plan`` requires."""
    step = math.lcm(*(dp_of[node.model] for node in spec.nodes))
    prompts = -(-spec.data.prompts_per_iteration // step) * step
    # Terminates: step * (the lcm of the mini-batch counts) always divides.
    while _batch_problem(spec, prompts, dp_of) is not None:
        prompts += step
    return prompts


def batch_plan(spec: GraphSpec, layouts: dict[str, ParallelLayout], file: str) -> BatchPlan:
    """Derive the batch plan and check it divides; ``SpecError`` naming the field otherwise."""
    prompts = spec.data.prompts_per_iteration
    problem = _batch_problem(spec, prompts, {m: layout.dp for m, layout in layouts.items()})
    if problem is not None:
        raise SpecError(file, *problem)
    n = _samples_per_prompt(spec)
    updates = []
    for node in spec.nodes:
        if not isinstance(node.options, UpdateOptions):
            continue
        dp = layouts[node.model].dp
        mini_batches = node.options.mini_batches
        per_rank_step = prompts * n // dp // mini_batches
        train = spec.models[node.model].train
        micro = train.micro_batch_size
        if train.token_budget is not None and getattr(node.options, "loss_agg", None) == "bnpo":
            raise SpecError(
                file, f"models.{node.model}.train.micro_batch_tokens",
                f"node {node.name!r} aggregates its loss with 'bnpo', a mean per micro-batch, which "
                "a token-budget cut would change; use micro_batch_size or another loss_agg",
            )
        updates.append(
            UpdatePlan(
                node=node.name,
                model=node.model,
                dp=dp,
                mini_batches=mini_batches,
                epochs=node.options.epochs,
                micro_batch_size=micro,
                samples_per_rank=prompts * n // dp,
                samples_per_step=per_rank_step * dp,
                samples_per_rank_step=per_rank_step,
                micro_batches_per_step=math.ceil(per_rank_step / micro),
                micro_batch_tokens=train.token_budget,
            )
        )
    return BatchPlan(prompts, n, tuple(updates), spec_reads_pairs(spec))


def spec_reads_pairs(spec: GraphSpec) -> bool:
    """Whether a node reads preference pairs (its inputs as written, else its op's defaults):
    the graph trains reward or cost models on pair files."""
    return any(
        "pairs" in (node.inputs if node.inputs is not None else OPS[node.op].default_inputs(
            spec.models[node.model].role if node.model in spec.models else "*"))
        for node in spec.nodes if node.op in OPS
    )
