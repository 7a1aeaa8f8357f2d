"""The ending rule of the score node: a response that did not end scores a fixed value.

A response *ended* when its last valid token is EOS and the token right before that EOS (if
any) is not another special token. It did not end when:

- it is ``truncated``: no EOS within ``max_response_length`` tokens;
- it ends ``... <special> <eos>``: a pad, unk or other special token right before the EOS.

Rule rewards score decoded text, and decoding drops special tokens (``skip_special_tokens``): a
policy that pads its answer with special tokens up to the length limit, or in front of EOS,
reads exactly like one that stopped, so without this rule nothing teaches it to stop.
Neural reward models see the tokens, but a truncated answer's score is as unreliable there.

The same function serves TRL's side of ``benchmarks/peers.py`` (through ``completion_ids``), so
both frameworks optimise the same reward.

Shapes: B = samples, R = response length.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.rewards.overlong import OVERLONG_FIELDS
from hybridflow.spec.graph import ScoreOptions


ENDING_FIELDS = frozenset({"unfinished", "unfinished_score"})  # ScoreOptions fields of this rule


# ScoreOptions fields checked before the run starts (controller/preflight.py), not by the scorer
PREFLIGHT_FIELDS = frozenset({"ground_truth"})
NODE_FIELDS = frozenset({"normalize", "squash", "read", "log_prefix"})  # the score node applies them, not the scorer


def scorer_options(options: ScoreOptions) -> dict:
    """The scorer's keywords: every ``ScoreOptions`` field but the ending rule's, the
    overlong punishment's, the ones preflight checks and the score node's own (normalisation,
    squashing, logging)."""
    return options.model_dump(exclude=ENDING_FIELDS | OVERLONG_FIELDS | PREFLIGHT_FIELDS | NODE_FIELDS)


def unfinished_mask(
    responses: torch.Tensor, response_mask: torch.Tensor, eos_id: int, special_ids: Collection[int]
) -> torch.Tensor:
    """(B,) bool: True where a response did not end (see the module docstring).

    Args:
        responses: (B, R) int64, right-padded response tokens.
        response_mask: (B, R), 1 on the valid tokens (up to and including the first EOS); every
            row has at least one valid token.
        eos_id: the end-of-sequence token id.
        special_ids: ids of every special token (``tokenizer.all_special_ids``); ``eos_id`` in
            it or not makes no difference.
    """
    valid = response_mask.to(torch.bool)
    lengths = valid.sum(-1)
    assert bool((lengths > 0).all()), "every response has at least one valid token"
    rows = torch.arange(responses.shape[0], device=responses.device)
    last = responses[rows, lengths - 1]
    before = responses[rows, (lengths - 2).clamp(min=0)]
    specials = torch.tensor(sorted(set(special_ids) - {eos_id}), dtype=responses.dtype, device=responses.device)
    special_before = (lengths > 1) & torch.isin(before, specials)
    return (last != eos_id) | special_before


def resolve_unfinished(mode: str, role: str) -> str:
    """``auto`` -> ``replace`` on a reward node, ``keep`` on a cost node.

    A cost is minimised: a low fixed cost for unfinished samples would reward not finishing,
    and the reward node already makes not finishing worthless.
    """
    if mode == "auto":
        return "keep" if role == "cost" else "replace"
    return mode


def apply_ending_rule(
    scores: torch.Tensor, batch: TensorDict, tokenizer, options: ScoreOptions, role: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The score node's scores (B,) after the rule, and the (B,) unfinished mask.

    Per the node's ``options.unfinished`` (resolved for ``role``, the scoring model's role):
    ``replace`` puts ``options.unfinished_score`` on every response that did not end; ``keep``
    returns the scores unchanged (the mask is still computed, for the metrics).
    """
    unfinished = unfinished_mask(
        batch[K.RESPONSES], batch[K.RESPONSE_MASK], tokenizer.eos_token_id, tokenizer.all_special_ids
    )
    if resolve_unfinished(options.unfinished, role) == "replace":
        scores = torch.where(unfinished, torch.full_like(scores, options.unfinished_score), scores)
    return scores, unfinished
