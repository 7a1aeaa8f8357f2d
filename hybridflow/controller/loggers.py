"""Where a run's metrics and sample generations go, as chosen by ``trainer.loggers``.

- ``metrics.jsonl`` (always): one JSON object per iteration (``JsonlLogger``).
- ``console``: a line of the key metrics every ``trainer.log_interval`` iterations, written
  above the progress bar.
- ``tensorboard`` (optional dependency): every metric as a scalar under ``RUN_DIR/tensorboard``.
- ``samples.jsonl``: every ``trainer.sample_interval`` iterations, a few generations decoded on
  the workers (prompt, response, reward) so a user can read what the model says.

The controller only ever sees small dicts here: metrics and a handful of strings from the score
workers' meta, never rollout tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from hybridflow.controller.metrics import JsonlLogger
from hybridflow.spec.graph import TrainerSpec
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
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line)["iteration"] <= iteration]
        if len(kept) != len(lines):
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            tmp.replace(self.path)


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

    def __init__(self, trainer: TrainerSpec, run_dir: Path, file: str, iterations: int | None = None):
        iterations = iterations or trainer.iterations
        self.loggers: list = [JsonlLogger(run_dir / "metrics.jsonl")]
        for name in dict.fromkeys(trainer.loggers):
            if name == "console":
                self.loggers.append(ConsoleLogger(trainer.log_interval, iterations))
            elif name == "tensorboard":
                self.loggers.append(TensorBoardLogger(run_dir / "tensorboard", file))
        self.samples = SampleWriter(
            run_dir / "samples.jsonl", trainer.sample_interval, iterations, trainer.num_logged_samples
        )

    def log(self, record: dict, metas_by_node: dict[str, Iterable[dict]] | None = None) -> None:
        for logger in self.loggers:
            logger.log(record)
        if metas_by_node is not None:
            self.samples.write(int(record["iteration"]), samples_from_metas(metas_by_node))

    def rewind(self, iteration: int) -> None:
        """Back to the end of ``iteration`` (a checkpoint's): every per-iteration file but
        metrics.jsonl, which the checkpointer cuts itself, and events.jsonl, the audit log."""
        self.samples.rewind(iteration)
        for logger in self.loggers:
            if hasattr(logger, "rewind"):
                logger.rewind(iteration)

    def close(self) -> None:
        for logger in self.loggers:
            if hasattr(logger, "close"):
                logger.close()
