"""Per-token KL estimators between the policy and a reference, from samples of the policy.

With ``x ~ pi`` and ``log r = log ref(x) - log pi(x)``, each estimator's expectation over ``x``
relates to ``KL(pi || ref)`` (Schulman, "Approximating KL divergence"):

- ``k1 = -log r`` — unbiased, high variance, can be negative per token.
- ``k2 = 0.5 * (log r)^2`` — biased, low variance, always >= 0.
- ``k3 = r - 1 - log r`` — unbiased, low variance, always >= 0.
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

# exp(20) ~ 4.9e8: k3 stays finite in float32 (and bf16) even for tokens the two models
# disagree on wildly; beyond it the estimate only saturates.
_MAX_LOG_RATIO = 20.0


def kl_penalty(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    estimator: KLEstimator,
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || ref)`` at tokens sampled from ``pi``.

    Args:
        log_probs: (B, R) float, ``log pi`` of the sampled tokens.
        ref_log_probs: (B, R) float, ``log ref`` of the same tokens.
        estimator: ``"k1"`` (``logp - logr``), ``"k2"`` (``0.5 * (logp - logr)^2``) or ``"k3"``
            (``exp(logr - logp) - (logr - logp) - 1``, with ``logr - logp`` clamped to
            [-20, 20] so the exponential cannot overflow).

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
        return log_ratio.exp() - log_ratio - 1
    expected = ", ".join(KL_ESTIMATORS)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {expected}")
