"""Which prompt groups carry a learning signal (DAPO's dynamic sampling).

A group whose samples all score the same has a group-relative advantage of 0 for every sample
(GRPO, RLOO, ...): it adds nothing to the gradient but dilutes it. DAPO drops such groups and
refills the batch with fresh prompts; the ``filter`` op does that, this is its test.
"""

from __future__ import annotations

import torch


def informative_groups(values: torch.Tensor, uid: torch.Tensor) -> torch.Tensor:
    """(B,) bool: True for the samples of groups (equal ``uid``) whose ``values`` (B,) are not
    all equal (exact comparison: max > min). A group of one is never informative."""
    if values.shape != uid.shape or values.dim() != 1:
        raise ValueError(f"informative_groups expects values and uid (B,); got {tuple(values.shape)}, {tuple(uid.shape)}")
    _, group_of = torch.unique(uid, return_inverse=True)
    num_groups = int(group_of.max()) + 1 if group_of.numel() else 0
    highest = values.new_zeros(num_groups).scatter_reduce(0, group_of, values, "amax", include_self=False)
    lowest = values.new_zeros(num_groups).scatter_reduce(0, group_of, values, "amin", include_self=False)
    return (highest > lowest)[group_of]
