"""Per-token KL estimators between the policy and a reference, from samples of the policy.

With ``x ~ pi`` and ``log r = log ref(x) - log pi(x)``, each estimator's expectation over ``x``
relates to ``KL(pi || ref)`` (Schulman, "Approximating KL divergence"):

- ``k1 = -log r`` — unbiased, high variance, can be negative per token.
- ``k2 = 0.5 * (log r)^2`` — biased, low variance, always >= 0.
- ``k3 = r - 1 - log r`` — unbiased, low variance, always >= 0; bounded per token to
  ``[-bound, bound]`` (default 10, as verl's ``low_var_kl``): with the log-ratio clamped at
  +-20 alone it could reach ~5e8 on one token and swamp the loss.
- ``abs = |log r|`` — biased, always >= 0 (verl's ``abs``).
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3", "abs"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
DEFAULT_K3_BOUND = 10.0

# exp(20) ~ 4.9e8: k3 stays finite in float32 (and bf16) even for tokens the two models
# disagree on wildly; beyond it the estimate only saturates.
_MAX_LOG_RATIO = 20.0


def kl_penalty(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    estimator: KLEstimator,
    bound: float | None = DEFAULT_K3_BOUND,
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || ref)`` at tokens sampled from ``pi``.

    Args:
        log_probs: (B, R) float, ``log pi`` of the sampled tokens.
        ref_log_probs: (B, R) float, ``log ref`` of the same tokens.
        estimator: ``"k1"`` (``logp - logr``), ``"k2"`` (``0.5 * (logp - logr)^2``) or ``"k3"``
            (``exp(logr - logp) - (logr - logp) - 1``, with ``logr - logp`` clamped to
            [-20, 20] so the exponential cannot overflow) or ``"abs"`` (``|logp - logr|``).
        bound: k3 only: each token's estimate is clamped to ``[-bound, bound]``; None = no
            bound (the log-ratio clamp alone).

    Returns:
        (B, R) float. Not masked: multiply by the response mask (or aggregate with it).
    """
    diff = log_probs - ref_log_probs
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":
        log_ratio = (-diff).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        k3 = log_ratio.exp() - log_ratio - 1
        return k3 if bound is None else k3.clamp(-bound, bound)
    if estimator == "abs":
        return diff.abs()
    expected = ", ".join(KL_ESTIMATORS)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {expected}")


class FixedKLController:
    """A constant KL-penalty coefficient (the controller interface of ``AdaptiveKLController``)."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, num_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """KL coefficient steered towards a target KL (Ziegler et al. 2019, "Fine-tuning LMs...").

    After each batch: ``e = clip(current_kl / target - 1, -0.2, 0.2)`` and
    ``coef *= 1 + e * num_steps / horizon``; the coefficient grows while the KL is above the
    target and shrinks while it is below.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, num_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * num_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
