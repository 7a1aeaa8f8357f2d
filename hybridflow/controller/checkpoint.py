"""Checkpoints of a whole run: atomic, rotating, layout-free, and the component that takes them.

Layout of ``RUN_DIR/checkpoints/iter_00000006/``::

    meta.json                  format, iteration, time, each pool's ranks, each model's layout,
                               each trained model's engine, and every other file's size and
                               CRC-32 (written last: presence = complete; a resume or recovery
                               skips a checkpoint whose files do not match, with a warning)
    controller.pt              data position, controller RNG states, iteration counter, metrics
                               offset (bytes of metrics.jsonl), NaN-guard counters, and the
                               state of objects registered in ``Trainer.extra_state``
    models/<model>/            one torch.distributed.checkpoint per trained model: weights,
                               optimizer state (AdamW moments, sharded like the weights) and LR
                               schedule, stored as pieces of the full tensors, so it loads under
                               any layout (``workers/checkpointing.py``)
    pool_<name>/rank_00000.pt  each rank's torch RNG state and the worker's ``extra_state``

A checkpoint is written into ``checkpoints/.tmp-iter_00000006-<pid>`` and renamed into place
(``os.replace``, atomic on POSIX) only when every file is written and synced, so a crash or a
kill at any moment leaves the previous checkpoint untouched and a ``.tmp-*`` directory that the
next save deletes. After a save, all but the newest ``keep_last`` checkpoints are deleted.

A resume under another layout (another pool file, other tp/pp/dp) says in one log line what
changed; weights, optimizer state, LR schedule and data position carry over exactly, per-rank
RNG streams of a pool whose number of ranks changed restart from seeds (see
``workers/checkpointing.py``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch

from hybridflow.controller.recovery import RunStopped
from hybridflow.spec.loading import SpecError
from hybridflow.workers.errors import NonFiniteWeightError
from hybridflow.workers.recording import rng_states, set_rng_states

if TYPE_CHECKING:
    from hybridflow.controller.run_dir import RunDir
    from hybridflow.graph.dag import Graph

CHECKPOINTS = "checkpoints"
META = "meta.json"
CONTROLLER = "controller.pt"
FORMAT = 2  # 1: one torch.save per rank in the rank's own layout (before layout-free checkpoints)
_NAME = re.compile(r"^iter_(\d{8})$")
log = logging.getLogger(__name__)

__all__ = [
    "Checkpointer", "ControllerRng", "RunStopped", "checkpoint_dir", "complete_checkpoints",
    "latest_checkpoint", "latest_intact_checkpoint", "load_controller_state", "truncate_metrics",
    "write_checkpoint",
]


def checkpoint_dir(run_dir: Path, iteration: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"iter_{iteration:08d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / META).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_digests(checkpoint: Path) -> dict[str, list[int]]:
    """``{relative path: [bytes, crc32]}`` of every file of a checkpoint but meta.json."""
    return {
        str(f.relative_to(checkpoint)): [f.stat().st_size, _crc32(f)]
        for f in sorted(checkpoint.rglob("*")) if f.is_file() and f.name != META
    }


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a complete checkpoint's files (None: intact, or too old to tell)."""
    expected = json.loads((checkpoint / META).read_text()).get("files")
    if expected is None:
        return None
    found = file_digests(checkpoint)
    for name, (size, crc) in expected.items():
        if name not in found:
            return f"{name} is missing"
        if found[name][0] != size:
            return f"{name} has {found[name][0]} bytes, {size} were written"
        if found[name][1] != crc:
            return f"{name} does not match its checksum"
    return None


def latest_intact_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint whose files match meta.json's sizes and checksums; each
    newer damaged one is skipped with a warning line naming it."""
    for checkpoint in reversed(complete_checkpoints(run_dir)):
        try:
            problem = damage(checkpoint)
        except (OSError, ValueError) as exc:  # unreadable meta.json or file
            problem = f"unreadable ({exc.__class__.__name__}: {exc})"
        if problem is None:
            return checkpoint
        log.warning("skipping damaged checkpoint %s: %s", checkpoint, problem)
    return None


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with file.open("rb") as f:
                os.fsync(f.fileno())
    for directory in [path, *[d for d in path.rglob("*") if d.is_dir()]]:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_checkpoint(
    run_dir: Path,
    iteration: int,
    groups: dict[str, Any],
    controller_state: dict,
    meta: dict,
    keep_last: int,
) -> Path:
    """Write the checkpoint of ``iteration`` atomically; returns its directory.

    ``groups`` are the run's worker groups by pool name; every rank writes its part
    (``ModelWorker.save_checkpoint``). Raises whatever a rank raised (e.g. a non-finite weight),
    leaving no new checkpoint.
    """
    root = Path(run_dir).resolve() / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    final = checkpoint_dir(root.parent, iteration)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        refs = []
        for name, group in groups.items():
            (tmp / f"pool_{name}").mkdir()
            refs += group.call("save_checkpoint", path=str(tmp), pool=name)
        ray.get(refs)
        torch.save(controller_state, tmp / CONTROLLER)
        _fsync_tree(tmp)
        record = {"format": FORMAT, "iteration": iteration, "time": time.time(), **meta, "files": file_digests(tmp)}
        (tmp / META).write_text(json.dumps(record))
        _fsync_tree(tmp)
        if final.exists():  # the same iteration saved again after a recovery
            shutil.rmtree(final)
        os.replace(tmp, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in complete_checkpoints(root.parent)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_controller_state(path: Path) -> dict:
    return torch.load(Path(path) / CONTROLLER, weights_only=False)


def truncate_metrics(path: Path, offset: int) -> list[dict]:
    """Cut ``metrics.jsonl`` back to ``offset`` bytes (rows logged after the checkpoint) and
    return the rows that remain.

    Only whole rows stay: a line cut short (a process killed while writing it, or a file cut
    by hand below ``offset``) is dropped with a warning. The file is never grown: truncating a
    shorter file to ``offset`` would pad it with NUL bytes and no later resume could read it.
    """
    path = Path(path)
    if not path.exists():
        return []
    with path.open("rb") as f:
        data = f.read(offset)
    rows, kept, dropped = [], [], 0
    for line in data.splitlines(keepends=True):
        try:
            row = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
            kept.append(line)
        elif line.strip():
            dropped += 1
    whole = b"".join(kept)
    if data.startswith(whole):
        with path.open("r+b") as f:
            f.truncate(len(whole))
    else:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(whole)
        os.replace(tmp, path)
    if dropped:
        log.warning("%s: dropped %d cut or unreadable line%s before resuming", path, dropped,
                    "" if dropped == 1 else "s")
    return rows


class ControllerRng:
    """The controller process's python, numpy and torch RNG states, as one checkpointed object."""

    def state_dict(self) -> dict:
        return rng_states()

    def load_state_dict(self, state: dict) -> None:
        set_rng_states(state)


class Checkpointer:
    """Saves a run after an iteration and brings it back, under its layout or another one.

    The controller's part is ``components`` (name -> object with ``state_dict()`` and
    ``load_state_dict()``: the dataset, the NaN guard, the controller RNG, registered by the
    trainer) and ``extra`` (``Trainer.extra_state``, read at every save); the workers save and
    load their own part through their groups.
    """

    def __init__(self, run_dir: RunDir, graph: Graph, extra: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.graph = graph
        self.extra = extra
        self.components: dict[str, Any] = {"rng": ControllerRng()}
        self._start: dict | None = None

    def latest(self) -> Path | None:
        return latest_checkpoint(self.run_dir.path)

    def latest_intact(self) -> Path | None:
        """What a resume or a recovery goes back to: the newest checkpoint that is not damaged."""
        return latest_intact_checkpoint(self.run_dir.path)

    def mark_start(self) -> None:
        """Remember the state before the first iteration: what a restore without a checkpoint
        goes back to (fresh workers are in that state)."""
        self._start = self._controller_state(0, metrics_offset=0)

    def _controller_state(self, iteration: int, metrics_offset: int) -> dict:
        return {
            "iteration": iteration,
            "metrics_offset": metrics_offset,
            **{name: c.state_dict() for name, c in self.components.items()},
            "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
        }

    def _meta(self) -> dict:
        graph = self.graph
        trained = dict.fromkeys(n.model for n in graph.nodes if graph.op(n).trains)
        return {
            # every pool that runs something: a standalone rollout's ranks keep their sampling
            # RNG streams across a resume only when its pool is known to have kept its size
            "pools": {name: graph.pools[name].num_devices for name in graph.used_pools()},
            "layouts": {m: layout.model_dump(include={"tp", "pp", "dp"}) for m, layout in graph.layouts.items()},
            "engines": {m: graph.spec.models[m].train.engine for m in trained},
        }

    def save(self, iteration: int, groups: dict[str, Any]) -> Path:
        """Checkpoint the state after ``iteration``; a non-finite weight stops the run instead
        (``RunStopped``), leaving the previous checkpoint the newest."""
        state = self._controller_state(iteration, self.run_dir.metrics_offset())
        keep_last = self.graph.spec.trainer.keep_last
        try:
            return write_checkpoint(self.run_dir.path, iteration, groups, state, self._meta(), keep_last)
        except NonFiniteWeightError as exc:
            cause = getattr(exc, "cause", exc)
            raise RunStopped(
                f"stopping at iteration {iteration}: {cause}; last checkpoint: {self.latest() or 'none'}"
            ) from None

    def restore(self, path: Path | None, groups: dict[str, Any]) -> tuple[int, list[dict]]:
        """Go back to checkpoint ``path`` (None: the run's start, with fresh workers) and cut
        the metrics logged after it. Returns the iteration it was taken after and the metrics
        rows that remain."""
        if path is None:
            state = self._start
        else:
            meta = json.loads((Path(path) / META).read_text())
            self._check_compatible(path, meta)
            refs = []
            for name, group in groups.items():
                same_ranks = meta["pools"].get(name) == self.graph.pools[name].num_devices
                refs += group.call("load_checkpoint", path=str(Path(path).resolve()), pool=name,
                                   same_ranks=same_ranks, iteration=meta["iteration"])
            ray.get(refs)
            state = load_controller_state(path)
        for name, component in self.components.items():
            component.load_state_dict(state[name])
        for name, value in state["extra"].items():
            self.extra[name].load_state_dict(value)
        history = truncate_metrics(self.run_dir.metrics, state["metrics_offset"])
        if path is not None:
            log.warning("resumed %s from %s (iteration %d)", self.run_dir.path, path, state["iteration"])
        return state["iteration"], history

    def _check_compatible(self, path: Path, meta: dict) -> None:
        """Refuse a checkpoint this run cannot load (one line); log what changed otherwise."""
        if meta.get("format") != FORMAT:
            raise SpecError(path, "", "written by an older hybridflow (per-rank checkpoint files); "
                            "resume it with that version, or start a new run")
        for model, engine in self._meta()["engines"].items():
            saved = meta["engines"].get(model)
            if saved is None:
                raise SpecError(path, f"models.{model}", "this trained model is not in the checkpoint")
            if saved != engine and not _same_checkpoint_format(saved, engine):
                raise SpecError(path, f"models.{model}.train.engine",
                                f"saved by the {saved!r} engine; resume with train.engine {saved!r}")
        changes = layout_changes(meta, self._meta())
        if changes:
            log.warning("resuming iteration %d under another layout: %s", meta["iteration"], "; ".join(changes))


def _same_checkpoint_format(saved: str, engine: str) -> bool:
    """Whether train engine ``engine`` reads what ``saved`` wrote (torch DDP <-> FSDP2)."""
    from hybridflow.spec.engines import engine_names, engine_record

    if saved not in engine_names("train"):
        return False
    formats = {engine_record("train", name).caps.checkpoint_format for name in (saved, engine)}
    return len(formats) == 1 and None not in formats


def layout_changes(saved: dict, now: dict) -> list[str]:
    """What differs between two checkpoint metas' pools and layouts, for the resume log line."""
    def shown(layout: dict) -> str:
        return " ".join(f"{k}={v}" for k, v in layout.items())

    changes = [
        f"{model} {shown(saved['layouts'][model])} -> {shown(layout)}"
        for model, layout in now["layouts"].items()
        if model in saved["layouts"] and saved["layouts"][model] != layout
    ]
    reseeded = [
        f"pool {pool!r} {saved['pools'][pool] if pool in saved['pools'] else 'new'} -> {ranks} ranks"
        for pool, ranks in now["pools"].items()
        if saved["pools"].get(pool) != ranks
    ]
    if reseeded:
        changes.append(", ".join(reseeded) + " (per-rank RNG streams restart from trainer.seed, rank "
                       "and iteration; weights, optimizer, LR schedule and data position carry over)")
    return changes
