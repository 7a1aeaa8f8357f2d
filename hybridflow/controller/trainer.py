"""The controller's run: set up pools and worker groups, then one graph iteration after another.

One iteration (``fit`` -> ``_iterate`` -> ``step``), for any graph; grpo.yaml's nodes shown::

    dataset.next_batch() --prompts--> run_nodes(graph): every node starts once its inputs exist
                                        generate --responses--> ref_log_prob, reward
                                        reward --scores--> advantage --advantages--> update_actor
                                        (nodes on disjoint pools run at once, on one pool in turn;
                                         outputs stay in the object store as futures)
                           metrics <----/
    validate()             every trainer.val_interval: greedy generate + score, held-out prompts
    nan_guard.observe()    counts updates skipped for a non-finite loss or gradient
    logger.log()           metrics.jsonl, samples.jsonl, console / TensorBoard / wandb / MLflow
    callbacks, NaN guard   nan_tolerance skipped updates in a row: RunStopped
    checkpointer.save()    every trainer.save_interval: checkpoints/iter_N, atomic, layout-free

``trainer.async.mode: one_step_off`` (``ahead``): ``dataset.next_batch()`` and generate
run one iteration ahead; iteration k's graph starts from the generation submitted during k-1,
and generation k+1 is submitted before update k, so it samples from the weights before it
(``streaming`` keeps K = ``max_staleness`` generations ahead: staleness K)::

    iter k:    [generate k+1] old_log_prob k, ref k, reward k, advantage k, update k
    iter k+1:  (generate k+1, done) old_log_prob k+1, ... update k+1      staleness 1

With a standalone rollout (``rollout.pool``) generation runs on its own pool, during the
updates, and each update's weights travel there (``_sync_standalone_rollouts``).

A lost worker (``recovery``) restarts every group and ``checkpointer.restore()``s the newest
checkpoint; with ``trainer.elastic`` a lost node first shrinks the pools to what the nodes left
hold (``elastic``, ``_reshape``). Components in modules of their own: ``run_dir`` (which
directory, refusing another run's), ``checkpoint`` (``Checkpointer``), ``recovery``
(``Recovery``, ``NanGuard``), ``elastic`` (``Elastic``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import ray
from tqdm import tqdm

from hybridflow.controller.checkpoint import Checkpointer
from hybridflow.controller.executor import IterationResult, chrome_trace, run_nodes
from hybridflow.controller.loggers import RunLoggers
from hybridflow.controller.ahead import AheadGeneration
from hybridflow.controller.elastic import Elastic
from hybridflow.controller.preflight import (
    check_engines_installed, check_inputs, check_model_paths, check_score_inputs, run_tokenizer,
)
from hybridflow.controller.reaper import mark_run
from hybridflow.controller.recovery import NanGuard, Recovery, RunStopped
from hybridflow.controller.run_dir import RunDir
from hybridflow.data.datasets import DataError, PromptDataset, collate_prompts, load_data
from hybridflow.data.preferences import PairDataset, collate_pairs, load_pair_data
from hybridflow.graph.batching import batch_plan
from hybridflow.graph.dag import SOURCE, Graph
from hybridflow.hybrid_engine.consistency import RolloutMismatchError
from hybridflow.hybrid_engine.verify import WeightSyncError
from hybridflow.workers.pools import ResourcePool, start_ray
from hybridflow.rewards.rule import RewardError
from hybridflow.spec.engines import caps_of
from hybridflow.spec.loading import SpecError
from hybridflow.workers.accounting import controller_get
from hybridflow.workers.group import WorkerGroup
from hybridflow.workers import recording
from hybridflow.workers.model_worker import ModelWorker
from hybridflow.workers.sharded import ShardedRef

PROGRESS_KEYS = {"reward/mean": "reward", "val/reward/mean": "val", "actor/kl": "kl", "rm/accuracy": "acc",
                 "val/rm/accuracy": "val_acc"}
log = logging.getLogger(__name__)


@contextlib.contextmanager
def _one_line_stop(when: str):
    """A worker's one-line stop (Ray wraps it) as the run's RunStopped, saying ``when``."""
    try:
        yield
    except (RolloutMismatchError, WeightSyncError, RewardError) as exc:
        cause = getattr(exc, "cause", exc)
        _drop_unfetched_copies(cause)
        raise RunStopped(f"stopping {when}: {cause}") from None


def _drop_unfetched_copies(cause: BaseException) -> None:
    """Every rank raises the same stop, and the controller fetches one; Ray would log each other
    rank's copy with its traceback ("Unhandled error") when its ref is dropped. The stop is
    reported once, in one line: those copies are not logged."""
    marker = f"RayTaskError({type(cause).__name__})"

    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Unhandled error") and marker in message)

    logging.getLogger("ray._private.worker").addFilter(keep)


class Trainer:
    """Runs a graph: ``fit()`` sets up, iterates, checkpoints, recovers and saves the actor.

    ``verbose=False`` sends the workers' own output (library warnings and logs) to
    ``RUN_DIR/workers.log`` instead of the console, where this process starts Ray.
    ``resume=True`` continues the run in ``run_dir`` (default: the newest run under
    ``trainer.save_dir`` that has a checkpoint) from its newest complete checkpoint.
    ``callbacks`` are called as ``cb(trainer, iteration, metrics)`` after each iteration's
    metrics are logged and before its checkpoint (tests use them to inject faults).
    ``extra_state`` maps names to objects with ``state_dict()``/``load_state_dict()`` that the
    controller keeps across iterations (a KL controller, a Lagrange multiplier); they are
    checkpointed and restored with the run. (Workers have the same hook:
    ``WorkerContext.extra_state``.) ``worker_cls``: the worker host class every pool runs
    (tests install a subclass with fault hooks).
    """

    worker_cls: type[ModelWorker] = ModelWorker

    def __init__(
        self,
        graph: Graph,
        address: str | None = None,
        run_dir: str | None = None,
        resume: bool = False,
        verbose: bool = True,
    ):
        self.graph = graph
        self.verbose = verbose
        self.spec = graph.spec
        # Ray's own convention: RAY_ADDRESS (as `ray job submit` sets it) names the cluster to join.
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.resume = resume
        options = self.spec.trainer
        self.dirs = RunDir.choose(options.save_dir.format(name=self.spec.name), run_dir, resume)
        self.groups: dict[str, WorkerGroup] = {}
        self.pools: list[ResourcePool] = []
        self.history: list[dict] = []
        self.callbacks: list[Callable[[Trainer, int, dict], None]] = []
        self.extra_state: dict[str, object] = {}
        self._pending_syncs: deque[list] = deque()  # weight loads into a standalone rollout, per update
        self.ahead: AheadGeneration | None = None  # trainer.async.mode one_step_off / streaming (_setup)
        self.nan_guard = NanGuard(options.nan_tolerance)
        self.recovery = Recovery(self.dirs.events, options.max_restarts)
        self.elastic = Elastic(self.recovery) if options.elastic else None
        self.checkpointer = Checkpointer(self.dirs, graph, self.extra_state)
        self.started = time.perf_counter()  # fit() restarts it once set up

    @property
    def run_dir(self) -> Path:
        return self.dirs.path

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
            self.started = time.perf_counter()
            total = self.spec.trainer.iterations
            last = min(total, stop_after or total)
            resume_from = self.checkpointer.latest_intact() if self.resume else None
            if self.resume and resume_from is None:
                log.warning("--resume: %s has no complete checkpoint; starting from the beginning", self.run_dir)
            done = self._restore(resume_from, rewind=self.resume)
            if self.resume and self.history:  # the run clock goes on from the rows kept
                self.started -= float(self.history[-1].get("timing/wall_s", 0.0))
            # Redraws of a bar are noise in a log file or a pipe: there the console logger's
            # line every log_interval iterations is the progress.
            shown = self.spec.trainer.progress and sys.stdout.isatty() and sys.stderr.isatty()
            bar = tqdm(total=total, initial=done, desc=self.spec.name, disable=not shown, dynamic_ncols=True)
            while done < last:
                try:
                    metrics = self._iterate(done + 1)
                except Exception as exc:
                    if not self.recovery.workers_lost(exc, self.groups):
                        raise
                    done = self._recover(exc, done + 1)
                    bar.reset(total=total)
                    bar.update(done)
                    continue
                done += 1
                bar.update(1)
                bar.set_postfix({short: f"{metrics[k]:.3f}" for k, short in PROGRESS_KEYS.items() if k in metrics})
            bar.close()
            if self.spec.trainer.save_final and done == total:
                if self.graph.actor is not None:
                    self.save_actor(self.run_dir / "actor")
                for model in dict.fromkeys(n.model for n in self.pair_nodes()):
                    self.save_scalar(model, self.run_dir / model)
        finally:
            self.shutdown()
        return self.summary(time.perf_counter() - started)

    def _iterate(self, iteration: int) -> dict:
        """One iteration, then the NaN guard's verdict, then the checkpoint if one is due."""
        with _one_line_stop(f"at iteration {iteration}"):
            metrics = self.step(iteration)
        for callback in self.callbacks:
            callback(self, iteration, metrics)
        self.nan_guard.check(iteration, self.checkpointer.latest())
        interval = self.spec.trainer.save_interval
        if interval and (iteration % interval == 0 or iteration == self.spec.trainer.iterations):
            self.save_checkpoint(iteration)
        return metrics

    def step(self, iteration: int) -> dict:
        t0 = time.perf_counter()
        options = self.spec.trainer
        if self.ahead is not None:  # generation k+K goes before update k
            prompts, launched = self.ahead.take(self.groups, remaining=options.iterations - iteration, iteration=iteration)
        else:
            prompts, launched = self._put(self.dataset.next_batch()), None
        result = run_nodes(
            self.graph, list(self.graph.nodes), self.groups, prompts, serial=options.serial,
            more_prompts=lambda: self._put(self.dataset.next_batch()),  # dynamic sampling's refills
            launched=launched, record=self._record(iteration),
        )
        if options.trace_interval and iteration % options.trace_interval == 0:
            trace_file = self.dirs.trace(iteration)
            trace_file.parent.mkdir(exist_ok=True)
            trace_file.write_text(json.dumps(chrome_trace(result.timeline, iteration)))
        metrics = {"iteration": iteration, **result.metrics}
        # Loads queue behind the generations ahead; with partial rollouts they run beside them
        # and are waited for, so that every generation submitted later starts on them (or newer).
        partial = self.spec.trainer.async_.partial_rollout != "off"
        metrics.update(self._sync_standalone_rollouts(keep=self.ahead.queued if self.ahead and not partial else 0))
        metrics["timing/iteration"] = time.perf_counter() - t0
        tokens = metrics.get("rollout/num_tokens", 0.0)
        metrics["throughput/tokens_per_s"] = tokens / metrics["timing/iteration"]
        interval = self.spec.trainer.val_interval
        if interval and (iteration % interval == 0 or iteration == self.spec.trainer.iterations):
            metrics.update(self.validate())
        # What a comparison of two algorithms' cost plots against (`hybridflow plot --x wall`):
        # from the end of setup, whose time (Ray, workers) follows the machine's load more
        # than the algorithm; validation included.
        metrics["timing/wall_s"] = time.perf_counter() - self.started
        self.nan_guard.observe(metrics)
        self.logger.log(metrics, {name: out.metas for name, out in result.outputs.items()})
        self.history.append(metrics)
        return metrics

    def _record(self, iteration: int) -> dict[str, str]:
        """``trainer.record``'s nodes at ``iteration`` -> the directories they record into."""
        record = self.spec.trainer.record
        if record is None or iteration not in record.iterations:
            return {}
        return {name: str(recording.record_dir(self.run_dir.resolve(), iteration, name)) for name in record.nodes}

    # -- phases -----------------------------------------------------------------------------

    def _setup(self) -> None:
        # Every user input is checked before anything is written or started.
        check_engines_installed(self.graph)
        check_model_paths(self.graph)
        tokenizer = run_tokenizer(self.graph)
        check_inputs(self.graph, tokenizer)
        try:
            if self.graph.reads_pairs:
                self._setup_pairs(tokenizer)
            else:
                self._setup_prompts(tokenizer)
        except DataError as exc:
            raise SpecError(self.graph.file, exc.field, str(exc)) from None
        self._start(tokenizer)

    def _setup_prompts(self, tokenizer) -> None:
        spec = self.spec
        train_rows, val_rows = load_data(spec.data, self.graph.file)
        check_score_inputs(self.graph, train_rows + val_rows)
        self.dataset = PromptDataset(
            train_rows,
            tokenizer,
            spec.data.max_prompt_length,
            spec.data.prompts_per_iteration,
            spec.data.shuffle,
            spec.data.seed,
            system_prompt=spec.data.system_prompt,
        )
        ranks = self._val_ranks()
        val_rows = val_rows[: len(val_rows) // ranks * ranks]
        self.val_prompts = (
            collate_prompts(val_rows, tokenizer, spec.data.max_prompt_length,
                            system_prompt=spec.data.system_prompt) if val_rows else None
        )

    def _setup_pairs(self, tokenizer) -> None:
        """Preference pairs (``data.train_files`` first: a bad train row is the first error),
        of the kind the trained model's role asks for (cost pairs carry safety labels)."""
        spec = self.spec
        kind = "cost" if any(spec.models[n.model].role == "cost" for n in self.pair_nodes()) else "reward"
        train_rows, val_rows = load_pair_data(spec.data, self.graph.file, kind)
        args = (tokenizer, spec.data.max_prompt_length, spec.data.max_response_length)
        self.dataset = PairDataset(train_rows, *args, spec.data.prompts_per_iteration, spec.data.shuffle,
                                   spec.data.seed, system_prompt=spec.data.system_prompt)
        ranks = self._val_ranks()
        val_rows = val_rows[: len(val_rows) // ranks * ranks]
        self.val_prompts = (
            collate_pairs(val_rows, *args, system_prompt=spec.data.system_prompt) if val_rows else None
        )

    def _ahead_generation(self) -> AheadGeneration | None:
        """The generations run ahead of the graph's updates (``trainer.async.ahead`` > 0)."""
        depth = self.spec.trainer.async_.ahead
        return AheadGeneration(self.graph, self.dataset, self._put, depth, self._record) if depth else None

    def _val_ranks(self) -> int:
        """The ranks validation splits its rows over, one equal share each: the actor's
        generation pool's, or the largest pool of a pair node (a graph of preference pairs)."""
        if self.graph.reads_pairs:
            return max(self.graph.pools[self.graph.placement[n.model]].num_devices for n in self.pair_nodes())
        gen_pool = self.graph.rollout_pools.get(self.graph.actor, self.graph.placement[self.graph.actor])
        return self.graph.pools[gen_pool].num_devices

    def pair_nodes(self) -> list:
        return [n for n in self.graph.nodes if "pairs" in n.inputs]

    def _start(self, tokenizer) -> None:
        spec = self.spec
        self.dirs.claim(self.resume)
        if self.resume:
            self.dirs.check_resume(self.graph)
        self.dirs.write_resolved_config(self.graph)
        tokenizer.save_pretrained(self.dirs.tokenizer)
        self.ahead = self._ahead_generation()
        # Generation ahead: the dataset's position and the buffered generations (controller/ahead.py).
        self.checkpointer.components.update(dataset=self.ahead or self.dataset, guard=self.nan_guard)
        self.checkpointer.mark_start()
        self.logger = RunLoggers(spec.trainer, self.run_dir, self.graph.file, name=spec.name)
        tqdm.write(batch_plan(spec, self.graph.layouts, self.graph.file).describe())
        for name, why in self.graph.redundant_nodes().items():
            tqdm.write(f"note: node {name!r} is redundant: {why}")
        if not self.address and not ray.is_initialized():
            mark_run()  # the local Ray about to start is this run's: it ends with the run
        worker_log = start_ray(
            self.address, self.graph.pools.values(), worker_log=None if self.verbose else self.dirs.path / "workers.log"
        )
        if worker_log is not None:
            tqdm.write(f"workers' output (library warnings, engine logs): {worker_log}; --verbose shows it here")
        self._create_pools()
        self._start_groups()

    def _create_pools(self) -> None:
        for pool_name in self.graph.used_pools():
            pool = ResourcePool(pool_name, self.graph.pools[pool_name])
            pool.create()
            self.pools.append(pool)
        if self.elastic is not None:
            self.elastic.watch(self.pools)

    def _start_groups(self) -> None:
        worker_graph = self.graph.with_absolute_sources()  # workers may run in another directory
        for pool in self.pools:
            pool_name = pool.name
            self.groups[pool_name] = WorkerGroup(
                self.worker_cls,
                pool,
                init_kwargs={
                    "graph": worker_graph,
                    "models": self.graph.models_on(pool_name),
                    "rollouts": self.graph.rollouts_on(pool_name),
                    "tokenizer_dir": str(self.dirs.tokenizer.resolve()),
                    "total_steps": self._total_optimizer_steps(),
                },
                name=pool_name,
                # Starting vLLM or importing megatron-core in a worker takes tens of CPU-seconds
                # (minutes on a busy box).
                ready_timeout_s=600.0 if self._slow_start(pool_name) else 120.0,
                # partial rollouts: weights reach a rollout pool while it generates
                side_methods=("receive_weights",) if self._partial_on(pool_name) else (),
            )

    def _partial_on(self, pool_name: str) -> bool:
        return self.spec.trainer.async_.partial_rollout != "off" and pool_name in self.graph.rollout_pools.values()

    def _slow_start(self, pool_name: str) -> bool:
        models = self.spec.models
        return any(
            (models[m].rollout is not None and caps_of(models[m].rollout).slow_start)
            or caps_of(models[m].train).slow_start
            for m in self.graph.models_on(pool_name) + self.graph.rollouts_on(pool_name)
        )

    def _sync_standalone_rollouts(self, keep: int = 0) -> dict[str, float]:
        """Send the actor's weights to its standalone rollout pool (``rollout.pool``), if it has
        one: rank 0 of the training pool publishes them into the object store, every rank of
        the rollout pool loads them after the calls already queued there (the generations run
        ahead sample from the weights before). Returns the metrics (``weight_sync/bytes``,
        ``timing/weight_sync``, ...) of the loads finished by now, waiting only while more than
        ``keep`` are unfinished: the generations queued ahead, which the loads wait behind."""
        for model, pool in self.graph.rollout_pools.items():
            rollout = self.spec.models[model].rollout
            published = self.groups[self.graph.placement[model]].call(
                "publish_weights", model=model, bucket_mb=rollout.sync_bucket_mb
            )
            self._pending_syncs.append(self.groups[pool].call("receive_weights", model=model, published=[published[0]]))
        metrics: dict[str, float] = {}
        while self._pending_syncs:
            oldest = self._pending_syncs[0]
            wait = None if len(self._pending_syncs) > keep else 0
            ready, _ = ray.wait(oldest, num_returns=len(oldest), timeout=wait)
            if len(ready) < len(oldest):
                break
            loads = controller_get(self._pending_syncs.popleft())
            metrics.update(loads[0])
            metrics["timing/weight_sync"] = max(load["timing/weight_sync"] for load in loads)
        return metrics

    def validate(self) -> dict:
        """Greedy generation on the held-out prompts, scored by the graph's score nodes; in a
        graph of preference pairs, the pair nodes score the held-out pairs without a step
        (``val/rm/accuracy``)."""
        if self.val_prompts is None:
            return {}
        if self.graph.reads_pairs:
            scorers = [
                replace(n, spec=n.spec.model_copy(update={"options": n.spec.options.model_copy(update={"train": False})}))
                for n in self.pair_nodes()
            ]
            result = run_nodes(self.graph, scorers, self.groups, self._put(self.val_prompts))
            return {f"val/{k}": v for k, v in result.metrics.items() if k.startswith("rm/")}
        generate = next(n for n in self.graph.nodes if self.graph.op(n).generates)
        options = generate.spec.options.model_copy(update={"greedy": True})  # keeps the rest (env, turns)
        greedy = replace(generate, spec=generate.spec.model_copy(update={"options": options}))
        scorers = [
            n
            for n in self.graph.nodes
            if self.graph.op(n).scores and set(self.graph.producers(n).values()) <= {generate.name, SOURCE}
        ]
        result: IterationResult = run_nodes(self.graph, [greedy, *scorers], self.groups, self._put(self.val_prompts))
        return {
            f"val/{k}": v
            for k, v in result.metrics.items()
            if not k.startswith("timing/") and not k.startswith("rollout/num")
        }

    # -- checkpoints and recovery -------------------------------------------------------------

    def save_checkpoint(self, iteration: int) -> Path:
        """Checkpoint the state after ``iteration`` (``Checkpointer.save``)."""
        return self.checkpointer.save(iteration, self.groups)

    def _restore(self, path: Path | None, rewind: bool = True) -> int:
        """Go back to checkpoint ``path`` (None: the run's start) and cut every per-iteration
        file back to it (``rewind``; a fresh run has nothing to cut); returns its iteration."""
        with _one_line_stop(f"after loading {path}" if path is not None else "at the start"):
            done, self.history = self.checkpointer.restore(path, self.groups)
            self._pending_syncs.clear()  # loads into workers that were restarted, or done
            self._sync_standalone_rollouts()  # the restored (or initial) weights, version ``done``
        if rewind:
            self.logger.rewind(done)
            self.dirs.drop_traces_after(done)
        return done

    def _recover(self, exc: BaseException, iteration: int) -> int:
        """Restart every worker group and go back to the newest checkpoint; returns its
        iteration. Gives up (RunStopped) after ``trainer.max_restarts`` recoveries. With
        ``trainer.elastic``, a lost node first shrinks the pools to what is left (``_reshape``)."""
        path = self.checkpointer.latest_intact()
        self.recovery.begin(exc, path)
        for group in self.groups.values():
            group.shutdown(graceful=False)
        self.groups = {}
        shrunk = self.elastic.replan(self.graph, iteration) if self.elastic is not None else None
        if shrunk is not None:
            self._reshape(shrunk)
        self._start_groups()
        return self._restore(path)

    def _reshape(self, graph: Graph) -> None:
        """Go on with ``graph`` (the same nodes on resized pools): every placement group is
        removed and created again at its new size."""
        for pool in self.pools:
            pool.remove()
        self.pools = []
        self.graph, self.spec = graph, graph.spec
        self.checkpointer.graph = graph
        if self.val_prompts is not None:  # an equal share for each rank left
            ranks = self._val_ranks()
            keep = len(self.val_prompts) // ranks * ranks
            self.val_prompts = self.val_prompts[:keep] if keep else None
        if self.ahead is not None:
            self.ahead = self._ahead_generation()
            self.checkpointer.components.update(dataset=self.ahead)
        self._create_pools()

    def save_actor(self, path: Path) -> None:
        group = self.groups[self.graph.placement[self.graph.actor]]
        ray.get(group.call("save_hf", model=self.graph.actor, path=str(path.resolve())))
        # With its tokenizer the saved actor is a whole model: another graph's source
        # (`source: {run: ...}`), `hybridflow eval --actor`, or transformers itself.
        for target in (path, path / "merged"):
            if target.is_dir():
                shutil.copytree(self.dirs.tokenizer, target, dirs_exist_ok=True)

    def save_scalar(self, model: str, path: Path) -> None:
        """A reward or cost model as a plain HF scalar model (``engines.scalar_model``)."""
        group = self.groups[self.graph.placement[model]]
        ray.get(group.call("save_scalar", model=model, path=str(path.resolve())))

    def shutdown(self) -> None:
        if hasattr(self, "logger"):
            self.logger.close()
        for group in self.groups.values():
            group.shutdown()
        for pool in self.pools:
            pool.remove()
        self.groups, self.pools = {}, []

    def summary(self, seconds: float) -> dict:
        # A graph training a scalar model on pairs has no rewards: its pairwise accuracy instead.
        key, name = ("rm/accuracy", "rm_accuracy") if self.graph.reads_pairs else ("reward/mean", "reward")
        values = [m[key] for m in self.history if key in m]
        window = min(10, len(values))
        val = [m[f"val/{key}"] for m in self.history if f"val/{key}" in m]
        return {
            "run_dir": str(self.run_dir),
            # the last iteration's number: a row lost to a cut metrics line is not a lost iteration
            "iterations": self.history[-1].get("iteration", len(self.history)) if self.history else 0,
            f"{name}_first10": sum(values[:window]) / max(window, 1),
            f"{name}_last10": sum(values[-window:]) / max(window, 1),
            f"val_{name}_final": val[-1] if val else None,
            "restarts": self.recovery.num_restarts,
            "seconds": round(seconds, 1),
        }

    # -- helpers ----------------------------------------------------------------------------

    def _put(self, batch) -> ShardedRef:
        return ShardedRef.put(batch)

    def _total_optimizer_steps(self) -> int:
        updates = [n for n in self.graph.nodes if self.graph.op(n).trains]
        per_iteration = max((n.spec.options.mini_batches * n.spec.options.epochs for n in updates), default=1)
        return self.spec.trainer.iterations * per_iteration
