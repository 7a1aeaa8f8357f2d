"""The built-in verl-style ``compute_score``: one grader per ``data_source``, as verl's default.

``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float``:

- ``openai/gsm8k``: the number after the last ``#### `` in the response (verl's strict GSM8K
  format; commas and a ``$`` are dropped), equal to the ground truth: 1.0, else 0.0.
- math sets (``MATH_SOURCES``: ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``,
  ``HuggingFaceH4/MATH-500``, ``math_dapo``, ``aime*``, ...): ``math-verify`` parses the
  response and the ground truth (LaTeX, ``\\boxed{}``, plain expressions) and compares them:
  1.0 when equivalent, else 0.0.
- ``hybridflow/arith_words`` (the built-in word problems) and any **unknown** data source:
  the response's *final answer* compared as a number with the ground truth. The final answer
  is, in order of preference, the number after the last ``####``, inside the last
  ``\\boxed{}``, after the last "answer is"/"answer:", or else the last number in the text.
  An unknown data source whose ground truth is not a number goes to ``math-verify``. verl
  raises on an unknown source; here a user's own data set works without writing a scorer,
  and the rule is documented rather than surprising.

The graders look only at the response and the ground truth (never at a prompt template).
Run them through the score node's process pool: ``math-verify`` times out with
``signal.alarm``, which works only in a process's main thread.
"""

from __future__ import annotations

import re
from fractions import Fraction

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math_dapo",
    "math",
)
MATH_PREFIXES = ("aime", "amc")
ARITH_SOURCES = ("hybridflow/arith_words",)

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASHES_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_BOXED_RE = re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}")
_ANSWER_RE = re.compile(r"answer(?:\s+is)?\s*[:=]?\s*\**\s*(" + _NUMBER + ")", re.IGNORECASE)


def parse_number(text: str) -> Fraction | None:
    """``"1,234"``, ``"$5"``, ``"-3.50"``, ``"7/2"`` -> an exact Fraction; None if not a number."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def final_answer(response: str) -> str | None:
    """The response's final answer as text (module docstring), or None when it has no number."""
    for pattern in (_HASHES_RE, _BOXED_RE, _ANSWER_RE):
        found = pattern.findall(response)
        if found:
            return found[-1]
    numbers = _NUMBER_RE.findall(response)
    return numbers[-1] if numbers else None


def numeric_score(response: str, ground_truth: str) -> float:
    """1.0 when the response's final answer equals the numeric ground truth, else 0.0."""
    answer = final_answer(response)
    expected = parse_number(str(ground_truth))
    if answer is None or expected is None:
        return 0.0
    return float(parse_number(answer) == expected)


def gsm8k_score(response: str, ground_truth: str) -> float:
    """verl's strict GSM8K rule: the number after the last ``####`` equals the ground truth."""
    found = _HASHES_RE.findall(response)
    if not found:
        return 0.0
    return float(parse_number(found[-1]) == parse_number(str(ground_truth)))


def math_verify_score(response: str, ground_truth: str) -> float:
    """``math-verify``: 1.0 when the response's answer is equivalent to the ground truth."""
    from math_verify import parse, verify

    gold = parse(_as_latex_answer(str(ground_truth)))
    predicted = parse(response)
    if not gold or not predicted:
        return 0.0
    return float(verify(gold, predicted))


def _as_latex_answer(text: str) -> str:
    # A bare ground truth ("\frac{1}{2}", "3") parses most reliably inside a math environment.
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """Score one response (module docstring for the rule of each ``data_source``)."""
    if data_source in GSM8K_SOURCES:
        return gsm8k_score(solution_str, ground_truth)
    if data_source in MATH_SOURCES or data_source.lower().startswith(MATH_PREFIXES):
        return math_verify_score(solution_str, ground_truth)
    if data_source in ARITH_SOURCES or parse_number(str(ground_truth)) is not None:
        return numeric_score(solution_str, ground_truth)
    return math_verify_score(solution_str, ground_truth)
