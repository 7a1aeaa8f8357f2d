"""What each op is: which roles may run it, and the data keys it reads and writes by default."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class OpInfo:
    """One op: roles allowed to run it and default keys (by role where they differ)."""

    roles: frozenset[str]
    inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # role ("*" = any) -> keys
    outputs: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def default_inputs(self, role: str) -> tuple[str, ...]:
        return self.inputs.get(role, self.inputs.get("*", ()))

    def default_outputs(self, role: str) -> tuple[str, ...]:
        return self.outputs.get(role, self.outputs.get("*", ()))


ANY_ROLE = frozenset({"actor", "critic", "ref", "reward", "cost"})

OPS: dict[str, OpInfo] = {
    "generate": OpInfo(
        roles=frozenset({"actor"}),
        inputs={"*": ("prompts",)},
        outputs={"*": ("responses",)},
    ),
    "log_prob": OpInfo(
        roles=frozenset({"actor", "ref"}),
        inputs={"*": ("responses",)},
        outputs={"actor": ("old_log_probs",), "ref": ("ref_log_probs",)},
    ),
    "values": OpInfo(
        roles=frozenset({"critic"}), inputs={"*": ("responses",)}, outputs={"*": ("values",)}
    ),
    "score": OpInfo(
        roles=frozenset({"reward", "cost"}),
        inputs={"*": ("responses",)},
        outputs={"reward": ("scores",), "cost": ("costs",)},
    ),
    # Pure math: runs on the workers of whichever model the node names (put it next to its
    # consumer so the advantages never leave those processes).
    "advantage": OpInfo(
        roles=ANY_ROLE, inputs={"*": ("responses", "scores")}, outputs={"*": ("advantages",)}
    ),
    "update": OpInfo(
        roles=frozenset({"actor", "critic"}),
        inputs={
            "actor": ("responses", "old_log_probs", "advantages"),
            "critic": ("responses", "values", "advantages"),
        },
        outputs={"*": ()},
    ),
}
