"""Pure tensor math for RLHF: advantages, policy losses, KL, loss aggregation.

No Ray, vLLM or megatron here. Functions the graph refers to by name live in the registries.
"""

from hybridflow.algos.advantages import (
    discounted_returns,
    gae_advantage,
    grpo_advantage,
    masked_whiten,
    reinforce_plus_plus_advantage,
    reinforce_plus_plus_baseline_advantage,
    remax_advantage,
    rloo_advantage,
    safe_rlhf_advantage,
    zero_without_groups,
)
from hybridflow.algos.filtering import informative_groups
from hybridflow.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLEstimator,
    kl_penalty,
)
from hybridflow.algos.lagrangian import LagrangeMultiplier
from hybridflow.algos.losses import (
    agg_loss,
    clipped_value_loss,
    count_sequences,
    explained_variance,
    entropy_from_logits,
    log_probs_from_logits,
    ReduceSum,
    local_sum,
    masked_mean,
    cispo_policy_loss,
    gspo_policy_loss,
    ppo_clip_policy_loss,
    token_mean,
)
from hybridflow.algos.preference import (
    bradley_terry_loss,
    pairwise_metrics,
    safe_rlhf_cost_loss,
    squash_scores,
)
from hybridflow.algos.running_moments import RunningMoments
from hybridflow.algos.rollout_correction import (
    IS_LEVELS,
    Correction,
    correction_metrics,
    correction_stats,
    rollout_correction,
)
from hybridflow.algos.registry import (
    ADV_ESTIMATORS,
    LOSS_AGGS,
    PAIR_LOSSES,
    POLICY_LOSSES,
    Registry,
    UnknownNameError,
)

__all__ = [
    "IS_LEVELS",
    "Correction",
    "correction_metrics",
    "correction_stats",
    "rollout_correction",
    "ADV_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "LagrangeMultiplier",
    "clipped_value_loss",
    "count_sequences",
    "discounted_returns",
    "explained_variance",
    "gae_advantage",
    "informative_groups",
    "masked_whiten",
    "reinforce_plus_plus_advantage",
    "reinforce_plus_plus_baseline_advantage",
    "remax_advantage",
    "rloo_advantage",
    "safe_rlhf_advantage",
    "zero_without_groups",
    "KL_ESTIMATORS",
    "LOSS_AGGS",
    "PAIR_LOSSES",
    "RunningMoments",
    "bradley_terry_loss",
    "pairwise_metrics",
    "safe_rlhf_cost_loss",
    "squash_scores",
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
    "gspo_policy_loss",
    "cispo_policy_loss",
    "token_mean",
    "ReduceSum",
    "local_sum",
]
