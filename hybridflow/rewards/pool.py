"""Reward calls in a process pool (``pebble``), each with a time limit that really holds.

Why processes: ``math-verify`` (and many graders) time out with ``signal.alarm``, which only
works in a process's main thread, and inside a Ray worker thread every such call fails (other
frameworks saw every score turn 0). A call that hangs in a thread cannot be stopped at all;
a pool process can be killed. Each pool process imports the scorer itself from its
``module:function`` name (nothing is pickled but strings) and runs every call in its main
thread.

How a batch goes: the items are cut into a few chunks (one task per chunk, so a cheap rule
costs one round trip per chunk, not per item). Inside a chunk every call is timed on its own:
a POSIX timer (``faulthandler``'s watchdog thread where there is none) ends the process
``timeout_s`` after the call began, even when the call is stuck in C holding the GIL, and the
process notes in a small file which item it is on. A chunk whose process ends that way (or dies, or overruns pebble's backstop of
``timeout_s`` per item) gives that one item its ``timeout`` (or ``error``); the chunk's other
items run again as a new chunk, in a process pebble starts in place of the ended one.

A batch can also stop as a whole (``BatchStopped``, one line): at its first timed-out call
(``first_timeout_stops``, for ``on_error: fail``), past ``batch_timeout_s`` for all its calls, or
once more than ``max_timeout_frac`` of its calls timed out. A rule that hangs on every sample
then costs about ``timeout_s``, or the batch bound, not ``timeout_s`` times the batch size.

Outcomes are per item: ``("ok", value)``, ``("error", "TypeName: message")`` or
``("timeout", "")``. What an error does to the run is the caller's choice (``on_error``).
"""

from __future__ import annotations

import faulthandler
import importlib
import itertools
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait
from typing import Any

Outcome = tuple[str, Any]

_LOADED: dict[str, Callable] = {}  # in a pool process: scorer name -> function


def _function(path: str) -> Callable:
    if path not in _LOADED:
        module_name, _, attr = path.partition(":")
        _LOADED[path] = getattr(importlib.import_module(module_name), attr)
    return _LOADED[path]


def _call(path: str, args: tuple) -> Outcome:
    try:
        return ("ok", _function(path)(*args))
    except Exception as exc:  # the user's function: anything can come out of it
        return ("error", f"{type(exc).__name__}: {exc}")


# pebble's own timeout of a chunk is a backstop behind the per-call watchdog: this much later.
BACKSTOP_GRACE_S = 5.0


class BatchStopped(Exception):
    """The pool gave up on a batch (see the module docstring); the message is one line. The
    three reasons, worded once for the pool and the in-process caller alike:"""

    @classmethod
    def first_timeout(cls, sample: int, timeout_s: float) -> "BatchStopped":
        return cls(f"sample {sample} took longer than timeout_s={timeout_s:g} s")

    @classmethod
    def too_many_timeouts(cls, num_timeouts: int, num_items: int, timeout_s: float,
                          max_timeout_frac: float) -> "BatchStopped":
        return cls(f"{num_timeouts} of the batch's {num_items} calls took longer than "
                   f"timeout_s={timeout_s:g} s, more than max_timeout_frac={max_timeout_frac:g}")

    @classmethod
    def batch_too_long(cls, num_items: int, batch_timeout_s: float, finished: int,
                       num_timeouts: int) -> "BatchStopped":
        return cls(f"the batch's {num_items} calls took longer than batch_timeout_s={batch_timeout_s:g} s "
                   f"({finished} finished, {num_timeouts} of them timed out)")


# A call past its time limit ends its process with this signal (its default action), from a
# POSIX timer: the kernel delivers it even while the call holds the GIL in C code.
TIMEOUT_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None


class _Watchdog:
    """In a pool process: ends the process ``seconds`` after ``arm`` unless ``disarm`` comes
    first. A POSIX timer costs one system call per arm, where faulthandler's watchdog starts a
    thread per arm (about ten times the cost of a cheap rule's call); faulthandler is the
    fallback where there are no POSIX timers, writing "Timeout" to ``timeout_file`` as it ends
    us."""

    _timer = None  # (libc, timer id), made once per process

    def __init__(self, timeout_file) -> None:
        self.timeout_file = timeout_file
        if _Watchdog._timer is None and TIMEOUT_SIGNAL is not None and sys.platform == "linux":
            import ctypes
            import struct

            libc = ctypes.CDLL(None, use_errno=True)
            event = ctypes.create_string_buffer(64)  # struct sigevent: SIGEV_SIGNAL, our signal
            struct.pack_into("=qii", event, 0, 0, TIMEOUT_SIGNAL, 0)
            timer = ctypes.c_void_p()
            if libc.timer_create(1, event, ctypes.byref(timer)) == 0:  # CLOCK_MONOTONIC
                _Watchdog._timer = (libc, timer)

    def _set(self, seconds: float) -> None:
        import struct

        libc, timer = _Watchdog._timer
        whole = int(seconds)
        spec = struct.pack("=qqqq", 0, 0, whole, int((seconds - whole) * 1e9))  # struct itimerspec
        libc.timer_settime(timer, 0, spec, None)

    def arm(self, seconds: float) -> None:
        if _Watchdog._timer is not None:
            self._set(max(seconds, 1e-6))  # 0 would disarm
        else:
            faulthandler.dump_traceback_later(seconds, exit=True, file=self.timeout_file)

    def disarm(self) -> None:
        if _Watchdog._timer is not None:
            self._set(0.0)
        else:
            faulthandler.cancel_dump_traceback_later()


def _call_chunk(path: str, items: Sequence[tuple], timeout_s: float | None = None,
                progress: str | None = None) -> list[Outcome]:
    if progress is None:
        return [_call(path, args) for args in items]
    fd = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(progress + ".timeout", "w") as timeout_file:
        watchdog = _Watchdog(timeout_file)
        outcomes = []
        for i, args in enumerate(items):
            os.pwrite(fd, b"%08d" % i, 0)  # which item, should the process end during it
            if timeout_s is not None:
                watchdog.arm(timeout_s)
            outcomes.append(_call(path, args))
            if timeout_s is not None:
                watchdog.disarm()
    os.close(fd)
    return outcomes


def _ended_at(progress: str) -> tuple[int | None, bool]:
    """Which item of a chunk its process was on when it ended, and whether the watchdog ended
    it (a timeout); (None, False) when the process never began the chunk."""
    try:
        with open(progress, "rb") as f:
            index = int(f.read(8) or b"-1")
    except (OSError, ValueError):
        return None, False
    try:
        timed_out = os.path.getsize(progress + ".timeout") > 0  # faulthandler's watchdog
    except OSError:
        timed_out = False
    return (index if index >= 0 else None), timed_out


def _timed_out(error: BaseException, watchdog_said: bool) -> bool:
    """Whether a chunk's process ended because a call ran past its limit: the timer's signal,
    faulthandler's note, or pebble's backstop."""
    killed_by = getattr(error, "exitcode", None)
    return (watchdog_said or isinstance(error, FutureTimeout)
            or (TIMEOUT_SIGNAL is not None and killed_by == -TIMEOUT_SIGNAL))


def _preload(paths: Sequence[str]) -> None:
    # pebble's own SIGTERM handler is Python code, which cannot run while a call is stuck in C
    # (``sum(range(10**13))``): pebble would wait 3 s more before SIGKILL. The default action
    # ends the process at once; a scorer holds nothing that needs a clean exit.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Die with the forkserver we were forked from, and let it die with the process that owns
    # this pool: a call stuck in C would otherwise keep a core busy, reparented to init, for
    # good. The forkserver exits when the write end of its "alive" pipe is closed everywhere,
    # and multiprocessing hands that end to each child too, so the child lets go of it here.
    if sys.platform == "linux":
        import ctypes
        from multiprocessing import forkserver

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
        if alive is not None:
            os.close(alive)
            forkserver._forkserver._forkserver_alive_fd = None
    for path in paths:
        try:
            _function(path)
        except Exception:  # reported by the first call, as any other error of the scorer
            pass


class ScorePool:
    """``num_workers`` processes that call scorers by name; ``call(path, items, timeout_s)``.

    Every process imports the ``preload`` scorers when it starts, before it takes a task, so
    import time never counts against a call's time limit (a process replacing a killed one
    imports them again). Started on the first call (or ``start``); ``close()`` stops the
    processes. They are forked from a clean server process (``forkserver``), not from the
    caller, which may hold threads (torch, vLLM) that a plain fork would copy in a bad state.
    """

    def __init__(self, num_workers: int = 1, preload: Sequence[str] = (), chunks_per_worker: int = 2) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.preload = tuple(preload)
        self.chunks_per_worker = chunks_per_worker
        self._pool = None

    def _ensure(self):
        if self._pool is None:
            from pebble import ProcessPool

            context = multiprocessing.get_context("forkserver")
            # The server's default preload is the caller's __main__: in a Ray worker, Ray's
            # worker script, a second import of Ray for nothing. Each process imports its scorers.
            context.set_forkserver_preload([])
            self._pool = ProcessPool(
                max_workers=self.num_workers,
                context=context,
                initializer=_preload,
                initargs=(self.preload,),
            )
        return self._pool

    def start(self) -> None:
        """Start the processes now (they import the scorers while the caller goes on)."""
        self._ensure()

    def call(
        self,
        path: str,
        items: Sequence[tuple],
        timeout_s: float | None,
        *,
        first_timeout_stops: bool = False,
        batch_timeout_s: float | None = None,
        max_timeout_frac: float | None = None,
    ) -> list[Outcome]:
        """``path(*args)`` for every ``args`` of ``items``, in order, one outcome each;
        ``BatchStopped`` when the batch is given up (module docstring)."""
        if not items:
            return []
        pool = self._ensure()
        started = time.monotonic()
        num_chunks = min(len(items), self.num_workers * self.chunks_per_worker)
        size = -(-len(items) // num_chunks)
        outcomes: list[Outcome | None] = [None] * len(items)
        running: dict = {}  # future -> (item indices, progress file)
        numbers = itertools.count()
        folder = tempfile.mkdtemp(prefix="hf_score_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)

        def submit(indices: list[int]) -> None:
            progress = os.path.join(folder, str(next(numbers)))
            backstop = None if timeout_s is None else timeout_s * len(indices) + BACKSTOP_GRACE_S
            future = pool.schedule(_call_chunk, args=(path, [items[i] for i in indices], timeout_s, progress),
                                   timeout=backstop)
            running[future] = (indices, progress)

        for start in range(0, len(items), size):
            submit(list(range(start, min(start + size, len(items)))))
        num_timeouts = 0
        try:
            while running:
                left = None if batch_timeout_s is None else started + batch_timeout_s - time.monotonic()
                done, _ = wait(list(running), timeout=None if left is None else max(left, 0.0),
                               return_when=FIRST_COMPLETED)
                if not done:
                    finished = sum(o is not None for o in outcomes)
                    raise BatchStopped.batch_too_long(len(items), batch_timeout_s, finished, num_timeouts)
                for future in done:
                    indices, progress = running.pop(future)
                    try:
                        for i, outcome in zip(indices, future.result()):
                            outcomes[i] = outcome
                        continue
                    except Exception as exc:  # the watchdog ended it, pebble's backstop, a crash
                        error = exc
                    at, watchdog_said = _ended_at(progress)
                    timed_out = _timed_out(error, watchdog_said)
                    if at is None:  # it never began: each item on its own finds out why
                        if len(indices) == 1:
                            outcomes[indices[0]] = ("timeout", "") if timed_out else (
                                "error", f"{type(error).__name__}: {error}")
                        else:
                            for i in indices:
                                submit([i])
                            continue
                    else:
                        outcomes[indices[at]] = ("timeout", "") if timed_out else (
                            "error", f"{type(error).__name__}: {error}")
                        rest = indices[:at] + indices[at + 1 :]
                        if rest:
                            submit(rest)
                    if timed_out:
                        num_timeouts += 1
                        sample = indices[at] if at is not None else indices[0]
                        if first_timeout_stops:
                            raise BatchStopped.first_timeout(sample, timeout_s)
                        if max_timeout_frac is not None and num_timeouts > max_timeout_frac * len(items):
                            raise BatchStopped.too_many_timeouts(num_timeouts, len(items), timeout_s, max_timeout_frac)
        finally:
            for future in running:
                future.cancel()  # a running one: pebble ends its process and starts another
            shutil.rmtree(folder, ignore_errors=True)
        return outcomes  # type: ignore[return-value]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
