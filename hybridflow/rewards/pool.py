"""Reward calls in a process pool (``pebble``), each with a time limit that really holds.

Why processes: ``math-verify`` (and many graders) time out with ``signal.alarm``, which only
works in a process's main thread, and inside a Ray worker thread every such call fails (other
frameworks saw every score turn 0). A call that hangs in a thread cannot be stopped at all;
a pool process can be killed. Each pool process imports the scorer itself from its
``module:function`` name (nothing is pickled but strings) and runs every call in its main
thread.

How a batch goes: the items are cut into a few chunks (one task per chunk, so a cheap rule
costs one round trip per chunk, not per item), each chunk given ``timeout_s`` per item. A chunk
that overruns, or whose process dies, is killed and its items are run again one per task with
``timeout_s`` each, so the one slow item is found and only it times out (a chunk of one item
is not run again). On a timeout pebble kills the process (SIGTERM, which here ends it at once,
even in the middle of a C call) and starts a new one in its place.

Outcomes are per item: ``("ok", value)``, ``("error", "TypeName: message")`` or
``("timeout", "")``. What an error does to the run is the caller's choice (``on_error``).
"""

from __future__ import annotations

import importlib
import multiprocessing
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
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


def _call_chunk(path: str, items: Sequence[tuple]) -> list[Outcome]:
    return [_call(path, args) for args in items]


def _preload(paths: Sequence[str]) -> None:
    # pebble's own SIGTERM handler is Python code, which cannot run while a call is stuck in C
    # (``sum(range(10**13))``): pebble would wait 3 s more before SIGKILL. The default action
    # ends the process at once; a scorer holds nothing that needs a clean exit.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
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

    def call(self, path: str, items: Sequence[tuple], timeout_s: float | None) -> list[Outcome]:
        """``path(*args)`` for every ``args`` of ``items``, in order, one outcome each."""
        if not items:
            return []
        pool = self._ensure()
        num_chunks = min(len(items), self.num_workers * self.chunks_per_worker)
        size = -(-len(items) // num_chunks)
        chunks = [list(items[i : i + size]) for i in range(0, len(items), size)]
        futures = [
            pool.schedule(_call_chunk, args=(path, chunk),
                          timeout=None if timeout_s is None else timeout_s * len(chunk))
            for chunk in chunks
        ]
        outcomes: list[Outcome] = []
        for chunk, future in zip(chunks, futures):
            try:
                outcomes.extend(future.result())
            except Exception as exc:  # overran (killed) or its process died: find the culprit(s)
                if len(chunk) == 1 and isinstance(exc, FutureTimeout):
                    outcomes.append(("timeout", ""))  # that one item is the culprit
                else:
                    outcomes.extend(self._one_by_one(path, chunk, timeout_s))
        return outcomes

    def _one_by_one(self, path: str, items: Sequence[tuple], timeout_s: float | None) -> list[Outcome]:
        pool = self._ensure()
        futures = [pool.schedule(_call, args=(path, args), timeout=timeout_s) for args in items]
        outcomes: list[Outcome] = []
        for future in futures:
            try:
                outcomes.append(future.result())
            except FutureTimeout:
                outcomes.append(("timeout", ""))
            except Exception as exc:  # the process died (os._exit, a crash in C code)
                outcomes.append(("error", f"{type(exc).__name__}: {exc}"))
        return outcomes

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
