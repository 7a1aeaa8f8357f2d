"""Atomic, rotating checkpoints of a whole run, and finding the newest complete one.

Layout of ``RUN_DIR/checkpoints/iter_00000006/``::

    meta.json                   iteration, pools, time (written last: its presence = complete)
    controller.pt               data position, controller RNG states, iteration counter,
                                metrics offset (bytes of metrics.jsonl), guard counters, and
                                the ``extra`` state of objects registered on the trainer
    pool_<name>/rank_00000.pt   one file per rank: every trained engine's state in that rank's
                                own layout (model, optimizer, scheduler), the rank's torch RNG
                                state and the worker's ``extra_state``

A checkpoint is written into ``checkpoints/.tmp-iter_00000006-<pid>`` and renamed into place
(``os.replace``, atomic on POSIX) only when every file is written and synced, so a crash or a
kill at any moment leaves the previous checkpoint untouched and a ``.tmp-*`` directory that the
next save deletes. After a save, all but the newest ``keep_last`` checkpoints are deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import ray
import torch

CHECKPOINTS = "checkpoints"
META = "meta.json"
CONTROLLER = "controller.pt"
_NAME = re.compile(r"^iter_(\d{8})$")


class RunStopped(RuntimeError):
    """The run stopped on purpose (non-finite updates, a weight to not checkpoint, too many
    worker failures); the message says why and what to do."""


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


def save_checkpoint(
    run_dir: Path,
    iteration: int,
    groups: dict[str, Any],
    controller_state: dict,
    keep_last: int,
) -> Path:
    """Write the checkpoint of ``iteration`` atomically; returns its directory.

    ``groups`` are the run's worker groups by pool name; each rank writes its own file
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
            refs += group.call("save_checkpoint", path=str(tmp / f"pool_{name}"))
        ray.get(refs)
        torch.save(controller_state, tmp / CONTROLLER)
        meta = {"iteration": iteration, "pools": sorted(groups), "time": time.time()}
        (tmp / META).write_text(json.dumps(meta))
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


def load_worker_states(path: Path, groups: dict[str, Any]) -> None:
    """Every rank of every group loads its own file of checkpoint ``path``."""
    refs = []
    for name, group in groups.items():
        refs += group.call("load_checkpoint", path=str(Path(path).resolve() / f"pool_{name}"))
    ray.get(refs)


def truncate_metrics(path: Path, offset: int) -> list[dict]:
    """Cut ``metrics.jsonl`` back to ``offset`` bytes (rows logged after the checkpoint) and
    return the rows that remain."""
    path = Path(path)
    if not path.exists():
        return []
    with path.open("r+b") as f:
        f.truncate(offset)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
