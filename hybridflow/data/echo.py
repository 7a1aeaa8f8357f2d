"""User data quoted in an error line, bounded: one line of at most ``ECHO_CHARS`` characters.

A 10 MB prompt, a grader's message or a reward's return value must not turn into a 10 MB log
line; the cut says how much was left out.
"""

from __future__ import annotations

ECHO_CHARS = 100


def shorten(text: object, limit: int = ECHO_CHARS) -> str:
    """``str(text)`` on one line (runs of whitespace as one space), cut to ``limit`` characters."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"
