"""A user's op, outside the hybridflow package: its record and its body in one module.

A graph file names this module under ``plugins``; importing it registers ``length_bonus``.
It imports nothing that starts Ray, vLLM or megatron, so ``hybridflow validate`` stays light.
"""

from __future__ import annotations

from pydantic import Field
from tensordict import TensorDict

from hybridflow.graph.ops import Op, register_op
from hybridflow.spec.graph import Spec


class LengthBonusOptions(Spec):
    scale: float = Field(1.0, gt=0, description="Bonus per response token.")


def length_bonus(ctx, batch: TensorDict, node) -> tuple[TensorDict, dict]:
    """``scale`` x each response's length in tokens, as the key ``bonus``."""
    lengths = batch["response_mask"].sum(-1).float()
    bonus = node.spec.options.scale * lengths
    out = TensorDict({node.outputs[0]: bonus}, batch_size=batch.batch_size)
    return out, {"metrics": {"bonus/mean": float(bonus.mean())}}


LENGTH_BONUS = register_op(Op(
    "length_bonus",
    roles=frozenset({"reward"}),
    options=LengthBonusOptions,
    body="length_bonus:length_bonus",
    inputs={"*": ("responses",)},
    outputs={"*": ("bonus",)},
    writes={"bonus": ("bonus",)},
))
