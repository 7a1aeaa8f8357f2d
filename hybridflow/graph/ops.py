"""One record per op: everything the graph, the controller and the workers know about it.

An ``Op`` says which roles may run it, the data keys a node of it reads and writes by default,
the graph keys it can produce (and the batch fields each stands for), the kinds of key its body
looks for among a node's keys (``slots``, checked when a graph is validated), its options model
(``spec/graph.py``) and the name of the worker method that runs it. The controller calls every
op the same way (``ModelWorker.run_op`` with the node's name); how the batch is split over the
ranks follows from the model's layout, not from the op.

Adding an op is one record here (or ``register_op`` from anywhere) plus its body, a method of
``ModelWorker`` (or of a subclass) with that name: ``body(self, batch, node) -> (TensorDict,
meta)``. Nothing in the controller changes. This module imports no Ray, vLLM or megatron: the
record names its worker method, and the worker side binds the name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, create_model

from hybridflow.data import keys as K
from hybridflow.spec.graph import (
    AdvantageOptions,
    FilterOptions,
    GenerateOptions,
    MultiTurnOptions,
    NodeBase,
    NoOptions,
    ScoreOptions,
    Spec,
    UpdateOptions,
    node_types,
    set_node_types,
)

ANY_ROLE = frozenset({"actor", "critic", "ref", "reward", "cost"})


@dataclass(frozen=True)
class Slot:
    """One kind of key an op's body looks for among a node's inputs (or outputs): at most one
    of ``keys`` may be there, exactly one when ``required``. ``roles``: the roles whose nodes
    have the slot (None: all)."""

    what: str  # "score key", for error messages
    keys: tuple[str, ...]
    side: Literal["inputs", "outputs"] = "inputs"
    required: bool = True
    roles: frozenset[str] | None = None


@dataclass(frozen=True)
class Op:
    """One op. ``inputs`` / ``outputs``: default keys by role (``"*"``: any role); ``writes``:
    graph keys a node of the op may produce -> the batch fields each stands for (the first is
    the main one); ``method``: the worker method that runs it, by role where they differ;
    ``text``: the body reads per-sample strings (prompt text, ground truth); ``generates``: the
    op runs the actor's rollout engine (needs rollout settings, is split over the generation
    layout, and makes ``rollout.n`` samples per prompt, 1 when greedy); ``refills``: the op
    drops prompt groups and the controller re-runs the nodes before it on fresh prompts until the
    batch is full again (dynamic sampling); every later reader of its input keys reads its
    output (``graph.dag``), so its output size is not known before it finishes."""

    name: str
    roles: frozenset[str]
    options: type[Spec]
    method: str | Mapping[str, str]
    inputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    outputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    writes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    slots: Mapping[str, Slot] = field(default_factory=dict)
    text: bool = False
    generates: bool = False
    refills: bool = False

    def default_inputs(self, role: str) -> tuple[str, ...]:
        return self.inputs.get(role, self.inputs.get("*", ()))

    def default_outputs(self, role: str) -> tuple[str, ...]:
        return self.outputs.get(role, self.outputs.get("*", ()))

    def method_for(self, role: str) -> str:
        return self.method if isinstance(self.method, str) else self.method[role]

    def slots_for(self, role: str) -> dict[str, Slot]:
        return {name: s for name, s in self.slots.items() if s.roles is None or role in s.roles}


SCORE_KEYS = ("scores", "costs")  # sequence-level signals an advantage is taken of
VALUE_KEYS = ("values", "cost_values")
ADVANTAGE_KEYS = ("advantages", "cost_advantages")

# What the data source writes before any node runs.
SOURCE_WRITES = {"prompts": (K.PROMPT_IDS, K.PROMPT_MASK, K.UID, K.PROMPT_TEXT, K.GROUND_TRUTH, K.DATA_SOURCE, K.EXTRA_INFO)}
_ROLLOUT = (K.RESPONSES, K.RESPONSE_MASK, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS, K.TRUNCATED)

OPS: dict[str, Op] = {}


def register_op(op: Op) -> Op:
    """Add ``op``: graph files and builders may name it from now on (its node model, an
    ``op: Literal[name]`` node with ``options: op.options``, joins ``GraphSpec``'s node union).
    The worker that runs it must have a method named ``op.method``."""
    if op.name in OPS:
        raise ValueError(f"op {op.name!r} is already registered")
    OPS[op.name] = op
    types = node_types()
    if op.name not in types:
        title = "".join(part.title() for part in op.name.split("_"))
        types[op.name] = create_model(
            f"{title}Node",
            __base__=NodeBase,
            __module__=op.options.__module__,  # pickled like the options model it holds
            op=(Literal[op.name], ...),
            options=(op.options, Field(default_factory=op.options)),
        )
        set_node_types(types)
    return op


def unregister_op(name: str) -> None:
    """Remove an op ``register_op`` added (tests, notebooks)."""
    del OPS[name]
    set_node_types({op: cls for op, cls in node_types().items() if op != name})


def graph_keys() -> dict[str, tuple[str, ...]]:
    """Every named graph key -> the batch fields it stands for: a node that consumes the key
    reads those fields, which its producer wrote (plus any companion fields it adds)."""
    keys = dict(SOURCE_WRITES)
    for op in OPS.values():
        keys.update(op.writes)
    return keys


register_op(Op(
    "generate",
    roles=frozenset({"actor"}),
    options=GenerateOptions,
    method="generate",
    inputs={"*": ("prompts",)},
    outputs={"*": ("responses",)},
    writes={
        "responses": (*_ROLLOUT, K.ROLLOUT_LOG_PROBS, K.ROLLOUT_LOG_PROBS_RECORDED, K.WEIGHT_VERSION,
                      K.WEIGHT_VERSION_LAST, *SOURCE_WRITES["prompts"][2:]),
        # A second generation (ReMax's greedy one) carries the same fields under its own key.
        "greedy_responses": _ROLLOUT[:5],
    },
    text=True,
    generates=True,
))
# Multi-turn: model turns and environment steps (hybridflow.envs); the environment's rewards
# come out as the scores, so no score node is needed.
register_op(Op(
    "multi_turn_generate",
    roles=frozenset({"actor"}),
    options=MultiTurnOptions,
    method="generate_multi_turn",
    inputs={"*": ("prompts",)},
    outputs={"*": ("responses", "scores")},
    writes={
        "responses": (*_ROLLOUT, K.ROLLOUT_LOG_PROBS, K.WEIGHT_VERSION, K.WEIGHT_VERSION_LAST, *SOURCE_WRITES["prompts"][2:]),
        "scores": (K.SCORES, K.TOKEN_REWARDS),
    },
    text=True,
    generates=True,
))
register_op(Op(
    "log_prob",
    roles=frozenset({"actor", "ref"}),
    options=NoOptions,
    method="log_prob",
    inputs={"*": ("responses",)},
    outputs={"actor": ("old_log_probs",), "ref": ("ref_log_probs",)},
    writes={"old_log_probs": (K.OLD_LOG_PROBS,), "ref_log_probs": (K.REF_LOG_PROBS,)},
))
register_op(Op(
    "values",
    roles=frozenset({"critic"}),
    options=NoOptions,
    method="compute_values",
    inputs={"*": ("responses",)},
    outputs={"*": ("values",)},
    writes={"values": (K.VALUES,), "cost_values": (K.COST_VALUES,)},
))
register_op(Op(
    "score",
    roles=frozenset({"reward", "cost"}),
    options=ScoreOptions,
    method="score",
    inputs={"*": ("responses",)},
    outputs={"reward": ("scores",), "cost": ("costs",)},
    writes={
        "scores": (K.SCORES, K.TOKEN_REWARDS),
        "costs": (K.COSTS,),
        "baseline_scores": (K.BASELINE_SCORES,),
    },
    text=True,  # a rule reads the prompt and the ground truth
))
# Pure math: runs on the workers of whichever model the node names (put it next to its consumer
# so the advantages never leave those processes).
register_op(Op(
    "advantage",
    roles=ANY_ROLE,
    options=AdvantageOptions,
    method="advantage",
    inputs={"*": ("responses", "scores")},
    outputs={"*": ("advantages",)},
    writes={
        "advantages": (K.ADVANTAGES, K.RETURNS),
        "cost_advantages": (K.COST_ADVANTAGES, K.COST_RETURNS),
    },
    slots={
        "score": Slot("score key", SCORE_KEYS),
        "values": Slot("values key", VALUE_KEYS, required=False),
        "advantages": Slot("advantage key", ADVANTAGE_KEYS, side="outputs"),
    },
))
# Dynamic sampling: keeps the prompt groups whose scores differ, ordered first; writes no key of
# its own: the nodes after it read its inputs' keys from it (filtered). Next to the scores'
# consumers, like advantage.
register_op(Op(
    "filter",
    roles=ANY_ROLE,
    options=FilterOptions,
    method="filter_groups",
    inputs={"*": ("responses", "scores")},
    outputs={"*": ()},
    slots={"score": Slot("score key", SCORE_KEYS)},
    text=True,  # the kept rows carry every field of its inputs downstream, strings included
    refills=True,
))
register_op(Op(
    "update",
    roles=frozenset({"actor", "critic"}),
    options=UpdateOptions,
    method={"actor": "update_policy", "critic": "update_critic"},
    inputs={
        "actor": ("responses", "old_log_probs", "advantages"),
        "critic": ("responses", "values", "advantages"),
    },
    outputs={"*": ()},
    slots={
        "values": Slot("values key", VALUE_KEYS, roles=frozenset({"critic"})),
        "advantages": Slot("advantage key", ADVANTAGE_KEYS, roles=frozenset({"critic"})),
    },
))
