"""The environment interface of a multi-turn rollout, in the style of OpenRLHF's and SkyRL-gym's.

An episode is one sample: ``reset(row)`` once, then ``step(action_text)`` after every model turn
until ``done`` (or the rollout's ``max_turns`` / token budget runs out). ``action_text`` is what
the model wrote this turn (decoded, special tokens kept out); the returned observation is text
the rollout tokenises and appends after the model's tokens, masked out of the loss. ``reward``
is this step's reward (0 for most steps; the final answer's reward on the last one; shaped
rewards for a good tool call, if the environment gives them).

Environments are built per episode from a name in ``ENVS`` or a ``"module:Class"`` path, with
the graph node's ``env_kwargs``. Each episode's steps run in a thread pool (``envs.rollout``):
``step`` may block (a sandboxed program, a remote call) without holding up other episodes.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple


class Step(NamedTuple):
    observation: str  # appended as tokens after the model's turn ("" for none)
    reward: float
    done: bool
    info: dict[str, Any] = {}  # per-step counters, e.g. {"tool_calls": 1, "tool_errors": 0}


class Environment(abc.ABC):
    """One episode's environment; a fresh instance per sample."""

    @abc.abstractmethod
    def reset(self, row: dict[str, Any]) -> str:
        """Start an episode on ``row`` (``prompt``, ``ground_truth``, ``extra_info``...);
        returns text to append after the prompt before the first model turn ("" for none)."""

    @abc.abstractmethod
    def step(self, action_text: str) -> Step:
        """React to the model's turn ``action_text``."""

    def use_tokenizer(self, tokenizer) -> None:
        """Called once per episode, before ``reset``, with the actor's tokenizer (an environment
        that renders observations with its chat template keeps it). No-op by default."""

    def stop_strings(self) -> list[str]:
        """Strings that end a model turn besides EOS (a tool call's closing tag)."""
        return []

    def close(self) -> None:
        """Release what the episode holds. No-op by default."""


ENVS: dict[str, str | Callable[..., Environment]] = {
    "tool": "hybridflow.envs.tools:ToolEnv",
    "product": "hybridflow.envs.product:ProductEnv",
}


def env_factory(name: str, kwargs: dict[str, Any] | None = None) -> Callable[[], Environment]:
    """A callable making fresh environments: ``name`` is a key of ``ENVS`` or ``module:Class``.
    Raises ``ValueError`` naming what was expected."""
    target = ENVS.get(name, name)
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        if not attr:
            raise ValueError(f"unknown environment {name!r}; expected one of {sorted(ENVS)} or 'module:Class'")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"environment {name!r} cannot be imported: {exc}") from None
    kwargs = dict(kwargs or {})
    return lambda: target(**kwargs)
