"""Rule-based scorers named ``module:function`` in a graph file.

A rule scores one sample: ``fn(prompt: str, response: str, ground_truth: str) -> float``; a
verl-style ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` returns a
float or a dict with ``score``.

``score_items`` is the robust caller the workers use (in a process pool or in-process): a call
that raises, returns a non-finite or non-number value, or exceeds its time limit either stops
the run (``RewardError``, one line) or gives that sample the configured default reward and is
counted, as the score node's ``options.on_error`` says. "Finite" means finite in the batch's
float32: 1e308 is a finite float but inf once cast, so it is an error like NaN.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence

import torch

from hybridflow.data.echo import shorten
from hybridflow.rewards.in_process import call_in_process
from hybridflow.rewards.pool import BatchStopped

RuleFn = Callable[[str, str, str], float]


SCORE_DTYPE = torch.float32  # the dtype of a batch's scores; a value must be finite in it
_SCORE_MAX = torch.finfo(SCORE_DTYPE).max


class RewardError(RuntimeError):
    """Scoring failed and the score node's ``on_error`` is ``fail``; the message is one line."""


def is_finite_score(value: float) -> bool:
    """Whether ``value`` is finite after the cast to the scores' dtype (float32)."""
    return math.isfinite(value) and abs(value) <= _SCORE_MAX


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


def _as_score(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"returned {type(value).__name__} {shorten(repr(value), 40)}, expected a number")
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError("returned an integer too large for a float") from None
    if not is_finite_score(value):
        raise ValueError(f"returned {value:g}, not finite in {str(SCORE_DTYPE).removeprefix('torch.')}")
    return value


def as_score(value: object) -> tuple[float, dict[str, float]]:
    """A scorer's return value as ``(score, other numeric keys)``: a number, or a verl-style
    dict with a ``score`` number whose other number-valued keys are kept (for metrics)."""
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"returned a dict without 'score' (keys {sorted(value)[:5]})")
        extras = {
            str(k): float(v) for k, v in value.items()
            if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool) and is_finite_score(float(v))
        }
        return _as_score(value["score"]), extras
    return _as_score(value), {}


def score_items(
    fn: RuleFn | str,
    items: Sequence[tuple],
    pool=None,
    *,
    on_error: str = "fail",
    default_reward: float = 0.0,
    timeout_s: float | None = None,
    name: str = "rule",
    batch_timeout_s: float | None = None,
    max_timeout_frac: float | None = None,
) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
    """``fn(*item)`` for every item: (B,) float32 scores, how many samples got
    ``default_reward`` because scoring failed, and the other numeric keys of dict results
    ((B,) each, 0 where a sample lacks the key).

    With a ``pool`` (``rewards.pool.ScorePool``) ``fn`` is a ``module:function`` name and the
    calls run in its processes; without, ``fn`` is called in this process
    (``rewards.in_process``). Either way the batch can also stop as a whole (``RewardError``):
    at its first timed-out call under ``on_error: fail``, past ``batch_timeout_s``, or past
    ``max_timeout_frac`` of its calls timed out; a rule that hangs on every sample would
    otherwise score zeros for minutes.
    """
    limits = dict(first_timeout_stops=on_error == "fail", batch_timeout_s=batch_timeout_s,
                  max_timeout_frac=max_timeout_frac)
    try:
        if pool is not None:
            outcomes = pool.call(fn, items, timeout_s, **limits)
        else:
            outcomes = call_in_process(fn, items, timeout_s, **limits)
    except BatchStopped as exc:
        raise RewardError(f"reward {name}: {exc}") from None
    values, extras, num_errors = [], [], 0
    for i, (status, value) in enumerate(outcomes):
        if status == "ok":
            try:
                score, more = as_score(value)
                values.append(score)
                extras.append(more)
                continue
            except (TypeError, ValueError) as exc:
                status, value = "error", f"{type(exc).__name__}: {exc}"
        if on_error == "fail":
            if status == "timeout":
                raise RewardError(f"reward {name}: sample {i} took longer than timeout_s={timeout_s:g} s")
            raise RewardError(f"reward {name}: sample {i}: {shorten(value)} (or options.on_error: default)")
        values.append(default_reward)
        extras.append({})
        num_errors += 1
    keys = sorted({k for more in extras for k in more})
    columns = {k: torch.tensor([more.get(k, 0.0) for more in extras], dtype=torch.float32) for k in keys}
    return torch.tensor(values, dtype=SCORE_DTYPE), num_errors, columns


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
    """(B,) float32 scores of a rule called in this process, and how many samples got
    ``default_reward`` because scoring failed."""
    scores, num_errors, _ = score_items(
        fn, list(zip(prompts, responses, ground_truths)), on_error=on_error,
        default_reward=default_reward, timeout_s=timeout_s, name=name,
    )
    return scores, num_errors
