"""A run's directory: which one a run writes to, whether it may, and the files in it.

    RUN_DIR/graph.yaml     the graph as run: overrides applied, placement and layouts resolved
    RUN_DIR/tokenizer/     the tokenizer, saved for the workers (and for using the saved actor)
    RUN_DIR/metrics.jsonl  one row of metrics per iteration (controller/loggers.py)
    RUN_DIR/samples.jsonl  a few decoded generations every trainer.sample_interval iterations
    RUN_DIR/events.jsonl   worker losses and recoveries (controller/recovery.py)
    RUN_DIR/trace/         Chrome traces of every trainer.trace_interval-th iteration
    RUN_DIR/checkpoints/   checkpoints (controller/checkpoint.py)
    RUN_DIR/actor/         the final actor in HF format (trainer.save_final)
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from hybridflow.controller.checkpoint import complete_checkpoints, latest_checkpoint
from hybridflow.spec.loading import SpecError


class RunDir:
    """The directory of one run and the paths of its files."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def choose(cls, save_dir: str, run_dir: str | None, resume: bool) -> "RunDir":
        """``run_dir`` if given; with ``resume`` and no ``run_dir``, the newest run under
        ``save_dir`` that has a complete checkpoint; otherwise a new timestamped one there."""
        save_root = Path(save_dir)
        if run_dir is None and resume:
            runs = [d for d in save_root.glob("*") if complete_checkpoints(d)] if save_root.is_dir() else []
            if not runs:
                raise SpecError(save_root, "", "--resume: no run with a checkpoint here; give --run-dir")
            run_dir = str(max(runs, key=lambda d: latest_checkpoint(d).stat().st_mtime))
        return cls(run_dir or save_root / time.strftime("%Y%m%d-%H%M%S"))

    def claim(self, resume: bool) -> None:
        """Make the directory this run's, or refuse in one line before anything is written: a
        resume needs the directory; a new run must not go where another run's rows are (they
        would follow the first run's, iterations restarting at 1, and the summary count both)."""
        if resume and not self.path.is_dir():
            raise SpecError(self.path, "", "--resume: run directory not found")
        if not resume and self.metrics.exists() and self.metrics.stat().st_size:
            raise SpecError(
                self.path, "", "already holds a run (metrics.jsonl); --resume continues it, "
                "or choose another --run-dir"
            )
        self.path.mkdir(parents=True, exist_ok=True)

    def write_resolved_config(self, graph) -> None:
        """``graph.yaml``: the spec as run, with the placement and layouts it resolved to."""
        resolved = graph.spec.model_dump(mode="json")
        resolved["placement"] = dict(graph.placement)
        resolved["resolved_layouts"] = {m: layout.model_dump() for m, layout in graph.layouts.items()}
        (self.path / "graph.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def tokenizer(self) -> Path:
        return self.path / "tokenizer"

    def trace(self, iteration: int) -> Path:
        return self.path / "trace" / f"iteration_{iteration:05d}.json"

    def metrics_offset(self) -> int:
        """Bytes of metrics.jsonl so far: where a restore cuts it back to."""
        return self.metrics.stat().st_size if self.metrics.exists() else 0
