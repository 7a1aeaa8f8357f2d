"""Name -> function registries for the algorithm library.

A graph file names its advantage estimator, policy loss and loss aggregation by string; the
worker looks the function up here. Registering is done once, at import, next to the function::

    @ADV_ESTIMATORS.register("grpo")
    def grpo_advantage(...): ...

    ADV_ESTIMATORS.get("grpo")(**batch_fields, **options)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError):
    """A name that is not registered. ``str()`` gives the plain one-line message."""

    def __str__(self) -> str:  # KeyError would show the message inside quotes
        return str(self.args[0]) if self.args else ""


class Registry(Generic[F]):
    """Functions of one kind (e.g. "advantage estimator") looked up by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding ``fn`` under ``name``; a name can be registered only once."""

        def add(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        """The function registered as ``name``; ``KeyError`` listing known names otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self.names()) or "(none)"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


ADV_ESTIMATORS: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
LOSS_AGGS: Registry = Registry("loss aggregation")
PAIR_LOSSES: Registry = Registry("pairwise loss")  # scalar models trained from preference pairs
