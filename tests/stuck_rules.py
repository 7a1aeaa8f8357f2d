"""Rules stuck in C code, imported by name in score processes. Nothing heavy is imported here:
a process that replaces a killed one imports its rule again, and that time is not the rule's."""

from __future__ import annotations

import os
import time


def stuck_in_c(prompt, response, truth):
    return float(sum(range(10**13)))  # one C call: no signal handler runs until it returns


def stuck_on_x(prompt, response, truth):
    return stuck_in_c(prompt, response, truth) if response == "x" else 1.0


def stuck_after_a_mark(prompt, response, truth):
    """stuck_in_c, first writing the time the first call began to the file its ground truth
    names (a bound measured from there does not count the run's start)."""
    if truth.endswith(".mark") and not os.path.exists(truth):
        with open(truth, "w") as f:
            f.write(repr(time.time()))
    return stuck_in_c(prompt, response, truth)
