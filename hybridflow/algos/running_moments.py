"""Running mean and standard deviation of a learned scorer's scores, for score normalisation.

A reward model's raw scale is arbitrary (the Bradley-Terry loss fixes only differences), so its
users normalise each score by the mean and std of all scores seen so far, as OpenRLHF's
``normalize_reward`` and TRL's ``RunningMoments`` do. Batches are merged exactly (Chan, Golub
and LeVeque's pairwise update), so the moments after any sequence of batches equal those of
their concatenation, however the batches were cut or spread over data-parallel ranks.
"""

from __future__ import annotations

import math

import torch

from hybridflow.algos.losses import ReduceSum, local_sum


class RunningMoments:
    """Count, mean and sum of squared deviations (``m2``) of every value seen, in float64.

    ``std`` is the unbiased one, ``sqrt(m2 / (count - 1))``, and 1.0 until two values are seen
    (nothing to scale by yet). Its state goes into checkpoints like a Lagrange multiplier's.
    """

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = eps
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count >= 2 else 1.0

    def update(self, values: torch.Tensor, reduce_sum: ReduceSum = local_sum) -> None:
        """Merge a batch of scores (B,), spread over the ranks that ``reduce_sum`` adds over."""
        values = values.detach().to(torch.float64).flatten()
        count, total = reduce_sum(torch.stack([torch.tensor(float(values.numel()), dtype=torch.float64), values.sum()])).tolist()
        if count == 0:
            return
        batch_mean = total / count
        batch_m2 = float(reduce_sum((values - batch_mean).square().sum()))
        merged = self.count + count
        delta = batch_mean - self.mean
        self.mean += delta * count / merged
        self.m2 += batch_m2 + delta * delta * self.count * count / merged
        self.count = merged

    def normalize(self, values: torch.Tensor) -> torch.Tensor:
        """``(values - mean) / max(std, eps)``, in the dtype of ``values`` (B,)."""
        return ((values.to(torch.float64) - self.mean) / max(self.std, self.eps)).to(values.dtype)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])
