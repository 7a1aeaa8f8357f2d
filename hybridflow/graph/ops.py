"""One record per op: everything the graph, the controller and the workers know about it.

An ``Op`` says which roles may run it, the data keys a node of it reads and writes by default,
the graph keys it can produce (and the batch fields each stands for), the kinds of key its body
looks for among a node's keys (``slots``, checked when a graph is validated), its options model,
what it does that the rest of the code asks about (``generates``, ``trains``, ``scores``, ...)
and its body, a function named ``"module:function"`` and imported only where it runs (a worker
process). The controller calls every op the same way (``ModelWorker.run_op`` with the node's
name); how the batch is split over the ranks follows from the model's layout, not from the op.

A body is ``body(ctx, batch, node) -> (TensorDict, meta)``: ``ctx`` is the worker's
``hybridflow.workers.context.WorkerContext`` (engines, tokenizer, graph, data-parallel group),
``batch`` this rank's part of the node's inputs, ``meta`` a dict with ``metrics`` (averaged over
the ranks), ``sums`` (summed) and ``samples``. The built-in ops below are registered the way a
user's are: a user's module calls ``register_op`` and a graph file names the module under
``plugins`` (``hybridflow.graph.plugins``). This module imports no Ray, vLLM or megatron.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, create_model

from hybridflow.data import keys as K
from hybridflow.spec.graph import (
    AdvantageOptions,
    FilterOptions,
    GenerateOptions,
    JudgeOptions,
    MultiTurnOptions,
    NodeBase,
    NoOptions,
    PairUpdateOptions,
    ScoreOptions,
    Spec,
    UpdateOptions,
    node_types,
    set_node_types,
)

Body = Callable[..., tuple]  # (ctx, batch, node) -> (TensorDict, meta)
_BODIES: dict[str, Body] = {}  # "module:function" -> the function, once imported

ANY_ROLE = frozenset({"actor", "critic", "ref", "reward", "cost", "teacher"})


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
    the main one); ``body``: ``"module:function"`` of the function that runs it on a worker, by
    role where they differ (imported on first use, in the worker process only).

    Flags the rest of the code asks instead of an op's name: ``text``: the body reads
    per-sample strings (prompt text, ground truth); ``generates``: the op runs the actor's
    rollout engine (needs rollout settings, is split over the generation layout, and makes
    ``rollout.n`` samples per prompt, 1 when greedy); ``multi_turn``: its rollouts are episodes
    against the environment its options name (``env``, ``env_kwargs``: built before the run
    starts; a turn's context is shared across the episode); ``judges``: it generates with its
    own model's rollout engine from other nodes' outputs (an LLM judge): the model needs rollout
    settings, is built as a causal LM, and colocation keeps its rollout engine resident for the
    op; its outputs keep their inputs' samples per prompt; ``trains``: it changes its model's
    weights (the model is checkpointed, and its workers keep optimizer state); ``scores``: it
    scores responses (validation and ``hybridflow eval`` run it); ``forward``: a forward pass of
    its model over the responses (the cost model prices it so); ``refills``: the op drops
    prompt groups and the controller re-runs the nodes before it on fresh prompts until the
    batch is full again (dynamic sampling); every later reader of its input keys reads its
    output (``graph.dag``), so its output size is not known before it finishes."""

    name: str
    roles: frozenset[str]
    options: type[Spec]
    body: str | Mapping[str, str]
    inputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    outputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    writes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    slots: Mapping[str, Slot] = field(default_factory=dict)
    text: bool = False
    generates: bool = False
    multi_turn: bool = False
    judges: bool = False
    trains: bool = False
    scores: bool = False
    forward: bool = False
    refills: bool = False

    def __post_init__(self) -> None:
        bodies = [self.body] if isinstance(self.body, str) else list(self.body.values())
        for path in bodies:
            module, sep, attr = path.partition(":")
            if not (sep and module and attr):
                raise ValueError(f"op {self.name!r}: body must be 'module:function', got {path!r}")
        if not isinstance(self.body, str) and set(self.body) != set(self.roles):
            raise ValueError(f"op {self.name!r}: a body per role needs one for each of {sorted(self.roles)}")

    def default_inputs(self, role: str) -> tuple[str, ...]:
        return self.inputs.get(role, self.inputs.get("*", ()))

    def default_outputs(self, role: str) -> tuple[str, ...]:
        return self.outputs.get(role, self.outputs.get("*", ()))

    def body_for(self, role: str) -> str:
        """``"module:function"`` of the body a node of this op on a model of ``role`` runs."""
        return self.body if isinstance(self.body, str) else self.body[role]

    def load_body(self, role: str) -> Body:
        """The body function itself, imported on first use (ImportError / AttributeError with
        the op's name when it cannot be found)."""
        path = self.body_for(role)
        if path not in _BODIES:
            module_name, _, attr = path.partition(":")
            try:
                fn = getattr(importlib.import_module(module_name), attr)
            except AttributeError:
                raise AttributeError(f"op {self.name!r}: module {module_name!r} has no body {attr!r}") from None
            _BODIES[path] = fn
        return _BODIES[path]

    @property
    def runs_rollout_engine(self) -> bool:
        """The op runs its model's rollout engine (colocation reloads it first)."""
        return self.generates or self.judges

    def slots_for(self, role: str) -> dict[str, Slot]:
        return {name: s for name, s in self.slots.items() if s.roles is None or role in s.roles}


SCORE_KEYS = ("scores", "costs")  # sequence-level signals an advantage is taken of
VALUE_KEYS = ("values", "cost_values")
ADVANTAGE_KEYS = ("advantages", "cost_advantages")

# What the data source writes before any node runs.
SOURCE_WRITES = {
    "prompts": (K.PROMPT_IDS, K.PROMPT_MASK, K.UID, K.PROMPT_TEXT, K.GROUND_TRUTH, K.DATA_SOURCE, K.EXTRA_INFO),
    # Preference pairs (``hybridflow.data.preferences``): a graph reads prompts or pairs, and a
    # graph that reads pairs trains scalar models and has no actor. Safety signs: cost pairs.
    "pairs": (K.PROMPT_IDS, K.PROMPT_MASK, K.UID, K.PROMPT_TEXT, K.CHOSEN_IDS, K.CHOSEN_MASK, K.REJECTED_IDS,
              K.REJECTED_MASK, K.PAIR_MARGIN, K.CHOSEN_SAFETY_SIGN, K.REJECTED_SAFETY_SIGN),
}
_ROLLOUT = (K.RESPONSES, K.RESPONSE_MASK, K.INPUT_IDS, K.ATTENTION_MASK, K.POSITION_IDS, K.TRUNCATED)

OPS: dict[str, Op] = {}


def register_op(op: Op) -> Op:
    """Add ``op``: graph files and builders may name it from now on (its node model, an
    ``op: Literal[name]`` node with ``options: op.options``, joins ``GraphSpec``'s node union).
    Registering the same record again (a module imported twice) is a no-op; another record
    under a taken name is refused."""
    if op.name in OPS:
        if OPS[op.name] == op:
            return op
        raise ValueError(f"op {op.name!r} is already registered")
    OPS[op.name] = op
    types = node_types()
    title = "".join(part.title() for part in op.name.split("_"))
    node = create_model(
        f"{title}Node",
        __base__=NodeBase,
        __module__=op.options.__module__,
        op=(Literal[op.name], ...),
        options=(op.options, Field(default_factory=op.options)),
    )
    # Found by name in the options' module, so that a pickled node (a graph sent to the
    # workers) refers to its class the way it refers to its options' class.
    setattr(sys.modules[op.options.__module__], node.__name__, node)
    types[op.name] = node
    set_node_types(types)
    return op


def unregister_op(name: str) -> None:
    """Remove an op ``register_op`` added (tests, notebooks)."""
    del OPS[name]
    node = node_types()[name]
    module = sys.modules.get(node.__module__)
    if module is not None and getattr(module, node.__name__, None) is node:
        delattr(module, node.__name__)
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
    body="hybridflow.workers.ops.rollout:generate",
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
    body="hybridflow.workers.ops.multi_turn:generate_multi_turn",
    inputs={"*": ("prompts",)},
    outputs={"*": ("responses", "scores")},
    writes={
        "responses": (*_ROLLOUT, K.ROLLOUT_LOG_PROBS, K.WEIGHT_VERSION, K.WEIGHT_VERSION_LAST, *SOURCE_WRITES["prompts"][2:]),
        "scores": (K.SCORES, K.TOKEN_REWARDS),
    },
    text=True,
    generates=True,
    multi_turn=True,
))
register_op(Op(
    "log_prob",
    roles=frozenset({"actor", "ref", "teacher"}),
    options=NoOptions,
    body="hybridflow.workers.ops.forward:log_prob",
    forward=True,
    inputs={"*": ("responses",)},
    outputs={"actor": ("old_log_probs",), "ref": ("ref_log_probs",), "teacher": ("teacher_log_probs",)},
    writes={
        "old_log_probs": (K.OLD_LOG_PROBS,),
        "ref_log_probs": (K.REF_LOG_PROBS,),
        "teacher_log_probs": (K.TEACHER_LOG_PROBS,),
    },
))
register_op(Op(
    "values",
    roles=frozenset({"critic"}),
    options=NoOptions,
    body="hybridflow.workers.ops.forward:values",
    forward=True,
    inputs={"*": ("responses",)},
    outputs={"*": ("values",)},
    writes={"values": (K.VALUES,), "cost_values": (K.COST_VALUES,)},
))
register_op(Op(
    "score",
    roles=frozenset({"reward", "cost"}),
    options=ScoreOptions,
    body="hybridflow.workers.ops.score:score",
    scores=True,
    forward=True,  # a learned scorer's; a rule's is priced by its own profile entries
    inputs={"*": ("responses",)},
    outputs={"reward": ("scores",), "cost": ("costs",)},
    writes={
        "scores": (K.SCORES, K.TOKEN_REWARDS),
        "costs": (K.COSTS,),
        "baseline_scores": (K.BASELINE_SCORES,),
    },
    text=True,  # a rule reads the prompt and the ground truth
))
# An LLM judge: the node's model writes a verdict on each response with its rollout engine,
# and the score is parsed from it (hybridflow.rewards.judge).
register_op(Op(
    "judge",
    roles=frozenset({"reward", "cost"}),
    options=JudgeOptions,
    body="hybridflow.workers.ops.judge:judge",
    scores=True,
    judges=True,
    inputs={"*": ("responses",)},
    outputs={"reward": ("scores",), "cost": ("costs",)},
    writes={"scores": (K.SCORES, K.TOKEN_REWARDS), "costs": (K.COSTS,)},
    text=True,  # the template holds the prompt's text and the ground truth
))
# Pure math: runs on the workers of whichever model the node names (put it next to its consumer
# so the advantages never leave those processes).
register_op(Op(
    "advantage",
    roles=ANY_ROLE,
    options=AdvantageOptions,
    body="hybridflow.workers.ops.advantage:advantage",
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
    body="hybridflow.workers.ops.filter:filter_groups",
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
    body={"actor": "hybridflow.workers.ops.update:update_policy", "critic": "hybridflow.workers.ops.update:update_critic"},
    trains=True,
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
# A reward or cost model trained on preference pairs (the graph's data are pair files): one
# forward over chosen and rejected together, a PAIR_LOSSES loss. Scores too: validation runs it
# with ``train: false`` on the held-out pairs (val/rm/accuracy), as does ``hybridflow eval``.
register_op(Op(
    "pair_update",
    roles=frozenset({"reward", "cost"}),
    options=PairUpdateOptions,
    body="hybridflow.workers.ops.preference:pair_update",
    trains=True,
    inputs={"*": ("pairs",)},
    outputs={"*": ()},
))
