"""The learning-rate schedule of every train engine (``train.optim`` in a graph file).

One function below both engines: the torch engine wraps it in ``torch.optim.lr_scheduler.
LambdaLR``; the megatron engine sets its optimizer's learning rate from it before each step.
"""

from __future__ import annotations

import math

from hybridflow.spec.graph import OptimSpec


def lr_factor(step: int, optim: OptimSpec, total_steps: int) -> float:
    """LR multiplier for 0-based optimizer step ``step``.

    Warm-up: ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps. Then 1
    (constant) or a cosine from 1 at step ``warmup_steps`` towards ``min_lr_ratio`` at step
    ``total_steps``, held there after.
    """
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * cosine
