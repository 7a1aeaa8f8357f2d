"""Rule-based scorers named ``module:function`` in a graph file.

A rule scores one sample: ``fn(prompt: str, response: str, ground_truth: str) -> float``.

``score_texts_guarded`` is the robust variant the workers use: a rule call that raises, returns
a non-finite or non-number value, or exceeds its time limit either stops the run
(``RewardError``) or gives that sample the configured default reward and is counted, as the
score node's ``options.on_error`` says.
"""

from __future__ import annotations

import importlib
import math
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

RuleFn = Callable[[str, str, str], float]


class RewardError(RuntimeError):
    """Scoring failed and the score node's ``on_error`` is ``fail``."""


class RewardTimeout(Exception):
    """One rule call ran past its time limit."""


def load_rule(path: str) -> RuleFn:
    """Import ``module:function``; ValueError (one line) when it cannot be found or called."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"module {module_name!r} has no function {attr!r}")
    return fn


def score_texts(
    fn: RuleFn, prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[str]
) -> torch.Tensor:
    """(B,) float32 scores of each (prompt, response, ground truth)."""
    values = [float(fn(p, r, g)) for p, r, g in zip(prompts, responses, ground_truths)]
    return torch.tensor(values, dtype=torch.float32)


def _alarm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise RewardTimeout()


def call_with_timeout(fn: Callable[[], float], timeout_s: float | None) -> float:
    """``fn()``, raising ``RewardTimeout`` after ``timeout_s`` seconds.

    In the main thread (Ray runs a sync actor's tasks there) a SIGALRM interrupts the call
    itself, so a rule stuck in a Python loop stops. Elsewhere the call runs in a helper thread
    that is abandoned on timeout (Python cannot kill a thread; it keeps running until it ends).
    """
    if timeout_s is None:
        return fn()
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(fn).result(timeout=timeout_s)
    except FutureTimeout:
        raise RewardTimeout() from None
    finally:
        pool.shutdown(wait=False)


def _as_score(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"returned {type(value).__name__}, expected a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"returned {value}, expected a finite number")
    return value


def score_texts_guarded(
    fn: RuleFn,
    prompts: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[str],
    *,
    on_error: str = "fail",
    default_reward: float = 0.0,
    timeout_s: float | None = None,
    name: str = "rule",
) -> tuple[torch.Tensor, int]:
    """(B,) float32 scores and how many samples got ``default_reward`` because scoring failed."""
    values, num_errors = [], 0
    for i, (p, r, g) in enumerate(zip(prompts, responses, ground_truths)):
        try:
            values.append(_as_score(call_with_timeout(lambda: fn(p, r, g), timeout_s)))
        except RewardTimeout:
            if on_error == "fail":
                raise RewardError(
                    f"reward {name}: sample {i} took longer than timeout_s={timeout_s:g} s"
                ) from None
            values.append(default_reward)
            num_errors += 1
        except Exception as exc:  # the user's function: anything can come out of it
            if on_error == "fail":
                raise RewardError(f"reward {name}: sample {i}: {type(exc).__name__}: {exc}") from None
            values.append(default_reward)
            num_errors += 1
    return torch.tensor(values, dtype=torch.float32), num_errors
