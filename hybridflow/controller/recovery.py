"""What a run does when something goes wrong: a worker process dies, or updates stop being finite.

- :class:`Recovery`: a worker lost (e.g. SIGKILLed) is told apart from a bug or a user error;
  the trainer then restarts every worker group and goes back to the newest checkpoint, at most
  ``trainer.max_restarts`` times; each loss is a line in ``RUN_DIR/events.jsonl``.
- :class:`NanGuard`: counts the iterations whose update was skipped for a non-finite loss or
  gradient norm and stops the run after ``trainer.nan_tolerance`` of them in a row.

Both stop the run with :class:`RunStopped`, whose message says why and what to do.
:func:`storage_error` turns a full, read-only or forbidden disk met anywhere (the controller, a
worker, a torch.distributed.checkpoint rank) into that one line.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path

import ray

log = logging.getLogger(__name__)


class RunStopped(RuntimeError):
    """The run stopped on purpose (non-finite updates, a weight to not checkpoint, too many
    worker failures); the message says why and what to do."""


STORAGE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)


def _causes(exc: BaseException):
    """``exc`` and everything it wraps: chained exceptions, a Ray task's cause, the per-rank
    failures of a torch.distributed.checkpoint ``CheckpointException``."""
    seen, stack = set(), [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen or not isinstance(current, BaseException):
            continue
        seen.add(id(current))
        yield current
        stack += [current.__cause__, current.__context__, getattr(current, "cause", None)]
        for failure in (getattr(current, "failures", None) or {}).values():
            stack += list(failure) if isinstance(failure, tuple) else [failure]


def storage_error(exc: BaseException) -> str | None:
    """One line for a run stopped by its disk (full, read-only, not permitted), else None."""
    for cause in _causes(exc):
        if isinstance(cause, OSError) and cause.errno in STORAGE_ERRNOS:
            where = cause.filename or "the run directory"
            return (f"{where}: {os.strerror(cause.errno)} ({errno.errorcode[cause.errno]}); the run "
                    "stopped, its checkpoints are as they were (a save is atomic)")
    for cause in _causes(exc):  # torch.save's C++ writer does not say why it failed
        if isinstance(cause, RuntimeError) and ("iostream error" in str(cause) or "failed writing" in str(cause)):
            return ("writing a file failed (" + str(cause).splitlines()[0][:100] + "): is the disk full? the run "
                    "stopped, its checkpoints are as they were (a save is atomic)")
    return None


class Recovery:
    """Worker-loss detection and the restart budget of one run."""

    def __init__(self, events_file: Path, max_restarts: int) -> None:
        self.events_file = events_file
        self.max_restarts = max_restarts
        self.num_restarts = 0

    @staticmethod
    def workers_lost(exc: BaseException, groups: dict) -> bool:
        """Whether ``exc`` came from a worker process that died (vs. a bug or a user error)."""
        if isinstance(exc, ray.exceptions.RayActorError):
            return True
        if not isinstance(exc, ray.exceptions.RayError):
            return False
        # A surviving rank fails first (its gloo peer vanished); ask every rank if it lives.
        for group in groups.values():
            refs = [w.ready.remote() for w in group.workers]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10.0)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    return True
        return False

    def begin(self, exc: BaseException, resume_from: Path | None) -> None:
        """Count one recovery from ``exc`` and record it, or stop (``RunStopped``) when the
        budget of ``trainer.max_restarts`` is used up."""
        self.num_restarts += 1
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        if self.num_restarts > self.max_restarts:
            if self.max_restarts == 0:
                raise RunStopped(
                    f"a worker died ({reason}); trainer.max_restarts=0, so the run does not recover"
                ) from exc
            raise RunStopped(
                f"a worker died again ({reason}); trainer.max_restarts={self.max_restarts} recoveries used up"
            ) from exc
        log.warning(
            "worker lost (%s); restarting worker groups, resuming from %s (recovery %d of %d)",
            reason, resume_from or "the start", self.num_restarts, self.max_restarts,
        )
        self.record("worker_lost", reason=reason, resume_from=str(resume_from) if resume_from else None,
                    recovery=self.num_restarts)

    def record(self, event: str, **fields) -> None:
        """One line of ``RUN_DIR/events.jsonl``: ``{"event": event, "time": ..., **fields}``."""
        with self.events_file.open("a") as f:
            f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


class NanGuard:
    """Iterations whose update was skipped (non-finite), in a row and in the whole run."""

    def __init__(self, tolerance: int) -> None:
        self.tolerance = tolerance
        self.streak = 0
        self.skipped = 0

    def observe(self, metrics: dict) -> None:
        """Count ``metrics``' iteration; adds ``guard/skipped_updates`` (skipped so far)."""
        skipped = any(v > 0 for k, v in metrics.items() if k.endswith("/skipped_step"))
        self.streak = self.streak + 1 if skipped else 0
        self.skipped += int(skipped)
        metrics["guard/skipped_updates"] = float(self.skipped)

    def check(self, iteration: int, last_checkpoint: Path | None) -> None:
        if self.streak >= self.tolerance:
            raise RunStopped(
                f"stopping at iteration {iteration}: the update was skipped for a non-finite loss "
                f"or gradient norm in {self.streak} iterations in a row "
                f"(trainer.nan_tolerance={self.tolerance}); last checkpoint: {last_checkpoint or 'none'}"
            )

    def state_dict(self) -> dict:
        return {"streak": self.streak, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.streak, self.skipped = state["streak"], state["skipped"]
