"""The worker host: one process per device, holding every model placed on its pool.

Colocated models (e.g. actor + ref + a rule reward) share this process and its gloo group. The
host builds the engines of its models and runs op bodies: the controller runs a node with
``run_op(batch, node=name)``, and the node's op record (``hybridflow.graph.ops``) names its
body, ``body(ctx, batch, node) -> (TensorDict, meta)``, with ``ctx`` this process's
``WorkerContext`` (``hybridflow.workers.context``). The graph file's plugins are imported
when the graph arrives, before anything else (``Graph.__reduce_ex__``), so a user's op runs
here as a built-in one does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from tensordict import TensorDict

from hybridflow.engines.base import ROLLOUT_ENGINES, TRAIN_ENGINES, RolloutEngine, TrainEngine
from hybridflow.engines.lora import BaseModelEngine
from hybridflow.engines.models import build_causal_lm, build_value_model
from hybridflow.graph.dag import Graph
from hybridflow.hybrid_engine import publish, verify
from hybridflow.hybrid_engine.sync import WeightSync, weight_sync
from hybridflow.rewards.remote import RewardSources
from hybridflow.spec.graph import Spec
from hybridflow.spec.layout import GenerationLayout, ParallelLayout, RankCoords
from hybridflow.workers import algo_steps, checkpointing, recording
from hybridflow.workers.base import Worker
from hybridflow.workers.colocation import Colocation
from hybridflow.workers.context import WorkerContext, trained_uids
from hybridflow.workers.protocols import Dispatch, register

VALUE_ROLES = ("critic", "reward", "cost")  # a scalar head per token instead of an LM head


class ModelWorker(Worker):
    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        threads: int,
        *,
        graph: Graph,
        models: list[str],
        tokenizer_dir: str,
        total_steps: int,
        rollouts: list[str] = (),
    ) -> None:
        super().__init__(rank, world_size, master_addr, master_port, threads)
        from transformers import AutoTokenizer

        self.graph = graph
        self.spec = graph_spec = graph.spec
        # What builds this host's engines again outside a run (``hybridflow replay``).
        self.host_args = {"models": list(models), "rollouts": list(rollouts), "total_steps": total_steps}
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        seed = graph_spec.trainer.seed
        self.train_engines: dict[str, TrainEngine] = {}
        self.rollout_engines: dict[str, RolloutEngine] = {}
        self.weight_syncs: dict[str, WeightSync] = {}
        self.rules: dict[str, RewardSources] = {}
        data = graph_spec.data
        served = {name: graph.base_of(name) for name in models}  # ref -> LoRA actor, or None
        for name in models:
            model_spec = graph_spec.models[name]
            if model_spec.source.is_scorer:
                self.rules[name] = RewardSources(model_spec.source)
                continue
            if served[name] is not None:  # built below, from the actor's engine
                continue
            value_head = model_spec.role in VALUE_ROLES and graph.judge_node(name) is None  # a judge is an LM
            build = build_value_model if value_head else build_causal_lm
            module = build(
                model_spec.source,
                vocab_size=len(self.tokenizer),
                pad_id=self.tokenizer.pad_token_id,
                eos_id=self.tokenizer.eos_token_id,
                seed=seed,
                dtype=model_spec.train.dtype,
            )
            engine_spec = model_spec.train.model_copy(update={"layout": graph.layouts[name]})
            engine = TRAIN_ENGINES.get(engine_spec.engine).build(
                module, engine_spec, kind="value" if value_head else "policy", total_steps=total_steps, seed=seed
            )
            self.train_engines[name] = engine
            rollout = model_spec.rollout
            if rollout is not None and name not in graph.rollout_pools:
                # vLLM starts with LoRA only when it will take adapters, not merged weights
                adapter = None if rollout.merges_lora else engine.adapter_config()
                self.rollout_engines[name] = self._build_rollout(name, engine.rollout_module(module), adapter)
                self.weight_syncs[name] = weight_sync(engine, rollout)  # collective when resharded
        for name in rollouts:  # a standalone rollout (rollout.pool): its weights come by publish_weights
            model_spec = graph_spec.models[name]
            module = build_causal_lm(
                model_spec.source, vocab_size=len(self.tokenizer), pad_id=self.tokenizer.pad_token_id,
                eos_id=self.tokenizer.eos_token_id, seed=seed, dtype=model_spec.train.dtype,
            )
            self.rollout_engines[name] = self._build_rollout(name, module.eval().requires_grad_(False), None)
        for name, actor in served.items():
            if actor is not None:  # the reference policy: the LoRA actor with adapters disabled
                self.train_engines[name] = BaseModelEngine(self.train_engines[actor])
        # Different ranks must sample differently; the same rank the same way every run.
        torch.manual_seed(seed * 1000 + rank)
        self.colocation = Colocation(self.train_engines, self.rollout_engines)  # run_op activates the node's model
        self.ctx = WorkerContext(
            rank=rank,
            world_size=world_size,
            graph=graph,
            tokenizer=self.tokenizer,
            train_engines=self.train_engines,
            rollout_engines=self.rollout_engines,
            weight_syncs=self.weight_syncs,
            rules=self.rules,
            extra_state=algo_steps.build_controllers(graph_spec, models),
        )
        # A standalone rollout's train engine is on another pool: its versions are counted there.
        trained_here = [m for m in self.train_engines if m in self.rollout_engines or m in graph.rollout_pools]
        self.ctx.train_versions.update(dict.fromkeys(trained_here, 0))
        self.ctx.rollout_versions.update(dict.fromkeys(self.rollout_engines, 0))

    def _build_rollout(self, name: str, module: torch.nn.Module, adapter_config) -> RolloutEngine:
        rollout = self.spec.models[name].rollout
        max_model_len, shared_prefix_len, max_num_seqs = self.graph.rollout_sizes(name)
        return ROLLOUT_ENGINES.get(rollout.engine).build(
            module,
            self.tokenizer,
            max_model_len=max_model_len,
            shared_prefix_len=shared_prefix_len,
            max_num_seqs=max_num_seqs,
            temperature=rollout.temperature,
            adapter_config=adapter_config,
            enforce_eager=rollout.enforce_eager,
            **_generation_tp(self.graph.layouts[name], rollout.layout.tp, self.rank, self.spec.trainer.seed),
        )

    @register(Dispatch.DP_3D)
    def run_op(
        self, batch: TensorDict, *, node: str, coords: RankCoords, options: Spec | None = None,
        record: str | None = None,
    ) -> tuple[TensorDict, dict]:
        """Run graph node ``node`` on this rank's part of its batch, through the body its op
        record names. The batch is this rank's data-parallel chunk under the node's layout
        (``Graph.dispatch_layout``; ``coords``: where this rank sits in it), the same on every
        tensor/pipeline peer. ``options``: this call's options when they differ from the
        node's in the graph (validation generates greedily). ``record``: a directory to record
        this call in, for ``hybridflow replay`` (``workers.recording``)."""
        resolved = self.graph.node(node)
        if options is not None:
            resolved = replace(resolved, spec=resolved.spec.model_copy(update={"options": options}))
        op = self.graph.op(resolved)
        # the idle models' state goes to CPU memory, rollout engines too unless the op generates
        moves = self.colocation.activate(resolved.model, generates=op.runs_rollout_engine)
        body = op.load_body(resolved.role)
        out, meta = recording.call(body, self.ctx, resolved, batch, record, self.host_args)
        return out, {**meta, **trained_uids(op, batch), **moves}

    @register(Dispatch.ONE_TO_ALL)
    def save_hf(self, *, model: str, path: str) -> None:
        self.colocation.activate(model)
        self.train_engines[model].save_hf(path)

    @register(Dispatch.ONE_TO_ALL)
    def save_scalar(self, *, model: str, path: str) -> None:
        """Save a reward/cost model as a plain HF scalar model (``engines.scalar_model``; LoRA
        merged), with the run's tokenizer: rank 0 of its data-parallel group writes it."""
        from hybridflow.engines.scalar_model import save_scalar_model

        self.colocation.activate(model)
        engine = self.train_engines[model]
        if getattr(engine, "dp_rank", 0) == 0:
            module = getattr(engine, "peft", None) or engine.module
            save_scalar_model(module, path, self.ctx.tokenizer, role=self.spec.models[model].role)

    # -- checkpoints ----------------------------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, *, path: str, pool: str) -> None:
        """Write this rank's part of checkpoint ``path`` (``workers/checkpointing.py``): the
        trained engines, layout-free, and this rank's RNG and extra state. Refuses
        (NonFiniteWeightError) if any trained weight is not finite. Frozen models (ref, reward
        models) are rebuilt from their source, not saved."""
        engines = self.ctx.trained_engines()
        checkpointing.refuse_nonfinite(engines, self.rank)
        checkpointing.save(path, pool, self.rank, engines, self.ctx.extra_state)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, *, path: str, pool: str, same_ranks: bool, iteration: int) -> None:
        """Load checkpoint ``path``, saved under any layout; ``same_ranks``: its pool ``pool``
        had this pool's number of ranks (then each rank takes back its own RNG stream)."""
        checkpointing.load_engines(path, self.ctx.trained_engines())
        for name in self.ctx.train_versions:  # one actor update per iteration
            self.ctx.train_versions[name] = iteration
        for name in self.rollout_engines:  # a rollout engine with its own copy: the loaded weights
            if name in self.train_engines:  # a standalone one gets them by publish_weights
                self.ctx.sync_rollout(name)
        checkpointing.load_rank_state(
            path, pool, self.rank, self.ctx.extra_state, same_ranks, self.spec.trainer.seed, iteration
        )

    def shutdown(self) -> None:
        """Stop the score processes first: the actor's SIGTERM would otherwise land in their
        finaliser and print tracebacks at the end of every run."""
        for sources in self.rules.values():
            sources.close()
        for engine in self.rollout_engines.values():
            engine.close()
        super().shutdown()

    # -- a standalone rollout's weights (rollout.pool; hybridflow.hybrid_engine.publish) -------

    @register(Dispatch.ONE_TO_ALL)
    def publish_weights(self, *, model: str, bucket_mb: float) -> dict | None:
        """Rank 0 publishes ``model``'s current weights (every data-parallel rank holds or
        gathers the same full weights); the other ranks return None."""
        engine = self.train_engines[model]
        probe = None
        if self.spec.models[model].rollout.verify_sync == "every":  # collective when sharded
            probe = verify.trainer_probe(engine, self.tokenizer)
        if self.rank != 0:
            for _ in engine.named_weights():  # a sharded engine gathers: every rank
                pass
            return None
        return publish.publish(engine, self.ctx.train_versions[model], bucket_mb, probe)

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, *, model: str, published: list) -> dict[str, float]:
        """Load (or, with partial rollouts, stage) the weights of one ``publish_weights``."""
        partial = self.spec.trainer.async_.partial_rollout != "off"
        check = verify.rollout_pool_check(model, self.spec.models[model], self.tokenizer)
        return publish.receive(model, published, self.rollout_engines[model], self.ctx.staged, partial, check)


def _generation_tp(train: ParallelLayout, tp: int, rank: int, seed: int) -> dict[str, Any]:
    """The rollout engine's seed, and at generation tp > 1 its TP group: every rank of a
    generation TP group (``hybrid_engine.groups``) builds it with the same seed, its replica's."""
    if tp == 1:
        return {"seed": seed * 1000 + rank}
    from hybridflow.hybrid_engine.groups import gen_replica, generation_tp_groups

    gen = GenerationLayout(train=train, tp=tp)
    group = next(g for g in generation_tp_groups(gen) if rank in g)
    return {"seed": seed * 1000 + gen_replica(gen, rank), "tp_ranks": group}

