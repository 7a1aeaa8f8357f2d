"""The worker that runs graph ops: one process per device, holding every model placed on its pool.

Colocated models (e.g. actor + ref + a rule reward) share this process and its gloo group. The
worker holds the validated ``Graph``; the controller runs a node with ``run_op(batch, node=name)``
and the node's op record (``hybridflow.graph.ops``) names the method that is its body:
``body(self, batch, node) -> (TensorDict, meta)``. A new op's body is a method of this class or
of a subclass.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import ray
import torch
from tensordict import TensorDict

from hybridflow.algos import POLICY_LOSSES, agg_loss, informative_groups, kl_penalty, masked_mean
from hybridflow.data import keys as K
from hybridflow.data.batch import place_sequence_reward, repeat_interleave_td
from hybridflow.engines.base import (
    ROLLOUT_ENGINES, TRAIN_ENGINES, RolloutEngine, SamplingParams, TrainEngine, WeightUpdates,
)
from hybridflow.engines.lora import BaseModelEngine
from hybridflow.engines.models import build_causal_lm, build_value_model
from hybridflow.hybrid_engine.consistency import ConsistencyStats, check_consistency
from hybridflow.hybrid_engine.sync import WeightSync, weight_sync
from hybridflow.graph.dag import Graph, Node
from hybridflow.graph.ops import graph_keys
from hybridflow.rewards.ending import apply_ending_rule, scorer_options
from hybridflow.rewards.overlong import overlong_penalty
from hybridflow.rewards.remote import RewardSources, row_fields
from hybridflow.spec.graph import Spec, UpdateOptions
from hybridflow.spec.layout import GenerationLayout, ParallelLayout, RankCoords
from hybridflow.workers import algo_steps, checkpointing
from hybridflow.workers.base import Worker
from hybridflow.workers.colocation import Colocation
from hybridflow.workers.protocols import Dispatch, register

VALUE_ROLES = ("critic", "reward", "cost")  # a scalar head per token instead of an LM head


class NonFiniteWeightError(RuntimeError):
    """A trained weight became NaN/inf; such a state is never checkpointed."""


def memory_metrics() -> dict[str, float]:
    """This worker process's resident memory now and at its peak (bytes; averaged over the
    ranks in the iteration's metrics): what a pool's hosts must hold per device."""
    import resource

    import psutil

    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the kernel's high-water mark
    return {"memory/rss_bytes": float(rss), "memory/peak_rss_bytes": float(max(peak, rss))}


def _poisoned(loss_fn):
    def poisoned(mb, out):
        loss, metrics = loss_fn(mb, out)
        return loss * math.nan, metrics

    return poisoned


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
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        seed = graph_spec.trainer.seed
        self.train_engines: dict[str, TrainEngine] = {}
        self.rollout_engines: dict[str, RolloutEngine] = {}
        self.weight_syncs: dict[str, WeightSync] = {}
        self.rules = {}
        data = graph_spec.data
        served = {name: graph.base_of(name) for name in models}  # ref -> LoRA actor, or None
        for name in models:
            model_spec = graph_spec.models[name]
            if model_spec.source.is_scorer:
                self.rules[name] = RewardSources(model_spec.source)
                continue
            if served[name] is not None:  # built below, from the actor's engine
                continue
            value_head = model_spec.role in VALUE_ROLES
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
        # Checkpointed with the engines: anything with state_dict()/load_state_dict() that other
        # ops keep across iterations (a KL controller, a Lagrange multiplier) registers here.
        self.extra_state: dict[str, Any] = algo_steps.build_controllers(graph_spec, models)
        self._inject_nonfinite_updates: dict[str, int] = {}  # model -> updates to poison (tests)
        self._inject_stale_syncs: dict[str, int] = {}  # model -> weight syncs to skip (tests)
        self._inject_step_delay: dict[str, float] = {}  # model -> seconds per decoding step (tests)
        # Policy versions: actor updates applied to a model's train engine, and the one its
        # rollout engine last took (a weight sync); every generated sample is tagged with the
        # latter (``weight_version``), and an update's staleness is the difference.
        # A standalone rollout's train engine is on another pool: its versions are counted there.
        trained_here = [m for m in self.train_engines if m in self.rollout_engines or m in graph.rollout_pools]
        self.train_versions: dict[str, int] = dict.fromkeys(trained_here, 0)
        self.rollout_versions: dict[str, int] = dict.fromkeys(self.rollout_engines, 0)
        # Partial rollouts (trainer.async.partial_rollout): receive_weights runs on the actor's
        # side thread and leaves the newest weights here, {model: (version, buckets)}; the
        # generation in progress, or the next one, loads them.
        self._staged: dict[str, tuple[int, list[dict]]] = {}
        self._staged_lock = threading.Lock()

    def _build_rollout(self, name: str, module: torch.nn.Module, adapter_config) -> RolloutEngine:
        rollout, data = self.spec.models[name].rollout, self.spec.data
        max_model_len = data.max_prompt_length + data.max_response_length
        # A prompt's samples share the prompt; a multi-turn episode's turns the context before them.
        multi_turn = any(n.model == name and n.op == "multi_turn_generate" for n in self.graph.nodes)
        return ROLLOUT_ENGINES.get(rollout.engine).build(
            module,
            self.tokenizer,
            max_model_len=max_model_len,
            shared_prefix_len=max_model_len if multi_turn else data.max_prompt_length,
            # A whole iteration's samples fit in the KV cache at once (one batch per generate call).
            max_num_seqs=data.prompts_per_iteration * rollout.n,
            temperature=rollout.temperature,
            adapter_config=adapter_config,
            enforce_eager=rollout.enforce_eager,
            **_generation_tp(self.graph.layouts[name], rollout.layout.tp, self.rank, self.spec.trainer.seed),
        )

    # -- ops ----------------------------------------------------------------------------------

    @register(Dispatch.DP_3D)
    def run_op(
        self, batch: TensorDict, *, node: str, coords: RankCoords, options: Spec | None = None
    ) -> tuple[TensorDict, dict]:
        """Run graph node ``node`` on this rank's part of its batch, through the method its op
        record names. The batch is this rank's data-parallel chunk under the node's layout
        (``Graph.dispatch_layout``; ``coords``: where this rank sits in it), the same on every
        tensor/pipeline peer. ``options``: this call's options when they differ from the
        node's in the graph (validation generates greedily)."""
        resolved = self.graph.node(node)
        if options is not None:
            resolved = replace(resolved, spec=resolved.spec.model_copy(update={"options": options}))
        op = self.graph.op(resolved)
        # the idle models' state goes to CPU memory, rollout engines too unless the op generates
        moves = self.colocation.activate(resolved.model, generates=op.generates)
        out, meta = getattr(self, op.method_for(resolved.role))(batch, resolved)
        return out, {**meta, **moves}

    def _dp_group(self, model: str):
        """The ranks that split ``model``'s batches between them (a rule model's: all)."""
        return self.train_engines[model].dp_group if model in self.train_engines else None

    def _temperature(self) -> float:
        """The actor's sampling temperature: forwards score the responses under it."""
        rollout = self.spec.models[self.graph.actor].rollout
        return rollout.temperature if rollout is not None else 1.0

    def generate(self, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
        rollout = self.spec.models[node.model].rollout
        greedy = node.spec.options.greedy
        params = SamplingParams(
            n=1 if greedy else rollout.n,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=self.spec.data.max_response_length,
            greedy=greedy,
            min_new_tokens=self.spec.data.max_response_length if rollout.fixed_length and not greedy else 0,
            # A greedy generation's log-probs are dropped (its key carries no rollout_log_probs).
            log_prob_samples=0 if greedy else (
                None if self.graph.reads_rollout_log_probs(node.model) else rollout.log_prob_check_samples
            ),
        )
        self._load_staged(node.model)
        versions = [self.rollout_versions[node.model]]  # at the start, then one per load in flight
        updates = self._weight_updates(node.model, versions)
        engine = self.rollout_engines[node.model]
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

    def _weight_updates(self, model: str, versions: list[int]) -> WeightUpdates | None:
        """Partial rollouts: the staged weights, polled between decoding steps by the engine;
        each load appends its version to ``versions`` and becomes the rollout's version."""
        mode = self.spec.trainer.async_.partial_rollout
        if mode == "off" or model not in self.graph.rollout_pools:
            return None

        delay = self._inject_step_delay.get(model, 0.0)

        def poll():
            if delay:
                time.sleep(delay)
            staged = self._take_staged(model)
            if staged is None:
                return None
            version, buckets = staged
            versions.append(version)
            self.rollout_versions[model] = version
            return _bucket_items(buckets)

        return WeightUpdates(poll=poll, mode=mode)

    def _take_staged(self, model: str) -> tuple[int, list[dict]] | None:
        with self._staged_lock:
            return self._staged.pop(model, None)

    def _load_staged(self, model: str) -> None:
        """Load weights left by ``receive_weights`` since the last generation (partial rollouts)."""
        staged = self._take_staged(model)
        if staged is not None:
            version, buckets = staged
            self.rollout_engines[model].load_weights(_bucket_items(buckets))
            self.rollout_versions[model] = version

    def generate_multi_turn(self, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
        """Multi-turn episodes against the node's environment (``hybridflow.envs.rollout``);
        the environment's rewards are the scores."""
        from hybridflow.envs.base import env_factory
        from hybridflow.envs.rollout import (
            TurnLimits, env_rows, episode_fields, episode_metrics, make_episodes, run_episodes, unpadded,
        )

        opts = node.spec.options  # MultiTurnOptions
        rollout = self.spec.models[node.model].rollout
        params = SamplingParams(
            temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k, greedy=opts.greedy
        )
        batch = repeat_interleave_td(batch, 1 if opts.greedy else rollout.n)
        make_env = env_factory(opts.env, opts.env_kwargs)
        self._load_staged(node.model)  # partial rollouts: multi-turn calls load whole, before
        engine, tok = self.rollout_engines[node.model], self.tokenizer
        episodes = make_episodes(unpadded(batch[K.PROMPT_IDS], batch[K.PROMPT_MASK]), env_rows(batch), make_env, tok)
        stop = episodes[0].env.stop_strings() if episodes else []
        width = self.spec.data.max_response_length
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
        batch[K.WEIGHT_VERSION] = torch.full((batch.batch_size[0],), self.rollout_versions[node.model], dtype=torch.int64)
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
        return batch, {"metrics": metrics, "sums": sums, "samples": self._samples(batch, scores, "reward", observations=True)}

    def log_prob(self, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
        out = self.train_engines[node.model].forward(batch, self._temperature())
        result = TensorDict({node.outputs[0]: out["log_probs"]}, batch_size=batch.batch_size)
        metrics = {}
        if node.role == "actor":  # the policy's entropy; a reference model's is not reported
            metrics["actor/entropy"] = float(masked_mean(out["entropy"], batch[K.RESPONSE_MASK]))
        return result, {"metrics": metrics}

    def score(self, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
        model, output_key = node.model, node.outputs[0]
        # "reward" / "cost"; a second score of the same model (ReMax's baseline) by its key
        role = self.spec.models[model].role
        prefix = role if output_key in (K.SCORES, K.COSTS) else output_key
        opts = node.spec.options  # ScoreOptions
        fields, metrics, sums = {}, {}, {}
        if model in self.rules:
            responses = self.tokenizer.batch_decode(
                batch[K.RESPONSES] * batch[K.RESPONSE_MASK], skip_special_tokens=True
            )
            scored = self.rules[model].score(
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
            if self.spec.models[model].source.remote is not None:
                sums[f"{prefix}/num_retries"] = float(scored.num_retries)
        else:
            scores = self.train_engines[model].forward(batch)["last_values"]
        scores, unfinished = apply_ending_rule(scores, batch, self.tokenizer, opts, role)
        metrics[f"{prefix}/unfinished_frac"] = float(unfinished.float().mean())
        if opts.overlong_buffer is not None:
            lengths = batch[K.RESPONSE_MASK].sum(-1)
            penalty = overlong_penalty(lengths, self.spec.data.max_response_length, opts.overlong_buffer, opts.overlong_penalty)
            scores = scores - penalty
            metrics[f"{prefix}/overlong_penalty/mean"] = float(penalty.mean())
        result = TensorDict(
            {output_key: scores, K.TOKEN_REWARDS: place_sequence_reward(scores, batch[K.RESPONSE_MASK]), **fields},
            batch_size=batch.batch_size,
        )
        metrics.update({f"{prefix}/mean": float(scores.mean()), f"{prefix}/sq_mean": float((scores**2).mean())})
        return result, {"metrics": metrics, "sums": sums, "samples": self._samples(batch, scores, prefix)}

    def _samples(self, batch: TensorDict, scores: torch.Tensor, score_name: str, observations: bool = False) -> list[dict]:
        """A few decoded generations for RUN_DIR/samples.jsonl, spread over this rank's prompts.

        Decoded here, where the tokens are, so the controller gets short strings in the meta and
        never the rollout tensors.
        """
        trainer = self.spec.trainer
        if not trainer.sample_interval or K.PROMPT_TEXT not in batch.keys():
            return []
        count = min(len(scores), math.ceil(trainer.num_logged_samples / self.world_size))
        rows = torch.linspace(0, len(scores) - 1, count).round().long().tolist()
        # With ``observations`` (multi-turn) the environment's tokens are shown too.
        width = batch[K.RESPONSES].shape[1]
        mask = batch[K.ATTENTION_MASK][:, -width:] if observations else batch[K.RESPONSE_MASK]
        responses = self.tokenizer.batch_decode(batch[K.RESPONSES][rows] * mask[rows], skip_special_tokens=True)
        prompts = batch.get(K.PROMPT_TEXT).tolist()
        truths = batch.get(K.GROUND_TRUTH).tolist() if K.GROUND_TRUTH in batch.keys() else None
        return [
            {"prompt": prompts[r], "response": text, score_name: round(float(scores[r]), 4)}
            | ({"ground_truth": truths[r]} if truths is not None else {})
            for r, text in zip(rows, responses)
        ]

    def compute_values(self, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
        values = self.train_engines[node.model].forward(batch)[K.VALUES]
        result = TensorDict({node.outputs[0]: values}, batch_size=batch.batch_size)
        metrics = {f"{node.model}/values_mean": float(masked_mean(values, batch[K.RESPONSE_MASK]))}
        return result, {"metrics": metrics}

    def advantage(self, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
        reduce_sum = algo_steps.dp_sum(self._dp_group(node.model))
        result, metrics = algo_steps.compute_advantages(batch, node, self.extra_state, reduce_sum)
        return result, {"metrics": metrics}

    def filter_groups(self, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
        """Dynamic sampling's filter: this rank's rows (whole prompt groups) with the groups
        whose scores differ first, then the others; ``kept_rows`` counts the first ones (the
        controller takes prefixes, ``controller.executor.run_refilling``)."""
        scores = batch[graph_keys()[node.slots["score"]][0]].float()
        keep = informative_groups(scores, batch[K.UID])
        order = torch.cat([keep.nonzero()[:, 0], (~keep).nonzero()[:, 0]])
        return batch[order], {"kept_rows": int(keep.sum())}

    def update_critic(self, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
        opts: UpdateOptions = node.spec.options
        values_field, returns_field = algo_steps.critic_fields(node)
        loss_fn = algo_steps.critic_loss(opts, values_field, returns_field)
        metrics = self._train(batch, node, loss_fn)
        metrics[f"{node.model}/explained_var"] = algo_steps.critic_explained_variance(
            batch, values_field, returns_field, algo_steps.dp_sum(self._dp_group(node.model))
        )
        return TensorDict({}, batch_size=batch.batch_size), {"metrics": metrics}

    def update_policy(self, batch: TensorDict, node: Node) -> tuple[TensorDict, dict]:
        """The actor's update; then its rollout engine takes the new weights."""
        opts: UpdateOptions = node.spec.options
        model = node.model
        extra: dict[str, float] = {}
        if opts.mask_truncated:  # DAPO's overlong filtering: truncated rows leave the loss
            kept = ~batch[K.TRUNCATED].bool()
            batch[K.RESPONSE_MASK] = batch[K.RESPONSE_MASK] * kept.unsqueeze(-1).to(batch[K.RESPONSE_MASK].dtype)
            extra["actor/masked_truncated_frac"] = float((~kept).float().mean())
        if opts.safety is not None:
            lagrange = self.extra_state[f"lagrange/{node.name}"]
            extra.update(algo_steps.apply_safety(batch, opts, lagrange, algo_steps.dp_sum(self._dp_group(model))))
        algo_steps.check_rollout_log_probs_recorded(batch, opts, node.name)
        if opts.rollout_correction is not None:
            extra.update(algo_steps.apply_rollout_correction(batch, opts, self._dp_group(model)))
        if model in self.train_versions and K.WEIGHT_VERSION in batch.keys():
            extra.update(algo_steps.staleness(batch, self.train_versions[model], self._dp_group(model)))
            bound = self.spec.trainer.async_
            assert bound.mode == "sync" or extra["async/staleness_max"] <= bound.max_staleness, (
                f"samples {extra['async/staleness_max']:g} updates old > trainer.async.max_staleness"
            )
        rollout_stats = ConsistencyStats()
        metrics = self._train(batch, node, self._policy_loss(opts, rollout_stats), rollout_stats)
        metrics.update(extra)
        # Same numbers on every rank (reduced over the DP group): all ranks stop together.
        consistency = rollout_stats.reduce(self._dp_group(model))
        metrics.update({f"actor/{k}": v for k, v in consistency.items()})
        rollout = self.spec.models[model].rollout
        # Off-policy modes train on samples of older weights by design: report, do not stop.
        if rollout is not None and self.spec.trainer.async_.mode == "sync":
            check_consistency(consistency, rollout.log_prob_tolerance, model=model, engine=rollout.engine)
        if model in self.train_versions:
            self.train_versions[model] += 1
        if model in self.rollout_engines:
            if self._inject_stale_syncs.get(model, 0) > 0:
                self._inject_stale_syncs[model] -= 1
            else:
                metrics.update(self._sync_rollout(model))
        metrics.update(memory_metrics())
        return TensorDict({}, batch_size=batch.batch_size), {"metrics": metrics}

    def _train(self, batch: TensorDict, node: Node, loss_fn, rollout_stats: ConsistencyStats | None = None) -> dict[str, float]:
        """``epochs`` passes of ``mini_batches`` optimizer steps; the steps' metrics averaged,
        under ``actor/`` for the actor and ``<model>/`` otherwise."""
        opts: UpdateOptions = node.spec.options
        engine = self.train_engines[node.model]
        if self._inject_nonfinite_updates.get(node.model, 0) > 0:
            self._inject_nonfinite_updates[node.model] -= 1
            loss_fn = _poisoned(loss_fn)
        steps = []
        for _ in range(opts.epochs):
            for mini_batch in batch.chunk(opts.mini_batches):
                steps.append(engine.train_step(mini_batch, loss_fn, self._temperature()))
                if rollout_stats is not None:
                    rollout_stats.frozen = True  # later forwards come after an optimizer step
        prefix = "actor" if node.role == "actor" else node.model
        return {f"{prefix}/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]}

    @register(Dispatch.ONE_TO_ALL)
    def save_hf(self, *, model: str, path: str) -> None:
        self.colocation.activate(model)
        self.train_engines[model].save_hf(path)

    # -- checkpoints and fault injection ------------------------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, *, path: str, pool: str) -> None:
        """Write this rank's part of checkpoint ``path`` (``workers/checkpointing.py``): the
        trained engines, layout-free, and this rank's RNG and extra state. Refuses
        (NonFiniteWeightError) if any trained weight is not finite. Frozen models (ref, reward
        models) are rebuilt from their source, not saved."""
        engines = self._trained_engines()
        for name, engine in engines.items():
            for param_name, param in engine.named_weights():
                if not bool(torch.isfinite(param).all()):
                    raise NonFiniteWeightError(
                        f"model {name!r} rank {self.rank}: weight {param_name} is not finite; "
                        "not checkpointing it"
                    )
        checkpointing.save(path, pool, self.rank, engines, self.extra_state)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, *, path: str, pool: str, same_ranks: bool, iteration: int) -> None:
        """Load checkpoint ``path``, saved under any layout; ``same_ranks``: its pool ``pool``
        had this pool's number of ranks (then each rank takes back its own RNG stream)."""
        checkpointing.load_engines(path, self._trained_engines())
        for name in self.train_versions:  # one actor update per iteration
            self.train_versions[name] = iteration
        for name in self.rollout_engines:  # a rollout engine with its own copy: the loaded weights
            if name in self.train_engines:  # a standalone one gets them by publish_weights
                self._sync_rollout(name)
        checkpointing.load_rank_state(
            path, pool, self.rank, self.extra_state, same_ranks, self.spec.trainer.seed, iteration
        )

    def shutdown(self) -> None:
        """Stop the score processes first: the actor's SIGTERM would otherwise land in their
        finaliser and print tracebacks at the end of every run."""
        for sources in self.rules.values():
            sources.close()
        for engine in self.rollout_engines.values():
            engine.close()
        super().shutdown()

    def _trained_engines(self) -> dict[str, TrainEngine]:
        trained = {n.model for n in self.spec.nodes if n.op == "update"}
        return {name: e for name, e in self.train_engines.items() if name in trained}

    def _sync_rollout(self, model: str) -> dict[str, float]:
        """The rollout engine of ``model`` takes its train engine's current weights (and their
        version: samples it generates from now on are tagged with it)."""
        self.rollout_versions[model] = self.train_versions[model]
        return self.weight_syncs[model](self.rollout_engines[model])

    # -- a standalone rollout's weights (rollout.pool) -----------------------------------------

    @register(Dispatch.ONE_TO_ALL)
    def publish_weights(self, *, model: str, bucket_mb: float) -> dict | None:
        """Rank 0 puts ``model``'s current weights into the object store in buckets of about
        ``bucket_mb`` MiB (every data-parallel rank holds or gathers the same full weights)
        and returns their refs with the weight version and the bytes; the other ranks return
        None."""
        if self.rank != 0:
            for _ in self.train_engines[model].named_weights():  # a sharded engine gathers: every rank
                pass
            return None
        start = time.perf_counter()
        buckets, bucket, size, total = [], {}, 0, 0
        limit = bucket_mb * 2**20
        for name, tensor in self.train_engines[model].named_weights():
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > limit:
                buckets.append(ray.put(bucket))
                bucket, size = {}, 0
            bucket[name] = tensor
            size += nbytes
            total += nbytes
        if bucket:
            buckets.append(ray.put(bucket))
        return {
            "buckets": buckets,
            "version": self.train_versions[model],
            "metrics": {"weight_sync/bytes": float(total), "weight_sync/buckets": float(len(buckets)),
                        "timing/weight_publish": time.perf_counter() - start,
                        **self.train_engines[model].sync_metrics()},  # a sharded engine's gathers
        }

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, *, model: str, published: list) -> dict[str, float]:
        """Load what rank 0 of the training pool published (``published``: ``[ref]``, the ref
        of its ``publish_weights`` result) into ``model``'s rollout engine, fetching one
        bucket at a time into one load (a vLLM engine takes whole weight sets); later samples
        carry the published version. With partial rollouts this runs on the actor's side
        thread, beside a generation: it fetches the buckets and leaves them for the generation
        to load between two decoding steps (or the next one to load first), newer weights
        replacing ones not loaded yet."""
        start = time.perf_counter()
        (offer,) = ray.get(published)
        if self.spec.trainer.async_.partial_rollout != "off":
            buckets = ray.get(list(offer["buckets"]))
            with self._staged_lock:
                self._staged[model] = (offer["version"], buckets)
            return {**offer["metrics"], "timing/weight_sync": time.perf_counter() - start}

        def fetched():  # one bucket in memory at a time, all in one load (vLLM needs whole sets)
            for ref in offer["buckets"]:
                yield from ray.get(ref).items()

        self.rollout_engines[model].load_weights(fetched())
        self.rollout_versions[model] = offer["version"]
        return {**offer["metrics"], "timing/weight_sync": time.perf_counter() - start}

    @register(Dispatch.ONE_TO_ALL)
    def inject_nonfinite(self, *, model: str, target: str, count: int = 1) -> None:
        """Test hook: ``target="loss"`` makes the next ``count`` updates of ``model`` have a
        NaN loss; ``target="weight"`` sets one of its weights to NaN now."""
        if target == "loss":
            self._inject_nonfinite_updates[model] = count
        else:
            next(iter(self.train_engines[model].named_weights()))[1].view(-1)[0] = math.nan

    @register(Dispatch.ONE_TO_ALL)
    def inject_stale_rollout(self, *, model: str, count: int = 1) -> None:
        """Test hook: skip the weight sync of the next ``count`` updates of ``model``, so its
        rollout engine (if it holds its own copy, as vLLM does) generates from stale weights."""
        self._inject_stale_syncs[model] = count

    @register(Dispatch.ONE_TO_ALL)
    def inject_step_delay(self, *, model: str, seconds: float) -> None:
        """Test hook: with partial rollouts, every decoding step of ``model``'s generations
        takes ``seconds`` longer, so that updates finish while a generation is in flight."""
        self._inject_step_delay[model] = seconds

    # -- losses -------------------------------------------------------------------------------

    @staticmethod
    def _old_log_probs(opts: UpdateOptions, mb: TensorDict, log_probs: torch.Tensor) -> torch.Tensor:
        """pi_old of the PPO ratio (``UpdateOptions.old_log_probs``): the rollout engine's
        log-probs, or the recomputed ``old_log_probs`` (decoupled PPO); without that input the
        update is on-policy (one step): old = the current forward, detached. With rollout
        correction the ratio stays pi_theta / pi_old and the detached IS weight pi_old /
        pi_rollout multiplies the per-token policy loss; for gspo the ratio is the sequence's
        (geometric mean) and the weight still per token (use is_level sequence or geometric for
        one weight per sequence); for cispo the clipped weight pi_theta / pi_old and the IS
        weight multiply (AReaL's decoupled objective in REINFORCE form)."""
        if opts.old_log_probs == "rollout":
            return mb[K.ROLLOUT_LOG_PROBS]
        return mb[K.OLD_LOG_PROBS] if K.OLD_LOG_PROBS in mb.keys() else log_probs.detach()

    @staticmethod
    def _policy_loss(opts: UpdateOptions, rollout_stats: ConsistencyStats | None = None):
        policy_loss = POLICY_LOSSES.get(opts.policy_loss)

        def loss_fn(mb: TensorDict, out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
            log_probs = out["log_probs"]
            response_mask = mb[K.RESPONSE_MASK]
            old = ModelWorker._old_log_probs(opts, mb, log_probs)
            loss_mat, metrics = policy_loss(
                log_probs=log_probs,
                old_log_probs=old,
                advantages=mb[K.ADVANTAGES],
                response_mask=response_mask,
                clip_ratio=opts.clip_ratio,
                clip_ratio_low=opts.clip_ratio_low,
                clip_ratio_high=opts.clip_ratio_high,
                clip_ratio_c=opts.clip_ratio_c,
            )
            if K.ROLLOUT_IS_WEIGHTS in mb.keys():  # rollout correction: policy term only
                loss_mat = loss_mat * mb[K.ROLLOUT_IS_WEIGHTS]
            metrics["pg_loss"] = float(agg_loss(loss_mat.detach(), response_mask))
            if K.OLD_LOG_PROBS not in mb.keys():  # no log_prob node on the actor to report it
                metrics["entropy"] = float(masked_mean(out["entropy"].detach(), response_mask))
            if opts.kl_coef > 0:
                kl = kl_penalty(log_probs, mb[K.REF_LOG_PROBS], opts.kl_estimator, opts.kl_bound)
                loss_mat = loss_mat + opts.kl_coef * kl
                metrics["kl"] = float(masked_mean(kl.detach(), response_mask))
            elif K.REF_LOG_PROBS in mb.keys():  # no KL term: the distance to the ref is watched only
                with torch.no_grad():
                    kl = kl_penalty(log_probs, mb[K.REF_LOG_PROBS], opts.kl_estimator, opts.kl_bound)
                metrics["kl"] = float(masked_mean(kl, response_mask))
            if opts.entropy_coef:
                loss_mat = loss_mat - opts.entropy_coef * out["entropy"]
            if rollout_stats is not None and K.ROLLOUT_LOG_PROBS in mb.keys():
                checked = response_mask
                if K.ROLLOUT_LOG_PROBS_RECORDED in mb.keys():  # a sample of rows (log_prob_check_samples)
                    checked = response_mask * mb[K.ROLLOUT_LOG_PROBS_RECORDED].unsqueeze(-1).to(response_mask.dtype)
                rollout_stats.add(log_probs, mb[K.ROLLOUT_LOG_PROBS], checked)
            loss = agg_loss(
                loss_mat,
                response_mask,
                opts.loss_agg,
                normalizer=out["num_global_tokens"],
                num_seqs=out["num_global_seqs"],
            )
            return loss, metrics

        return loss_fn


def _bucket_items(buckets: list[dict]) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of published weight buckets, as one set for one load."""
    return (item for bucket in buckets for item in bucket.items())


def _generation_tp(train: ParallelLayout, tp: int, rank: int, seed: int) -> dict[str, Any]:
    """The rollout engine's seed, and at generation tp > 1 its TP group: every rank of a
    generation TP group (``hybrid_engine.groups``) builds it with the same seed, its replica's."""
    if tp == 1:
        return {"seed": seed * 1000 + rank}
    from hybridflow.hybrid_engine.groups import gen_replica, generation_tp_groups

    gen = GenerationLayout(train=train, tp=tp)
    group = next(g for g in generation_tp_groups(gen) if rank in g)
    return {"seed": seed * 1000 + gen_replica(gen, rank), "tp_ranks": group}
