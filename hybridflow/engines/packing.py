"""Remove padding before a forward: pack a micro-batch's sequences into as few rows as fit.

A rollout batch is padded to ``max_prompt_length + max_new_tokens`` columns, but on a task
with short answers most of those columns are padding (a 64-token budget with 10-token answers
is ~80% padding) and a padded forward/backward pays for all of them. ``pack`` lays the valid
tokens of every sample end to end into rows of the padded width (first-fit, longest first), with
each sample's own position ids. transformers reads the restart of the position ids as a
sequence boundary when no attention mask is passed (``find_packed_sequence_indices``) and builds
a block-diagonal causal mask, so every token attends to its own sample only: the outputs equal
the padded forward's up to float rounding.

``Packed.index`` maps each sample's last ``num_tail`` padded columns to their positions in the
flattened packed output, so callers gather ``out.flatten(0, 1)[packed.index]`` and get the same
``(B, num_tail, ...)`` slice the padded forward's ``out[:, -num_tail:]`` would give. Columns that
were padding point at a valid token of the same sample (finite outputs, to be masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Packed", "pack"]


@dataclass(frozen=True)
class Packed:
    input_ids: torch.Tensor  # (rows, width)
    position_ids: torch.Tensor  # (rows, width); each sample and each row's tail restart at 0
    index: torch.Tensor  # (B, num_tail) into the flattened (rows * width) outputs


def _first_fit(lengths: list[int], width: int) -> list[tuple[int, int]]:
    """(row, offset) per sample: longest first, each into the first row with room."""
    free: list[int] = []  # room left per row
    place: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for sample in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[sample]
        row = next((r for r, room in enumerate(free) if room >= length), len(free))
        if row == len(free):
            free.append(width)
        place[sample] = (row, width - free[row])
        free[row] -= length
    return place


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    num_tail: int,
) -> Packed:
    """Pack the valid tokens (``attention_mask`` 1) of ``input_ids`` (B, T) into rows of width T.

    ``num_tail``: how many of the last padded columns the caller reads outputs from (the
    response tokens and the position before them). Every sample needs at least one valid token.
    """
    batch, width = input_ids.shape
    valid = attention_mask.bool()
    lengths = valid.sum(-1)
    if bool((lengths == 0).any()):
        raise ValueError("pack: every sample needs at least one valid token")
    place = torch.tensor(_first_fit(lengths.tolist(), width), dtype=torch.long).reshape(batch, 2)
    rows = int(place[:, 0].max()) + 1
    starts = place[:, 0] * width + place[:, 1]  # flat position of each sample's first token
    # Flat destination of each valid token, in the row-major order of input_ids[valid].
    within = torch.cumsum(valid.long(), dim=-1) - 1  # index of a valid token inside its sample
    dest_map = starts[:, None] + within  # (B, T); meaningful where valid
    dest = dest_map[valid]

    flat_ids = torch.zeros(rows * width, dtype=input_ids.dtype)
    flat_ids[dest] = input_ids[valid]
    # Row tails (unused room) count up from 0 as a sequence of their own.
    flat_pos = torch.arange(rows * width).remainder(width)
    used = torch.zeros(rows * width, dtype=torch.bool)
    used[dest] = True
    tail_start = torch.zeros(rows, dtype=torch.long)
    tail_start.scatter_reduce_(0, place[:, 0], place[:, 1] + lengths, reduce="amax")
    flat_pos = torch.where(used, 0, flat_pos - tail_start.repeat_interleave(width))
    flat_pos[dest] = position_ids[valid].to(flat_pos.dtype)

    # A padded tail column points at the sample's last valid token.
    last = starts + lengths - 1
    index = torch.where(valid, dest_map, last[:, None])[:, -num_tail:]
    return Packed(
        input_ids=flat_ids.view(rows, width),
        position_ids=flat_pos.view(rows, width),
        index=index,
    )
