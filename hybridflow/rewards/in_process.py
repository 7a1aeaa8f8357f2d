"""Rule calls in the worker's own process, each under its time limit, for rules cheap enough
that a round trip to a scoring process would cost more than the calls (the built-in tasks'
rules score a batch in well under a millisecond).

A batch runs in one helper thread (one thread start per batch, not per call) that notes which
item it is on and since when. The caller waits for the batch and wakes when the current item's
``timeout_s`` is up: that item is a timeout, the helper is abandoned, and the rest of the batch
goes on in a new helper. The abandoned helper gets ``RewardTimeout`` raised in it
(``PyThreadState_SetAsyncExc``), which stops a call looping in Python at its next bytecode; a
call blocked in C (a sleep, a regex) runs on until it returns, its result thrown away, while
the batch no longer waits for it. So the limit holds for the run either way; a rule that can
hang in C for good, or that needs its own main thread (``signal.alarm``), belongs in a scoring
process (``rewards.pool``), which can be killed.

Outcomes and batch stops are those of ``ScorePool.call``: ``("ok", value)``, ``("error",
"TypeName: message")`` or ``("timeout", "")`` per item, and ``BatchStopped`` at the first
timeout (``first_timeout_stops``), past ``batch_timeout_s``, or past ``max_timeout_frac`` of the
calls timed out.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.rewards.pool import BatchStopped, Outcome


class RewardTimeout(BaseException):
    """Raised in an abandoned helper thread: its call ran past its time limit. Not an
    ``Exception``, so a rule's own ``except Exception`` does not swallow it."""


def _raise_in(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type))


class _Helper(threading.Thread):
    """Calls ``fn(*items[i])`` for ``i`` from ``start`` on; ``current`` is ``(i, start time)``."""

    def __init__(self, fn: Callable, items: Sequence[tuple], start: int) -> None:
        super().__init__(name="hybridflow-rule", daemon=True)
        self.fn, self.items, self.start_index = fn, items, start
        self.current = (start, time.monotonic())
        self.results: list[Outcome] = []
        self.lock = threading.Lock()
        self.abandoned = False
        self.done = threading.Event()

    def run(self) -> None:
        try:
            try:
                self._calls()
            finally:
                self.done.set()
        except RewardTimeout:  # raised in us once abandoned, wherever we were
            pass

    def _calls(self) -> None:
        for i in range(self.start_index, len(self.items)):
            self.current = (i, time.monotonic())  # one assignment: read whole by the caller
            try:
                outcome: Outcome = ("ok", self.fn(*self.items[i]))
            except Exception as exc:  # the user's function: anything can come out of it
                outcome = ("error", f"{type(exc).__name__}: {exc}")
            with self.lock:
                if self.abandoned:
                    return
                self.results.append(outcome)

    def abandon_at(self, index: int | None = None) -> list[Outcome] | None:
        """The outcomes before ``index`` if the helper is still on ``index`` (then it is
        abandoned and told to stop); None if it has moved on since. Without an index: abandon
        it wherever it is and return what it finished."""
        with self.lock:
            if index is not None and (self.current[0] != index or len(self.results) != index - self.start_index):
                return None
            self.abandoned = True
            results = list(self.results)
        _raise_in(self, RewardTimeout)
        return results


def call_in_process(
    fn: Callable,
    items: Sequence[tuple],
    timeout_s: float | None,
    *,
    first_timeout_stops: bool = False,
    batch_timeout_s: float | None = None,
    max_timeout_frac: float | None = None,
) -> list[Outcome]:
    """``fn(*args)`` for every ``args`` of ``items``, in order, one outcome each (module docstring)."""
    outcomes: list[Any] = [None] * len(items)
    started = time.monotonic()
    batch_deadline = None if batch_timeout_s is None else started + batch_timeout_s
    num_timeouts, start = 0, 0
    while start < len(items):
        helper = _Helper(fn, items, start)
        helper.start()
        while True:
            index, began = helper.current
            deadlines = [d for d in (None if timeout_s is None else began + timeout_s, batch_deadline) if d is not None]
            wait = None if not deadlines else max(min(deadlines) - time.monotonic(), 0.0)
            if helper.done.wait(wait):
                outcomes[start:] = helper.results
                start = len(items)
                break
            now = time.monotonic()
            if batch_deadline is not None and now >= batch_deadline:
                finished = sum(o is not None for o in outcomes) + len(helper.abandon_at())
                raise BatchStopped.batch_too_long(len(items), batch_timeout_s, finished, num_timeouts)
            if timeout_s is None or now < began + timeout_s:
                continue  # woken early, or the helper moved on to a later item
            results = helper.abandon_at(index)
            if results is None:
                continue
            outcomes[start:index] = results
            outcomes[index] = ("timeout", "")
            num_timeouts += 1
            if first_timeout_stops:
                raise BatchStopped.first_timeout(index, timeout_s)
            if max_timeout_frac is not None and num_timeouts > max_timeout_frac * len(items):
                raise BatchStopped.too_many_timeouts(num_timeouts, len(items), timeout_s, max_timeout_frac)
            start = index + 1
            break
    return outcomes
