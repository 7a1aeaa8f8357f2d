"""Errors a worker raises that the controller catches by type.

Kept apart from the worker host so that the controller can name them without importing the
host (and, through it, every engine).
"""


class NonFiniteWeightError(RuntimeError):
    """A trained weight became NaN/inf; such a state is never checkpointed."""
