"""A run's directory: which one a run writes to, whether it may, and the files in it.

    RUN_DIR/graph.yaml     the graph as run: overrides applied, placement and layouts resolved
    RUN_DIR/tokenizer/     the tokenizer, saved for the workers (and for using the saved actor)
    RUN_DIR/metrics.jsonl  one row of metrics per iteration (controller/loggers.py)
    RUN_DIR/samples.jsonl  a few decoded generations every trainer.sample_interval iterations
    RUN_DIR/prompts.jsonl  the uids of the prompts each iteration trained on (controller/loggers.py)
    RUN_DIR/events.jsonl   worker losses and recoveries (controller/recovery.py)
    RUN_DIR/trace/         Chrome traces of every trainer.trace_interval-th iteration
    RUN_DIR/checkpoints/   checkpoints (controller/checkpoint.py)
    RUN_DIR/actor/         the final actor in HF format (trainer.save_final)
"""

from __future__ import annotations

import fnmatch
import logging
import time
from pathlib import Path

import yaml

from hybridflow.controller.checkpoint import complete_checkpoints, latest_checkpoint
from hybridflow.spec.loading import SpecError

log = logging.getLogger(__name__)

# What a resume may change: the run's length and bookkeeping, the learning rate and its schedule,
# and (checkpoints being layout-free) the pools, placement and layouts. Anything else (another
# algorithm, model, data source or seed) the checkpoint cannot honour.
HONOURED_ON_RESUME = (
    "trainer.iterations", "trainer.*_interval", "trainer.keep_last", "trainer.loggers", "trainer.tracking", "trainer.tracking.*",
    "trainer.progress", "trainer.max_restarts", "trainer.elastic", "trainer.nan_tolerance",
    "models.*.train.optim.lr", "models.*.train.optim.schedule", "models.*.train.optim.warmup_steps",
    "models.*.train.optim.min_lr_ratio",
    "resources", "placement.*", "resolved_layouts.*", "models.*.train.layout.*", "models.*.rollout.layout.*",
)


def _items(value) -> dict | None:
    """A mapping's items; a list of named mappings (nodes) by name; None for a leaf."""
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
        return {v["name"]: v for v in value}
    return None


def _diff(old, new, field: str) -> list[tuple[str, object, object]]:
    """``(field, old, new)`` where two resolved graphs differ; a part only one side has (a model,
    a node) is one difference, not one per leaf."""
    a, b = _items(old), _items(new)
    if a is None or b is None:
        return [] if old == new else [(field, old, new)]
    out = []
    for key in [*a, *(k for k in b if k not in a)]:
        sub = f"{field}.{key}" if field else str(key)
        if key not in a or key not in b:
            out.append((sub, a.get(key, "(none)"), b.get(key, "(none)")))
        else:
            out.extend(_diff(a[key], b[key], sub))
    return out


def _engine_swaps(diffs: list[tuple[str, object, object]]) -> set[str]:
    """The ``models.<m>.train`` sections whose engine changes to one that reads the other's
    checkpoints (``EngineCaps.checkpoint_format``: DDP <-> FSDP2)."""
    from hybridflow.spec.engines import engine_names, engine_record

    def format_of(name: object) -> str | None:
        return engine_record("train", name).caps.checkpoint_format if name in engine_names("train") else None

    return {
        field.removesuffix(".engine") for field, old, new in diffs
        if fnmatch.fnmatchcase(field, "models.*.train.engine") and format_of(old) is not None
        and format_of(old) == format_of(new)
    }


def resume_changes(before: dict, after: dict) -> tuple[list[str], list[str]]:
    """The fields that differ between two resolved graphs, as ``"field: old -> new"``, the
    shallowest first: those a resume honours, and those it cannot. A train engine may change to
    one of the same checkpoint format; then the options only one of the two has are honoured
    too (the other options of the section are compared as usual)."""
    honoured, refused = [], []
    diffs = sorted(_diff(before, after, ""), key=lambda d: (d[0].count("."), d[0]))
    swaps = _engine_swaps(diffs)
    for field, old, new in diffs:
        section = field.rpartition(".")[0]
        ok = section in swaps and (field.endswith(".engine") or "(none)" in (old, new))
        ok = ok or any(fnmatch.fnmatchcase(field, pattern) for pattern in HONOURED_ON_RESUME)
        (honoured if ok else refused).append(f"{field}: {_short(old)} -> {_short(new)}")
    return honoured, refused


def _short(value: object, limit: int = 40) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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

    @staticmethod
    def resolved_config(graph) -> dict:
        """The spec as run, with the placement and layouts it resolved to."""
        resolved = graph.spec.model_dump(mode="json")
        resolved["placement"] = dict(graph.placement)
        resolved["resolved_layouts"] = {m: layout.model_dump() for m, layout in graph.layouts.items()}
        return resolved

    def check_resume(self, graph) -> None:
        """Before a resume from a checkpoint writes anything: refuse, in one line naming the
        fields, a graph that changed where the checkpoint cannot follow; log what it honours."""
        if latest_checkpoint(self.path) is None or not self.config.exists():
            return  # nothing to resume from: the run starts over
        honoured, refused = resume_changes(yaml.safe_load(self.config.read_text()), self.resolved_config(graph))
        if refused:
            raise SpecError(
                self.config, "", f"--resume: the graph differs from the checkpointed run's in what a "
                f"resume cannot honour ({'; '.join(refused[:4])}{'; ...' if len(refused) > 4 else ''}); "
                "start it in another --run-dir"
            )
        for change in honoured:
            log.warning("resuming with a changed graph: %s", change)

    def write_resolved_config(self, graph) -> None:
        """``graph.yaml``: the spec as run, with the placement and layouts it resolved to."""
        self.config.write_text(yaml.safe_dump(self.resolved_config(graph), sort_keys=False))

    @property
    def config(self) -> Path:
        return self.path / "graph.yaml"

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

    def drop_traces_after(self, iteration: int) -> None:
        """Remove the traces of iterations after ``iteration``: they are traced again."""
        for trace in (self.path / "trace").glob("iteration_*.json"):
            if int(trace.stem.split("_")[1]) > iteration:
                trace.unlink()

    def metrics_offset(self) -> int:
        """Bytes of metrics.jsonl so far: where a restore cuts it back to."""
        return self.metrics.stat().st_size if self.metrics.exists() else 0
