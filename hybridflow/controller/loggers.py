"""Where a run's metrics and sample generations go, as chosen by ``trainer.loggers``.

- ``metrics.jsonl`` (always): one JSON object per iteration (``JsonlLogger``).
- ``console``: a line of the key metrics every ``trainer.log_interval`` iterations, written
  above the progress bar.
- ``tensorboard`` (optional dependency): every metric as a scalar under ``RUN_DIR/tensorboard``.
- ``wandb`` (optional dependency): every metric at step = iteration, the resolved graph as the
  run's config; offline files under ``RUN_DIR/wandb`` unless ``WANDB_API_KEY`` is set.
- ``mlflow`` (optional dependency): every metric at step = iteration, ``graph.yaml`` as an
  artifact; ``MLFLOW_TRACKING_URI`` or a SQLite store under ``RUN_DIR/mlflow``. The run id is
  kept in ``RUN_DIR/mlflow/run_id`` so that a resumed run continues the same MLflow run.
- ``samples.jsonl``: every ``trainer.sample_interval`` iterations, a few generations decoded on
  the workers (prompt, response, reward) so a user can read what the model says.
- ``prompts.jsonl`` (always): per iteration, the uids of the prompts it trained on
  (``PromptLog``): a resumed or recovered run's record that no prompt was skipped or trained twice.

The controller only ever sees small dicts here: metrics and a handful of strings from the score
workers' meta, never rollout tensors.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from hybridflow.controller.metrics import JsonlLogger
from hybridflow.spec.graph import TrackingSpec, TrainerSpec
from hybridflow.spec.loading import SpecError

# metric -> short name in the console line, in order
CONSOLE_KEYS = {
    "reward/mean": "reward",
    "val/reward/mean": "val",
    "actor/kl": "kl",
    "actor/entropy": "entropy",
    "response_length/mean": "len",
    "timing/iteration": "s/it",
}


class ConsoleLogger:
    """Prints ``iter N/M  reward 0.512  kl 0.003 ...`` every ``interval`` iterations and the last."""

    def __init__(self, interval: int, iterations: int):
        self.interval, self.iterations = interval, iterations

    def log(self, record: dict) -> None:
        iteration = int(record.get("iteration", 0))
        if iteration % self.interval and iteration != self.iterations:
            return
        parts = [f"iter {iteration}/{self.iterations}"]
        parts += [f"{short} {record[key]:.3f}" for key, short in CONSOLE_KEYS.items() if key in record]
        tqdm.write("  ".join(parts))

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Every numeric metric as a TensorBoard scalar at step = iteration."""

    def __init__(self, log_dir: Path, file: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise SpecError(
                file, "trainer.loggers", "'tensorboard' needs the tensorboard package: pip install tensorboard"
            ) from None
        self.log_dir, self._writer_cls = log_dir, SummaryWriter
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def rewind(self, iteration: int) -> None:
        """Hide the events of the iterations after ``iteration`` (TensorBoard's purge_step):
        they are logged again after a resume or a recovery."""
        self.writer.close()
        self.writer = self._writer_cls(log_dir=str(self.log_dir), purge_step=iteration + 1)

    def log(self, record: dict) -> None:
        step = int(record.get("iteration", 0))
        for key, value in record.items():
            if key != "iteration" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _numeric(record: dict) -> dict[str, float]:
    """The record's metrics a tracker takes: numbers, without the step itself."""
    return {
        key: float(value) for key, value in record.items()
        if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def _missing(file: str, name: str, package: str):
    return SpecError(file, "trainer.loggers", f"'{name}' needs the {package} package: pip install 'hybridflow[{name}]'")


class WandbLogger:
    """Every numeric metric at step = iteration in a Weights & Biases run.

    Without ``WANDB_API_KEY`` (and no ``WANDB_MODE`` of the user's) the run is offline: its files
    stay under ``RUN_DIR/wandb`` for ``wandb sync`` later, and nothing touches the network."""

    def __init__(self, run_dir: Path, file: str, tracking: TrackingSpec, project: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise _missing(file, "wandb", "wandb") from None
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        (run_dir / "wandb").mkdir(exist_ok=True)
        id_file = run_dir / "wandb" / "run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=tracking.project or project, name=tracking.run_name or run_dir.name,
            tags=list(tracking.tags), config=config, dir=str(run_dir), mode=mode, id=run_id,
            resume="allow" if mode == "online" else None,
            # console="off": wandb must not wrap the controller's stdout (the progress bar, the summary)
            settings=wandb.Settings(console="off", quiet=True, silent=True, x_disable_stats=True),
        )

    def log(self, record: dict) -> None:
        self.run.log(_numeric(record), step=int(record.get("iteration", 0)))

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() returns before wandb's service has written the run's offline file out; it is
        # complete once the service stops (as at process exit). Stop it now, unless the
        # process holds another run of the user's, so the run dir is whole when fit() returns.
        if wandb.run is None:
            wandb.teardown()


# MLflow metric names: letters, digits, and _ - . / and space (anything else is replaced by _).
_MLFLOW_BAD = re.compile(r"[^\w\-. /]")


def mlflow_key(key: str) -> str:
    """The name a metric of metrics.jsonl gets in MLflow."""
    return _MLFLOW_BAD.sub("_", key)


class MlflowLogger:
    """Every numeric metric at step = iteration in one MLflow run, through MLflow's client.

    The store is ``MLFLOW_TRACKING_URI`` if set, else SQLite at ``RUN_DIR/mlflow/mlflow.db``
    (artifacts beside it). The run id is written to ``RUN_DIR/mlflow/run_id``: a resumed run
    logs into the same MLflow run. After a resume or a recovery the iterations run again are
    logged again at the same steps (MLflow cannot delete a point; the latest is the one shown)."""

    BATCH = 1000  # MLflow's limit of metrics per log_batch call

    def __init__(self, run_dir: Path, file: str, tracking: TrackingSpec, project: str, config_file: Path):
        try:
            from mlflow.entities import Metric
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing(file, "mlflow", "mlflow") from None
        # The store's schema migration logs a line per step at INFO: not the user's business.
        for name in ("mlflow.store.db.utils", "alembic", "alembic.runtime.migration"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._metric = Metric
        home = run_dir / "mlflow"
        home.mkdir(exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(home / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        id_file = home / "run_id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = tracking.project or project
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        elif "MLFLOW_TRACKING_URI" in os.environ:
            experiment_id = self.client.create_experiment(name)
        else:
            experiment_id = self.client.create_experiment(name, artifact_location=(home / "artifacts").resolve().as_uri())
        tags = {"hybridflow.run_dir": str(run_dir.resolve()), **{tag: "true" for tag in tracking.tags}}
        run = self.client.create_run(experiment_id, run_name=tracking.run_name or run_dir.name, tags=tags)
        self.run_id = run.info.run_id
        id_file.write_text(self.run_id)
        if config_file.is_file():
            self.client.log_artifact(self.run_id, str(config_file))

    def log(self, record: dict) -> None:
        step, stamp = int(record.get("iteration", 0)), int(time.time() * 1000)
        metrics = [self._metric(mlflow_key(k), v, stamp, step) for k, v in _numeric(record).items()]
        for start in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + self.BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class SampleWriter:
    """Appends ``{"iteration", "node", "prompt", "response", <score name>, ...}`` rows."""

    def __init__(self, path: Path, interval: int, iterations: int, limit: int):
        self.path, self.interval, self.iterations, self.limit = path, interval, iterations, limit

    def due(self, iteration: int) -> bool:
        return bool(self.interval) and (iteration % self.interval == 0 or iteration == self.iterations)

    def write(self, iteration: int, samples_by_node: dict[str, list[dict]]) -> int:
        """Write up to ``limit`` samples per node if ``iteration`` is due; returns rows written."""
        if not self.due(iteration):
            return 0
        rows = [
            {"iteration": iteration, "node": node, **sample}
            for node, samples in samples_by_node.items()
            for sample in samples[: self.limit]
        ]
        with self.path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        return len(rows)

    def rewind(self, iteration: int) -> None:
        """Drop the rows of the iterations after ``iteration``: they are written again."""
        rewind_rows(self.path, iteration)


def rewind_rows(path: Path, iteration: int) -> None:
    """Keep the whole rows of ``path`` (JSON lines with an ``iteration``) up to ``iteration``.
    A line cut short (the controller killed while appending it) is dropped, not an error."""
    if not path.exists():
        return
    lines = path.read_bytes().splitlines(keepends=True)

    def kept(line: bytes) -> bool:
        try:
            row = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            return False
        return isinstance(row, dict) and row.get("iteration", iteration + 1) <= iteration

    rows = [line for line in lines if kept(line)]
    if len(rows) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(rows))
        os.replace(tmp, path)


class PromptLog:
    """``prompts.jsonl``: per iteration, ``{"iteration": N, "uids": [...]}``, the uids of the
    prompts whose samples that iteration's training nodes trained on (after any filter),
    sorted. A uid is the prompt's place in the run's stream of drawn prompts (0, 1, ... across
    epochs, restored with the data position): the same prompt draw has the same uid in every
    run of the graph, so a uid listed twice was trained twice and a missing one was skipped."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, iteration: int, metas_by_node: dict[str, Iterable[dict]]) -> None:
        uids = {uid for metas in metas_by_node.values() for meta in metas for uid in meta.get("trained_uids", ())}
        with self.path.open("a") as f:
            f.write(json.dumps({"iteration": iteration, "uids": sorted(uids)}) + "\n")

    def rewind(self, iteration: int) -> None:
        rewind_rows(self.path, iteration)


def samples_from_metas(metas_by_node: dict[str, Iterable[dict]]) -> dict[str, list[dict]]:
    """The ``samples`` lists workers put in their meta, concatenated over ranks, per node."""
    out = {}
    for node, metas in metas_by_node.items():
        samples = [sample for meta in metas for sample in meta.get("samples", ())]
        if samples:
            out[node] = samples
    return out


class RunLoggers:
    """The loggers a graph file chose, plus the always-on JSONL file and sample writer."""

    def __init__(
        self, trainer: TrainerSpec, run_dir: Path, file: str, iterations: int | None = None, name: str = "hybridflow"
    ):
        iterations = iterations or trainer.iterations
        self.loggers: list = [JsonlLogger(run_dir / "metrics.jsonl")]
        config_file = run_dir / "graph.yaml"  # the resolved graph, written before the loggers start
        for logger in dict.fromkeys(trainer.loggers):
            if logger == "console":
                self.loggers.append(ConsoleLogger(trainer.log_interval, iterations))
            elif logger == "tensorboard":
                self.loggers.append(TensorBoardLogger(run_dir / "tensorboard", file))
            elif logger == "wandb":
                import yaml

                config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
                self.loggers.append(WandbLogger(run_dir, file, trainer.tracking, name, config))
            elif logger == "mlflow":
                self.loggers.append(MlflowLogger(run_dir, file, trainer.tracking, name, config_file))
        self.samples = SampleWriter(
            run_dir / "samples.jsonl", trainer.sample_interval, iterations, trainer.num_logged_samples
        )
        self.prompts = PromptLog(run_dir / "prompts.jsonl")

    def log(self, record: dict, metas_by_node: dict[str, Iterable[dict]] | None = None) -> None:
        for logger in self.loggers:
            logger.log(record)
        if metas_by_node is not None:
            self.samples.write(int(record["iteration"]), samples_from_metas(metas_by_node))
            self.prompts.write(int(record["iteration"]), metas_by_node)

    def rewind(self, iteration: int) -> None:
        """Back to the end of ``iteration`` (a checkpoint's): every per-iteration file but
        metrics.jsonl, which the checkpointer cuts itself, and events.jsonl, the audit log."""
        self.samples.rewind(iteration)
        self.prompts.rewind(iteration)
        for logger in self.loggers:
            if hasattr(logger, "rewind"):
                logger.rewind(iteration)

    def close(self) -> None:
        for logger in self.loggers:
            if hasattr(logger, "close"):
                logger.close()
