"""The Lagrange multiplier of constrained RLHF (Safe-RLHF, Dai et al. 2023).

The actor maximises ``J_reward - lambda * (J_cost - threshold)``; lambda >= 0 is raised by
gradient ascent on the same Lagrangian: it grows while the mean episode cost is above the
threshold and shrinks (down to 0) while it is below.
"""

from __future__ import annotations


class LagrangeMultiplier:
    """``lambda <- max(0, lambda + lr * (mean_cost - threshold))``, with its state for checkpoints.

    Args:
        init: starting lambda (>= 0).
        lr: step size of the ascent.
        threshold: the cost budget ``d`` of the constraint ``J_cost <= d``.
        max_value: optional upper bound (None = unbounded).
    """

    def __init__(self, init: float, lr: float, threshold: float, max_value: float | None = None) -> None:
        if init < 0:
            raise ValueError(f"a Lagrange multiplier starts >= 0, got {init}")
        self.value = float(init)
        self.lr = float(lr)
        self.threshold = float(threshold)
        self.max_value = max_value

    def update(self, mean_cost: float) -> float:
        """One ascent step from this batch's mean episode cost; returns the new lambda."""
        value = max(0.0, self.value + self.lr * (float(mean_cost) - self.threshold))
        if self.max_value is not None:
            value = min(value, self.max_value)
        self.value = value
        return value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
