"""Rule-based scorers named ``module:function`` in a graph file.

A rule scores one sample: ``fn(prompt: str, response: str, ground_truth: str) -> float``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch

RuleFn = Callable[[str, str, str], float]


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
