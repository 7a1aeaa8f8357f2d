"""The controller's run: set up pools and worker groups, then one graph iteration after another."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import ray
import yaml
from tqdm import tqdm

from hybridflow.controller.executor import IterationResult, run_nodes
from hybridflow.controller.metrics import JsonlLogger
from hybridflow.data.datasets import DataError, PromptDataset, collate_prompts, load_prompt_rows
from hybridflow.data.tasks import get_task
from hybridflow.graph.dag import SOURCE, Graph, Node
from hybridflow.placement.pools import ResourcePool
from hybridflow.spec.graph import GenerateOptions
from hybridflow.spec.loading import SpecError
from hybridflow.workers.group import WorkerGroup
from hybridflow.workers.model_worker import ModelWorker
from hybridflow.workers.protocols import ShardedRef

PROGRESS_KEYS = {"reward/mean": "reward", "val/reward/mean": "val", "actor/kl": "kl"}


class Trainer:
    def __init__(self, graph: Graph, address: str | None = None, run_dir: str | None = None):
        self.graph = graph
        self.spec = graph.spec
        self.address = address
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(run_dir or Path(self.spec.trainer.save_dir.format(name=self.spec.name)) / stamp)
        self.groups: dict[str, WorkerGroup] = {}
        self.pools: list[ResourcePool] = []
        self.history: list[dict] = []

    # -- the loop ---------------------------------------------------------------------------

    def fit(self) -> dict:
        """Run every iteration; returns a summary (first/last reward, run dir, time)."""
        started = time.perf_counter()
        self._setup()
        try:
            bar = tqdm(
                range(1, self.spec.trainer.iterations + 1),
                desc=self.spec.name,
                disable=not self.spec.trainer.progress,
                dynamic_ncols=True,
            )
            for iteration in bar:
                metrics = self.step(iteration)
                bar.set_postfix({short: f"{metrics[k]:.3f}" for k, short in PROGRESS_KEYS.items() if k in metrics})
            if self.spec.trainer.save_final:
                self.save_actor(self.run_dir / "actor")
        finally:
            self.shutdown()
        return self.summary(time.perf_counter() - started)

    def step(self, iteration: int) -> dict:
        t0 = time.perf_counter()
        prompts = self.dataset.next_batch()
        result = run_nodes(self.graph, list(self.graph.nodes), self.groups, self._put(prompts))
        metrics = {"iteration": iteration, **result.metrics}
        metrics["timing/iteration"] = time.perf_counter() - t0
        tokens = metrics.get("rollout/num_tokens", 0.0)
        metrics["throughput/tokens_per_s"] = tokens / metrics["timing/iteration"]
        interval = self.spec.trainer.val_interval
        if interval and (iteration % interval == 0 or iteration == self.spec.trainer.iterations):
            metrics.update(self.validate())
        self.logger.log(metrics)
        self.history.append(metrics)
        return metrics

    # -- phases -----------------------------------------------------------------------------

    def _setup(self) -> None:
        spec = self.spec
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._write_resolved_config()
        tokenizer = self._tokenizer()
        tokenizer.save_pretrained(self.run_dir / "tokenizer")
        base_dir = str(Path(self.graph.file).resolve().parent) if Path(self.graph.file).is_file() else "."
        try:
            train_rows, val_rows = load_prompt_rows(
                spec.data.source, base_dir, spec.data.num_train, spec.data.num_val, spec.data.seed
            )
            self.dataset = PromptDataset(
                train_rows,
                tokenizer,
                spec.data.max_prompt_length,
                spec.data.prompts_per_iteration,
                spec.data.shuffle,
                spec.data.seed,
            )
            actor_ranks = self.graph.pools[self.graph.placement[self.graph.actor]].num_devices
            val_rows = val_rows[: len(val_rows) // actor_ranks * actor_ranks]
            self.val_prompts = (
                collate_prompts(val_rows, tokenizer, spec.data.max_prompt_length) if val_rows else None
            )
        except DataError as exc:
            raise SpecError(self.graph.file, "data", str(exc)) from None
        self.logger = JsonlLogger(self.run_dir / "metrics.jsonl")
        self._start_ray()
        for pool_name in dict.fromkeys(self.graph.placement.values()):
            pool = ResourcePool(pool_name, self.graph.pools[pool_name])
            pool.create()
            self.pools.append(pool)
            self.groups[pool_name] = WorkerGroup(
                ModelWorker,
                pool,
                init_kwargs={
                    "graph_spec": spec,
                    "models": self.graph.models_on(pool_name),
                    "layouts": {m: self.graph.layouts[m] for m in self.graph.models_on(pool_name)},
                    "tokenizer_dir": str((self.run_dir / "tokenizer").resolve()),
                    "total_steps": self._total_optimizer_steps(),
                },
                name=pool_name,
            )

    def validate(self) -> dict:
        """Greedy generation on the held-out prompts, scored by the graph's score nodes."""
        if self.val_prompts is None:
            return {}
        generate = next(n for n in self.graph.nodes if n.op == "generate")
        greedy = replace(generate, spec=generate.spec.model_copy(update={"options": GenerateOptions(greedy=True)}))
        scorers = [
            n
            for n in self.graph.nodes
            if n.op == "score" and set(self.graph.producers(n).values()) <= {generate.name, SOURCE}
        ]
        result: IterationResult = run_nodes(self.graph, [greedy, *scorers], self.groups, self._put(self.val_prompts))
        return {
            f"val/{k}": v
            for k, v in result.metrics.items()
            if not k.startswith("timing/") and not k.startswith("rollout/num")
        }

    def save_actor(self, path: Path) -> None:
        group = self.groups[self.graph.placement[self.graph.actor]]
        ray.get(group.call("save_hf", model=self.graph.actor, path=str(path.resolve())))

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.shutdown()
        for pool in self.pools:
            pool.remove()
        self.groups, self.pools = {}, []

    def summary(self, seconds: float) -> dict:
        rewards = [m["reward/mean"] for m in self.history if "reward/mean" in m]
        window = min(10, len(rewards))
        val = [m["val/reward/mean"] for m in self.history if "val/reward/mean" in m]
        return {
            "run_dir": str(self.run_dir),
            "iterations": len(self.history),
            "reward_first10": sum(rewards[:window]) / max(window, 1),
            "reward_last10": sum(rewards[-window:]) / max(window, 1),
            "val_reward_final": val[-1] if val else None,
            "seconds": round(seconds, 1),
        }

    # -- helpers ----------------------------------------------------------------------------

    def _put(self, batch) -> ShardedRef:
        return ShardedRef(refs=[ray.put(batch)], sizes=[batch.batch_size[0]])

    def _tokenizer(self):
        actor = self.spec.models[self.graph.actor]
        if actor.source.path is not None:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(actor.source.path, local_files_only=True)
        source = self.spec.data.source
        task = source.removeprefix("builtin:") if source.startswith("builtin:") else "copy"
        return get_task(task).tokenizer()

    def _total_optimizer_steps(self) -> int:
        updates = [n for n in self.graph.nodes if n.op == "update"]
        per_iteration = max((n.spec.options.mini_batches * n.spec.options.epochs for n in updates), default=1)
        return self.spec.trainer.iterations * per_iteration

    def _write_resolved_config(self) -> None:
        resolved = self.spec.model_dump(mode="json")
        resolved["placement"] = dict(self.graph.placement)
        resolved["resolved_layouts"] = {m: l.model_dump() for m, l in self.graph.layouts.items()}
        (self.run_dir / "graph.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))

    def _start_ray(self) -> None:
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if self.address:
            ray.init(address=self.address, log_to_driver=True)
            return
        needed = sum(p.num_devices * p.cpus_per_device for p in self.graph.pools.values())
        ray.init(
            num_cpus=max(int(needed + 0.999), os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
        )
