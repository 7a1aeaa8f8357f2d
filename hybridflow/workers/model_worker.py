"""The worker that runs graph ops: one process per device, holding every model placed on its pool.

Colocated models (e.g. actor + ref + a rule reward) share this process and its gloo group. Each
op is a registered method with its transfer protocol; the controller never calls them directly.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from hybridflow.algos import ADV_ESTIMATORS, POLICY_LOSSES, agg_loss, kl_penalty, masked_mean
from hybridflow.data import keys as K
from hybridflow.data.batch import place_sequence_reward
from hybridflow.engines.base import SamplingParams
from hybridflow.engines.hf_rollout import HFRolloutEngine
from hybridflow.engines.models import build_causal_lm, build_value_model
from hybridflow.engines.torch_engine import TorchTrainEngine
from hybridflow.hybrid_engine.sync import sync_weights
from hybridflow.rewards.rule import load_rule, score_texts
from hybridflow.spec.graph import GraphSpec, UpdateOptions
from hybridflow.spec.layout import ParallelLayout
from hybridflow.workers.base import Worker
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
        graph_spec: GraphSpec,
        models: list[str],
        layouts: dict[str, ParallelLayout],
        tokenizer_dir: str,
        total_steps: int,
    ) -> None:
        super().__init__(rank, world_size, master_addr, master_port, threads)
        from transformers import AutoTokenizer

        self.spec = graph_spec
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        seed = graph_spec.trainer.seed
        self.train_engines: dict[str, TorchTrainEngine] = {}
        self.rollout_engines: dict[str, HFRolloutEngine] = {}
        self.rules = {}
        for name in models:
            model_spec = graph_spec.models[name]
            if model_spec.source.rule is not None:
                self.rules[name] = load_rule(model_spec.source.rule)
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
            engine_spec = model_spec.train.model_copy(update={"layout": layouts[name]})
            self.train_engines[name] = TorchTrainEngine(
                module, engine_spec, total_steps=total_steps, kind="value" if value_head else "policy"
            )
            if model_spec.rollout is not None:
                # Same process, same layout: generate from the train engine's own module.
                self.rollout_engines[name] = HFRolloutEngine(
                    module, eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id
                )
        # Different ranks must sample differently; the same rank the same way every run.
        torch.manual_seed(seed * 1000 + rank)

    # -- ops ----------------------------------------------------------------------------------

    @register(Dispatch.DP_SPLIT)
    def generate(self, batch: TensorDict, *, model: str, greedy: bool) -> tuple[TensorDict, dict]:
        rollout = self.spec.models[model].rollout
        params = SamplingParams(
            n=1 if greedy else rollout.n,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=self.spec.data.max_response_length,
            greedy=greedy,
        )
        out = self.rollout_engines[model].generate(batch, params)
        response_mask = out[K.RESPONSE_MASK]
        lengths = response_mask.sum(-1).float()
        metrics = {
            "response_length/mean": float(lengths.mean()),
            "response/truncated_frac": float(out[K.TRUNCATED].float().mean()),
        }
        return out, {"metrics": metrics, "sums": {"rollout/num_tokens": float(response_mask.sum())}}

    @register(Dispatch.DP_SPLIT)
    def log_prob(
        self, batch: TensorDict, *, model: str, output_key: str, temperature: float
    ) -> tuple[TensorDict, dict]:
        out = self.train_engines[model].forward(batch, temperature)
        result = TensorDict({output_key: out["log_probs"]}, batch_size=batch.batch_size)
        metrics = {}
        if self.spec.models[model].role == "actor":
            metrics["actor/entropy"] = float(masked_mean(out["entropy"], batch[K.RESPONSE_MASK]))
        return result, {"metrics": metrics}

    @register(Dispatch.DP_SPLIT)
    def score(self, batch: TensorDict, *, model: str) -> tuple[TensorDict, dict]:
        if model in self.rules:
            responses = self.tokenizer.batch_decode(
                batch[K.RESPONSES] * batch[K.RESPONSE_MASK], skip_special_tokens=True
            )
            scores = score_texts(
                self.rules[model],
                batch.get(K.PROMPT_TEXT).tolist(),
                responses,
                batch.get(K.GROUND_TRUTH).tolist(),
            )
        else:
            values = self.train_engines[model].forward(batch)[K.VALUES]
            last = (batch[K.RESPONSE_MASK].sum(-1) - 1).clamp(min=0)
            scores = values.gather(1, last[:, None]).squeeze(1)
        prefix = self.spec.models[model].role  # "reward" or "cost"
        result = TensorDict(
            {K.SCORES: scores, K.TOKEN_REWARDS: place_sequence_reward(scores, batch[K.RESPONSE_MASK])},
            batch_size=batch.batch_size,
        )
        metrics = {f"{prefix}/mean": float(scores.mean()), f"{prefix}/sq_mean": float((scores**2).mean())}
        return result, {"metrics": metrics}

    @register(Dispatch.DP_SPLIT)
    def advantage(self, batch: TensorDict, *, options: dict[str, Any]) -> tuple[TensorDict, dict]:
        estimator = ADV_ESTIMATORS.get(options["estimator"])
        fields = {name: batch[name] for name in (K.SCORES, K.RESPONSE_MASK, K.UID) if name in batch.keys()}
        advantages, returns = estimator(**fields, **{k: v for k, v in options.items() if k != "estimator"})
        result = TensorDict({K.ADVANTAGES: advantages, K.RETURNS: returns}, batch_size=batch.batch_size)
        metrics = {"advantage/abs_mean": float(masked_mean(advantages.abs(), batch[K.RESPONSE_MASK]))}
        return result, {"metrics": metrics}

    @register(Dispatch.DP_SPLIT)
    def update(
        self, batch: TensorDict, *, model: str, options: dict[str, Any], temperature: float
    ) -> tuple[TensorDict, dict]:
        opts = UpdateOptions(**options)
        engine = self.train_engines[model]
        steps = []
        for _ in range(opts.epochs):
            for mini_batch in batch.chunk(opts.mini_batches):
                steps.append(engine.train_step(mini_batch, self._policy_loss(opts), temperature))
        metrics = {f"actor/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]}
        if model in self.rollout_engines:
            metrics.update(sync_weights(engine, self.rollout_engines[model]))
        return TensorDict({}, batch_size=batch.batch_size), {"metrics": metrics}

    @register(Dispatch.ONE_TO_ALL)
    def save_hf(self, *, model: str, path: str) -> None:
        self.train_engines[model].save_hf(path)

    # -- losses -------------------------------------------------------------------------------

    @staticmethod
    def _policy_loss(opts: UpdateOptions):
        policy_loss = POLICY_LOSSES.get(opts.policy_loss)

        def loss_fn(mb: TensorDict, out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
            log_probs = out["log_probs"]
            response_mask = mb[K.RESPONSE_MASK]
            # Without an old_log_prob node the update is on-policy (one step): old = current.
            old = mb[K.OLD_LOG_PROBS] if K.OLD_LOG_PROBS in mb.keys() else log_probs.detach()
            loss_mat, metrics = policy_loss(
                log_probs=log_probs,
                old_log_probs=old,
                advantages=mb[K.ADVANTAGES],
                response_mask=response_mask,
                clip_ratio=opts.clip_ratio,
            )
            metrics["pg_loss"] = float(agg_loss(loss_mat.detach(), response_mask))
            if opts.kl_coef > 0:
                kl = kl_penalty(log_probs, mb[K.REF_LOG_PROBS], opts.kl_estimator)
                loss_mat = loss_mat + opts.kl_coef * kl
                metrics["kl"] = float(masked_mean(kl.detach(), response_mask))
            if opts.entropy_coef:
                loss_mat = loss_mat - opts.entropy_coef * out["entropy"]
            if K.ROLLOUT_LOG_PROBS in mb.keys():
                diff = (log_probs.detach() - mb[K.ROLLOUT_LOG_PROBS]).abs()
                metrics["rollout_log_prob_diff"] = float(masked_mean(diff, response_mask))
            loss = agg_loss(loss_mat, response_mask, opts.loss_agg, normalizer=out["num_global_tokens"])
            return loss, metrics

        return loss_fn
