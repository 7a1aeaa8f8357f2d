"""LLM judges: the prompt a judge model reads, and the score read from the verdict it writes.

A judge node (``workers/ops/judge.py``) fills the node's template with each sample's prompt,
response and ground truth, generates a verdict with the judge model's rollout engine, and
scores it here. A verdict fails in one of two ways, each counted and handled by the node's
``on_error``:

- ``timeout``: it did not end (no EOS) within ``max_new_tokens``. It is not parsed, even if it
  holds a number: a verdict cut off may be cut mid-number ("1" of "10"), and a judge that
  rambles on has not given the verdict the template asked for.
- ``parse_error``: it ended, but holds no score: no number that ``pattern`` finds in ``scale``,
  or none of the ``labels``.

Pure functions on strings: no model, no Ray.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from hybridflow.spec.graph import JudgeOptions

Failure = Literal["timeout", "parse_error"]


def fill_template(template: str, prompt: str, response: str, ground_truth: Any) -> str:
    """The judge's prompt for one sample; a missing ground truth (None) fills as ''."""
    truth = "" if ground_truth is None else str(ground_truth)
    return template.format(prompt=prompt, response=response, ground_truth=truth)


def parse_verdict(text: str, options: JudgeOptions) -> float | None:
    """The score a verdict gives, or None when it gives none.

    With ``options.labels``: the score of the label found first in ``text`` (a whole word or
    phrase, case ignored; at one position the longer label wins, so "not good" is not read as
    "good"). Else the first match of ``options.pattern`` (its group when it has one) as a
    number in ``options.scale = [min, max]``, rescaled to ``(number - min) / (max - min)``; a
    number outside the scale, or a match that is not a number, is no score.
    """
    if options.labels is not None:
        return _first_label(text, options.labels)
    match = re.search(options.pattern, text)
    if match is None:
        return None
    try:
        number = float(match.group(1) if match.re.groups else match.group(0))
    except (TypeError, ValueError):  # an optional group that did not take part, or not a number
        return None
    low, high = options.scale
    if not (math.isfinite(number) and low <= number <= high):
        return None
    return (number - low) / (high - low)


def _first_label(text: str, labels: dict[str, float]) -> float | None:
    by_label = {label.strip().lower(): score for label, score in labels.items()}
    alternatives = "|".join(re.escape(label) for label in sorted(by_label, key=len, reverse=True))
    match = re.search(rf"(?<!\w)(?:{alternatives})(?!\w)", text, flags=re.IGNORECASE)
    return None if match is None else by_label[match.group(0).lower()]


@dataclass(frozen=True)
class Verdict:
    """One sample's verdict: its ``score`` (None when it failed) and why it failed."""

    score: float | None
    failure: Failure | None


def read_verdict(text: str, ended: bool, options: JudgeOptions) -> Verdict:
    """The score of a verdict that ``ended`` (EOS within ``max_new_tokens``), or its failure."""
    if not ended:
        return Verdict(None, "timeout")
    score = parse_verdict(text, options)
    return Verdict(score, None if score is not None else "parse_error")
