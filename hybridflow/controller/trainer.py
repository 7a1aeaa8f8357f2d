"""The controller's run: set up pools and worker groups, then one graph iteration after another."""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import ray
import torch
import yaml
from tqdm import tqdm

from hybridflow.controller.checkpoint import (
    RunStopped,
    complete_checkpoints,
    latest_checkpoint,
    load_controller_state,
    load_worker_states,
    save_checkpoint,
    truncate_metrics,
)
from hybridflow.controller.executor import IterationResult, chrome_trace, run_nodes
from hybridflow.controller.preflight import check_engines_installed, check_inputs, check_model_paths, run_tokenizer
from hybridflow.controller.loggers import RunLoggers
from hybridflow.data.datasets import DataError, PromptDataset, collate_prompts, load_data
from hybridflow.graph.batching import batch_plan
from hybridflow.graph.dag import SOURCE, Graph, Node
from hybridflow.hybrid_engine.consistency import RolloutMismatchError
from hybridflow.placement.pools import ResourcePool
from hybridflow.spec.graph import GenerateOptions
from hybridflow.spec.loading import SpecError
from hybridflow.workers.group import WorkerGroup
from hybridflow.workers.model_worker import ModelWorker, NonFiniteWeightError
from hybridflow.workers.sharded import ShardedRef

PROGRESS_KEYS = {"reward/mean": "reward", "val/reward/mean": "val", "actor/kl": "kl"}
log = logging.getLogger(__name__)


class Trainer:
    """Runs a graph: ``fit()`` sets up, iterates, checkpoints, recovers and saves the actor.

    ``resume=True`` continues the run in ``run_dir`` (default: the newest run under
    ``trainer.save_dir`` that has a checkpoint) from its newest complete checkpoint.
    ``callbacks`` are called as ``cb(trainer, iteration, metrics)`` after each iteration's
    metrics are logged and before its checkpoint (tests use them to inject faults).
    ``extra_state`` maps names to objects with ``state_dict()``/``load_state_dict()`` that the
    controller keeps across iterations (a KL controller, a Lagrange multiplier); they are
    checkpointed and restored with the run. (Workers have the same hook:
    ``ModelWorker.extra_state``.)
    """

    def __init__(
        self,
        graph: Graph,
        address: str | None = None,
        run_dir: str | None = None,
        resume: bool = False,
    ):
        self.graph = graph
        self.spec = graph.spec
        self.address = address
        self.resume = resume
        save_root = Path(self.spec.trainer.save_dir.format(name=self.spec.name))
        if run_dir is None and resume:
            runs = [d for d in save_root.glob("*") if complete_checkpoints(d)] if save_root.is_dir() else []
            if not runs:
                raise SpecError(save_root, "", "--resume: no run with a checkpoint here; give --run-dir")
            run_dir = str(max(runs, key=lambda d: latest_checkpoint(d).stat().st_mtime))
        self.run_dir = Path(run_dir or save_root / time.strftime("%Y%m%d-%H%M%S"))
        self.groups: dict[str, WorkerGroup] = {}
        self.pools: list[ResourcePool] = []
        self.history: list[dict] = []
        self.callbacks: list[Callable[[Trainer, int, dict], None]] = []
        self.extra_state: dict[str, object] = {}
        self.num_restarts = 0
        self._nan_streak = 0  # iterations in a row whose update was skipped (non-finite)
        self._num_skipped = 0  # such iterations in the whole run

    # -- the loop ---------------------------------------------------------------------------

    def fit(self, stop_after: int | None = None) -> dict:
        """Run the iterations (up to ``stop_after`` if given); returns a summary.

        A worker process that dies (e.g. SIGKILL) is survived: every worker group is restarted,
        the run goes back to the newest checkpoint (or its start), metrics rows logged after it
        are cut, and the iterations run again, at most ``trainer.max_restarts`` times.
        """
        started = time.perf_counter()
        try:
            self._setup()  # inside: a group that fails to start must not leak its pool
            total = self.spec.trainer.iterations
            last = min(total, stop_after or total)
            resume_from = latest_checkpoint(self.run_dir) if self.resume else None
            if self.resume and resume_from is None:
                log.warning("--resume: %s has no complete checkpoint; starting from the beginning", self.run_dir)
            done = self._restore(resume_from)
            bar = tqdm(total=total, initial=done, desc=self.spec.name,
                       disable=not self.spec.trainer.progress, dynamic_ncols=True)
            while done < last:
                try:
                    metrics = self._iterate(done + 1)
                except Exception as exc:
                    if not self._workers_lost(exc):
                        raise
                    done = self._recover(exc)
                    bar.reset(total=total)
                    bar.update(done)
                    continue
                done += 1
                bar.update(1)
                bar.set_postfix({short: f"{metrics[k]:.3f}" for k, short in PROGRESS_KEYS.items() if k in metrics})
            bar.close()
            if self.spec.trainer.save_final and done == total:
                self.save_actor(self.run_dir / "actor")
        finally:
            self.shutdown()
        return self.summary(time.perf_counter() - started)

    def _iterate(self, iteration: int) -> dict:
        """One iteration, then the NaN guard's verdict, then the checkpoint if one is due."""
        try:
            metrics = self.step(iteration)
        except RolloutMismatchError as exc:  # raised by the update's first forward, every rank
            raise RunStopped(f"stopping at iteration {iteration}: {getattr(exc, 'cause', exc)}") from None
        for callback in self.callbacks:
            callback(self, iteration, metrics)
        tolerance = self.spec.trainer.nan_tolerance
        if self._nan_streak >= tolerance:
            raise RunStopped(
                f"stopping at iteration {iteration}: the update was skipped for a non-finite loss "
                f"or gradient norm in {self._nan_streak} iterations in a row "
                f"(trainer.nan_tolerance={tolerance}); last checkpoint: "
                f"{latest_checkpoint(self.run_dir) or 'none'}"
            )
        interval = self.spec.trainer.save_interval
        if interval and (iteration % interval == 0 or iteration == self.spec.trainer.iterations):
            self.save_checkpoint(iteration)
        return metrics

    def step(self, iteration: int) -> dict:
        t0 = time.perf_counter()
        prompts = self.dataset.next_batch()
        options = self.spec.trainer
        result = run_nodes(self.graph, list(self.graph.nodes), self.groups, self._put(prompts), serial=options.serial)
        if options.trace_interval and iteration % options.trace_interval == 0:
            trace_file = self.run_dir / "trace" / f"iteration_{iteration:05d}.json"
            trace_file.parent.mkdir(exist_ok=True)
            trace_file.write_text(json.dumps(chrome_trace(result.timeline, iteration)))
        metrics = {"iteration": iteration, **result.metrics}
        metrics["timing/iteration"] = time.perf_counter() - t0
        tokens = metrics.get("rollout/num_tokens", 0.0)
        metrics["throughput/tokens_per_s"] = tokens / metrics["timing/iteration"]
        interval = self.spec.trainer.val_interval
        if interval and (iteration % interval == 0 or iteration == self.spec.trainer.iterations):
            metrics.update(self.validate())
        skipped = any(v > 0 for k, v in metrics.items() if k.endswith("/skipped_step"))
        self._nan_streak = self._nan_streak + 1 if skipped else 0
        self._num_skipped += int(skipped)
        metrics["guard/skipped_updates"] = float(self._num_skipped)
        self.logger.log(metrics, {name: out.metas for name, out in result.outputs.items()})
        self.history.append(metrics)
        return metrics

    # -- phases -----------------------------------------------------------------------------

    def _setup(self) -> None:
        spec = self.spec
        # Every user input is checked before anything is written or started.
        check_engines_installed(self.graph)
        check_model_paths(self.graph)
        tokenizer = self._tokenizer()
        check_inputs(self.graph, tokenizer)
        try:
            train_rows, val_rows = load_data(spec.data, self.graph.file)
            self.dataset = PromptDataset(
                train_rows,
                tokenizer,
                spec.data.max_prompt_length,
                spec.data.prompts_per_iteration,
                spec.data.shuffle,
                spec.data.seed,
                system_prompt=spec.data.system_prompt,
            )
            actor_ranks = self.graph.pools[self.graph.placement[self.graph.actor]].num_devices
            val_rows = val_rows[: len(val_rows) // actor_ranks * actor_ranks]
            self.val_prompts = (
                collate_prompts(val_rows, tokenizer, spec.data.max_prompt_length,
                                system_prompt=spec.data.system_prompt) if val_rows else None
            )
        except DataError as exc:
            raise SpecError(self.graph.file, exc.field, str(exc)) from None
        metrics_file = self.run_dir / "metrics.jsonl"
        if self.resume and not self.run_dir.is_dir():
            raise SpecError(self.run_dir, "", "--resume: run directory not found")
        if not self.resume and metrics_file.exists() and metrics_file.stat().st_size:
            # A second run's rows would follow the first's, iterations restarting at 1, and its
            # summary would count both.
            raise SpecError(
                self.run_dir, "", "already holds a run (metrics.jsonl); --resume continues it, "
                "or choose another --run-dir"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._write_resolved_config()
        tokenizer.save_pretrained(self.run_dir / "tokenizer")
        # What a restore without checkpoint goes back to (fresh workers are in this state).
        self._initial_state = self._controller_state(0, metrics_offset=0)
        self.logger = RunLoggers(spec.trainer, self.run_dir, self.graph.file)
        tqdm.write(batch_plan(spec, self.graph.layouts, self.graph.file).describe())
        self._start_ray()
        for pool_name in dict.fromkeys(self.graph.placement.values()):
            pool = ResourcePool(pool_name, self.graph.pools[pool_name])
            pool.create()
            self.pools.append(pool)
        self._start_groups()

    def _start_groups(self) -> None:
        for pool in self.pools:
            pool_name = pool.name
            self.groups[pool_name] = WorkerGroup(
                ModelWorker,
                pool,
                init_kwargs={
                    "graph": self.graph,
                    "models": self.graph.models_on(pool_name),
                    "tokenizer_dir": str((self.run_dir / "tokenizer").resolve()),
                    "total_steps": self._total_optimizer_steps(),
                },
                name=pool_name,
                # Starting vLLM or importing megatron-core in a worker takes tens of CPU-seconds
                # (minutes on a busy box).
                ready_timeout_s=600.0 if self._slow_start(pool_name) else 120.0,
            )

    def _slow_start(self, pool_name: str) -> bool:
        models = self.spec.models
        return any(
            (models[m].rollout is not None and models[m].rollout.engine == "vllm")
            or models[m].train.engine == "megatron"
            for m in self.graph.models_on(pool_name)
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

    # -- checkpoints and recovery -------------------------------------------------------------

    def save_checkpoint(self, iteration: int) -> Path:
        """Checkpoint the state after ``iteration`` (module ``checkpoint``); a non-finite weight
        stops the run instead (``RunStopped``), leaving the previous checkpoint the newest."""
        state = self._controller_state(iteration, self.logger_offset())
        try:
            return save_checkpoint(self.run_dir, iteration, self.groups, state, self.spec.trainer.keep_last)
        except NonFiniteWeightError as exc:
            cause = getattr(exc, "cause", exc)
            raise RunStopped(
                f"stopping at iteration {iteration}: {cause}; last checkpoint: "
                f"{latest_checkpoint(self.run_dir) or 'none'}"
            ) from None

    def logger_offset(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return path.stat().st_size if path.exists() else 0

    def _controller_state(self, iteration: int, metrics_offset: int) -> dict:
        return {
            "iteration": iteration,
            "dataset": self.dataset.state_dict(),
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
            "metrics_offset": metrics_offset,
            "guard": {"streak": self._nan_streak, "skipped": self._num_skipped},
            "extra": {name: obj.state_dict() for name, obj in self.extra_state.items()},
        }

    def _restore(self, path: Path | None) -> int:
        """Go back to checkpoint ``path`` (None: the run's start, with fresh workers); cut the
        metrics logged after it. Returns the iteration it was taken after."""
        state = load_controller_state(path) if path is not None else self._initial_state
        if path is not None:
            load_worker_states(path, self.groups)
        self.dataset.load_state_dict(state["dataset"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        self._nan_streak, self._num_skipped = state["guard"]["streak"], state["guard"]["skipped"]
        for name, value in state["extra"].items():
            self.extra_state[name].load_state_dict(value)
        self.history = truncate_metrics(self.run_dir / "metrics.jsonl", state["metrics_offset"])
        if path is not None:
            log.warning("resumed %s from %s (iteration %d)", self.run_dir, path, state["iteration"])
        return state["iteration"]

    def _workers_lost(self, exc: BaseException) -> bool:
        """Whether ``exc`` came from a worker process that died (vs. a bug or a user error)."""
        if isinstance(exc, ray.exceptions.RayActorError):
            return True
        if not isinstance(exc, ray.exceptions.RayError):
            return False
        # A surviving rank fails first (its gloo peer vanished); ask every rank if it lives.
        for group in self.groups.values():
            refs = [w.ready.remote() for w in group.workers]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10.0)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    return True
        return False

    def _recover(self, exc: BaseException) -> int:
        """Restart every worker group and go back to the newest checkpoint; returns its
        iteration. Gives up (RunStopped) after ``trainer.max_restarts`` recoveries."""
        self.num_restarts += 1
        limit = self.spec.trainer.max_restarts
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        if self.num_restarts > limit:
            raise RunStopped(
                f"a worker died again ({reason}); trainer.max_restarts={limit} recoveries used up"
            ) from exc
        path = latest_checkpoint(self.run_dir)
        log.warning(
            "worker lost (%s); restarting worker groups, resuming from %s (recovery %d of %d)",
            reason, path or "the start", self.num_restarts, limit,
        )
        with (self.run_dir / "events.jsonl").open("a") as f:
            f.write(json.dumps({"event": "worker_lost", "time": time.time(), "reason": reason,
                                "resume_from": str(path) if path else None,
                                "recovery": self.num_restarts}) + "\n")
        for group in self.groups.values():
            group.shutdown(graceful=False)
        self.groups = {}
        self._start_groups()
        return self._restore(path)

    def save_actor(self, path: Path) -> None:
        group = self.groups[self.graph.placement[self.graph.actor]]
        ray.get(group.call("save_hf", model=self.graph.actor, path=str(path.resolve())))

    def shutdown(self) -> None:
        if hasattr(self, "logger"):
            self.logger.close()
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
            "restarts": self.num_restarts,
            "seconds": round(seconds, 1),
        }

    # -- helpers ----------------------------------------------------------------------------

    def _put(self, batch) -> ShardedRef:
        return ShardedRef(refs=[ray.put(batch)], sizes=[batch.batch_size[0]])

    def _tokenizer(self):
        return run_tokenizer(self.graph)

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
        # Ray starts workers at niceness 15; here the workers do all the heavy work while the
        # controller sleeps, and at 15 any other busy process on the box starves them (measured:
        # 1.55 s vs 0.25 s per iteration of the one-rank default graph beside a busy process).
        os.environ.setdefault("RAY_worker_niceness", "0")
        needed = sum(p.num_devices * p.cpus_per_device for p in self.graph.pools.values())
        ray.init(
            num_cpus=max(int(needed + 0.999), os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
        )
