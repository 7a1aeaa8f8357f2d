"""An op of your own: how many of a prompt's samples are distinct responses.

GRPO learns from the differences within a prompt's group of samples; when the policy collapses
to one answer per prompt the groups stop differing and learning stalls. This op watches for
that: per iteration, the mean fraction of distinct responses in a group (1.0: all differ) as
``diversity/distinct_frac``. It writes no key, so nothing waits for it.

The record and the body are all there is: a graph file names this module under ``plugins``
(``grpo_diversity.yaml`` next to it), and ``hybridflow validate`` / ``run`` import it.
"""

from __future__ import annotations

from pydantic import Field
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.graph.ops import Op, register_op
from hybridflow.spec.graph import Spec


class DiversityOptions(Spec):
    prefix_tokens: int = Field(0, ge=0, description="Compare the first N response tokens only; 0 = whole responses.")


def distinct_responses(ctx, batch: TensorDict, node) -> tuple[TensorDict, dict]:
    """``ctx``: the worker's context (engines, tokenizer, graph); ``batch``: this rank's whole
    prompt groups (a group's samples share a ``uid``)."""
    width = node.spec.options.prefix_tokens or batch[K.RESPONSES].shape[1]
    tokens = (batch[K.RESPONSES] * batch[K.RESPONSE_MASK])[:, :width].tolist()
    groups: dict[int, set] = {}
    sizes: dict[int, int] = {}
    for uid, row in zip(batch[K.UID].tolist(), tokens):
        groups.setdefault(uid, set()).add(tuple(row))
        sizes[uid] = sizes.get(uid, 0) + 1
    fracs = [len(groups[uid]) / sizes[uid] for uid in groups]
    return TensorDict({}, batch_size=batch.batch_size), {"metrics": {"diversity/distinct_frac": sum(fracs) / len(fracs)}}


register_op(Op(
    "distinct_responses",
    roles=frozenset({"actor", "ref", "reward"}),
    options=DiversityOptions,
    body="diversity:distinct_responses",
    inputs={"*": ("responses",)},
    outputs={"*": ()},
))
