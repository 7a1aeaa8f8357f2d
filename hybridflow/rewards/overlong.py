"""DAPO's soft overlong punishment (Yu et al. 2025), a score-node option.

A response of ``L`` tokens (``response_mask`` summed: EOS included) under a length limit
``L_max`` and a buffer of ``b`` tokens loses

    penalty * clip((L - (L_max - b)) / b, 0, 1)

from its score: nothing up to ``L_max - b`` tokens, rising linearly over the buffer, the whole
``penalty`` at ``L_max``. It is applied after the ending rule (``rewards.ending``), so a
truncated response scores ``unfinished_score - penalty``.
"""

from __future__ import annotations

import torch

OVERLONG_FIELDS = frozenset({"overlong_buffer", "overlong_penalty"})  # ScoreOptions fields


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float) -> torch.Tensor:
    """(B,) float32: the amount each response of ``lengths`` (B,) tokens loses (>= 0)."""
    if not 1 <= buffer <= max_length:
        raise ValueError(f"overlong_buffer must be in [1, max_response_length={max_length}], got {buffer}")
    excess = lengths.to(torch.float32) - (max_length - buffer)
    return penalty * (excess / buffer).clamp(0.0, 1.0)
