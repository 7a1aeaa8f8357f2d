"""Pure tensor math for RLHF: advantages, policy losses, KL, loss aggregation.

No Ray, vLLM or megatron here. Functions the graph refers to by name live in the registries.
"""

from hybridflow.algos.advantages import grpo_advantage
from hybridflow.algos.kl import KL_ESTIMATORS, KLEstimator, kl_penalty
from hybridflow.algos.losses import (
    agg_loss,
    entropy_from_logits,
    log_probs_from_logits,
    masked_mean,
    ppo_clip_policy_loss,
    token_mean,
)
from hybridflow.algos.registry import (
    ADV_ESTIMATORS,
    LOSS_AGGS,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
)

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGS",
    "POLICY_LOSSES",
    "KLEstimator",
    "Registry",
    "UnknownNameError",
    "agg_loss",
    "entropy_from_logits",
    "grpo_advantage",
    "kl_penalty",
    "log_probs_from_logits",
    "masked_mean",
    "ppo_clip_policy_loss",
    "token_mean",
]
