"""Remove padding before a forward: pack a micro-batch's sequences into as few rows as fit.

A rollout batch is padded to ``max_prompt_length + max_new_tokens`` columns, but on a task
with short answers most of those columns are padding (a 64-token budget with 10-token answers
is ~80% padding) and a padded forward/backward pays for all of them. ``pack`` lays the valid
tokens of every sample end to end into rows (first-fit, longest first; rows of the padded width
or of the longest sample, whichever holds the batch in fewer tokens), with each sample's own
position ids. transformers reads the restart of the position ids as a
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

__all__ = [
    "Packed",
    "SharedPrompts",
    "pack",
    "pack_shared_prompts",
    "shared_prompts_cheaper",
    "token_budget_micro_batches",
]


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


def _rows(lengths: list[int], padded_width: int) -> tuple[int, list[tuple[int, int]]]:
    """(row width, ``_first_fit`` places) of the packing with the fewest row tokens, rows of
    the padded width or of the longest sample.

    The padded width fits short samples several to a row; the longest sample's width wastes
    nothing when samples are about equally long: with every response at the new-token limit,
    prompts of 4-6 tokens in an 8-token prompt budget leave 2-4 columns of each padded row
    unused (4-10% of the tokens at 24-48 new tokens), which rows of the longest sample drop.
    """
    candidates = []
    for width in sorted({max(lengths), padded_width}):
        place = _first_fit(lengths, width)
        rows = 1 + max(row for row, _ in place)
        candidates.append((rows * width, width, place))
    _, width, place = min(candidates, key=lambda c: (c[0], c[1]))
    return width, place


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    num_tail: int,
) -> Packed:
    """Pack the valid tokens (``attention_mask`` 1) of ``input_ids`` (B, T) into rows of width T
    or of the longest sample, whichever needs fewer row tokens (``_rows``).

    ``num_tail``: how many of the last padded columns the caller reads outputs from (the
    response tokens and the position before them). Every sample needs at least one valid token.
    """
    batch, padded_width = input_ids.shape
    valid = attention_mask.bool()
    lengths = valid.sum(-1)
    if bool((lengths == 0).any()):
        raise ValueError("pack: every sample needs at least one valid token")
    width, place = _rows(lengths.tolist(), padded_width)
    place = torch.tensor(place, dtype=torch.long).reshape(batch, 2)
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


@dataclass(frozen=True)
class SharedPrompts:
    input_ids: torch.Tensor  # (1, L): each distinct prompt once, then its samples' responses
    position_ids: torch.Tensor  # (1, L): the samples' own position ids
    attention_mask: torch.Tensor  # (1, 1, L, L) bool, True = may attend
    index: torch.Tensor  # (B, num_tail) into the L packed outputs
    num_groups: int  # distinct prompts


def pack_shared_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    num_tail: int,
    prompt_width: int,
) -> SharedPrompts:
    """Lay a micro-batch out as one row in which each distinct prompt appears once.

    GRPO-style batches hold ``n`` samples of every prompt, and with real chat prompts the prompt
    is most of each sample's tokens (SmolLM2 on ``arith_words``: ~64 of ~94). Here the valid
    tokens of each distinct prompt (the first ``prompt_width`` columns, compared with their
    padding) come once, followed by the valid response tokens of each of its samples. The
    attention mask lets a token see the earlier tokens of its own prompt and, for a response
    token, the earlier tokens of its own response: exactly what it sees in the padded forward,
    so the outputs equal the padded forward's up to float rounding, and autograd sums each
    sample's gradient through the shared prompt. ``index`` is ``pack``'s: each sample's last
    ``num_tail`` padded columns (a prompt column reads the shared prompt's output; a padding
    column the sample's last valid token).

    The mask is dense, (tokens of the micro-batch)^2 booleans, as SDPA's masked path needs:
    meant for micro-batches of up to a few thousand tokens.
    """
    batch, width = input_ids.shape
    device = input_ids.device
    valid = attention_mask.bool()
    if bool((valid[:, :prompt_width].sum(-1) == 0).any()):
        raise ValueError("pack_shared_prompts: every sample needs at least one prompt token")
    group = _prompt_groups(input_ids, valid, prompt_width)

    tokens: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    owner: list[torch.Tensor] = []  # per packed token: (group, sample), sample -1 = the prompt
    dest_map = torch.zeros(batch, width, dtype=torch.long, device=device)
    prompt_start: dict[int, int] = {}
    offset = 0

    def put(row: int, cols: torch.Tensor, group_id: int, sample: int) -> int:
        nonlocal offset
        start = offset
        tokens.append(input_ids[row, cols])
        positions.append(position_ids[row, cols])
        owner.append(torch.tensor([[group_id, sample]], device=device).expand(len(cols), 2))
        offset += len(cols)
        return start

    for row in range(batch):
        g = int(group[row])
        prompt_cols = valid[row, :prompt_width].nonzero()[:, 0]
        if g not in prompt_start:
            prompt_start[g] = put(row, prompt_cols, g, -1)
        dest_map[row, prompt_cols] = prompt_start[g] + torch.arange(len(prompt_cols), device=device)
        response_cols = valid[row, prompt_width:].nonzero()[:, 0] + prompt_width
        start = put(row, response_cols, g, row)
        dest_map[row, response_cols] = start + torch.arange(len(response_cols), device=device)

    owner_t = torch.cat(owner)
    same_group = owner_t[:, None, 0] == owner_t[None, :, 0]
    key_sample = owner_t[None, :, 1]
    visible = (key_sample == -1) | (key_sample == owner_t[:, None, 1])
    causal = torch.ones(offset, offset, dtype=torch.bool, device=device).tril()
    last = dest_map.gather(1, (valid.long() * torch.arange(width, device=device)).argmax(-1, keepdim=True))
    index = torch.where(valid, dest_map, last)[:, -num_tail:]
    return SharedPrompts(
        input_ids=torch.cat(tokens)[None],
        position_ids=torch.cat(positions)[None].to(position_ids.dtype),
        attention_mask=(same_group & visible & causal)[None, None],
        index=index,
        num_groups=len(prompt_start),
    )


def _prompt_groups(input_ids: torch.Tensor, valid: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """(B,) index of each sample's distinct prompt (its valid first ``prompt_width`` tokens)."""
    prompt_key = torch.where(valid[:, :prompt_width], input_ids[:, :prompt_width], -1)
    return torch.unique(prompt_key, dim=0, return_inverse=True)[1]


def shared_prompts_cheaper(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    *,
    token_flops: float,
    pair_flops: float,
    packed: bool = True,
) -> bool:
    """Whether ``pack_shared_prompts``' one row costs fewer FLOPs than the other layout.

    Sharing removes the repeated prompt tokens, but its mask is dense: every token of the row is
    scored against every other (SDPA computes the masked-out pairs too), so attention grows with
    the square of the micro-batch's tokens instead of each sample's. With long prompts and short
    responses (SmolLM2's chat prompts) sharing wins; with short prompts and long responses (the
    copy task at 24-48 new tokens, 64 samples in one row) it measured 1.8-4.9x slower than
    packing (``benchmarks/packing_layouts.py``). Each layout is costed as ``tokens * token_flops + attended pairs *
    pair_flops``: one row of the shared tokens against ``pack``'s rows (``packed``) or the
    padded batch itself (``packed=False``), whose masks are a width squared per row.

    Args:
        token_flops: a token's forward FLOPs outside attention (2 x the weights it meets).
        pair_flops: one (query, key) pair's attention FLOPs, summed over layers.
    """
    batch, width = input_ids.shape
    valid = attention_mask.bool()
    group = _prompt_groups(input_ids, valid, prompt_width)
    prompt_lengths = valid[:, :prompt_width].sum(-1)
    first = torch.full((int(group.max()) + 1,), batch, dtype=torch.long)
    first.scatter_reduce_(0, group, torch.arange(batch), reduce="amin")
    shared_tokens = int(prompt_lengths[first].sum() + valid[:, prompt_width:].sum())
    rows = batch
    if packed:
        width, place = _rows(valid.sum(-1).tolist(), width)
        rows = 1 + max(row for row, _ in place)
    shared = shared_tokens * token_flops + shared_tokens**2 * pair_flops
    other = rows * width * token_flops + rows * width**2 * pair_flops
    return shared < other


def token_budget_micro_batches(tokens: list[int], budget: int) -> list[list[int]]:
    """Cut samples into micro-batches of at most ``budget`` tokens each, balanced.

    Like verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``: ``k = ceil(sum / budget)``
    micro-batches to start with; samples, longest first, each go to the least-loaded
    micro-batch that still has room; when one fits in none, ``k`` grows by one and the cut
    starts again. A sample longer than ``budget`` gets a micro-batch of its own.

    Args:
        tokens: the token count of each sample (what a forward of it costs).
        budget: the most tokens of one micro-batch (>= 1).

    Returns:
        Sample indices per micro-batch, each list ascending, micro-batches ordered by their
        first sample; together every index exactly once. Empty for no samples.
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    alone = [i for i, n in enumerate(tokens) if n > budget]
    rest = [i for i, n in enumerate(tokens) if n <= budget]
    order = sorted(rest, key=lambda i: (-tokens[i], i))
    parts = max(1, -(-sum(tokens[i] for i in rest) // budget)) if rest else 0
    while rest:
        loads, groups = [0] * parts, [[] for _ in range(parts)]
        for i in order:
            fits = [g for g in range(parts) if loads[g] + tokens[i] <= budget]
            if not fits:
                break
            g = min(fits, key=lambda g: (loads[g], g))
            loads[g] += tokens[i]
            groups[g].append(i)
        else:
            break
        parts += 1
    micro = [sorted(g) for g in groups if g] if rest else []
    micro += [[i] for i in alone]
    return sorted(micro, key=lambda g: g[0])
