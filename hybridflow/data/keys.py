"""The batch vocabulary: every field name a batch may carry, defined once.

Conventions (B = samples in the batch, P = prompt length, R = response length, T = P + R):

- Prompts are **left-padded** to P; ``prompt_mask`` marks real prompt tokens.
- Responses are **right-padded** to R; ``response_mask`` covers the response up to and
  including EOS. A response that hit ``max_response_length`` without EOS is ``truncated``.
- ``input_ids`` is prompt and response side by side (B, T); ``attention_mask`` is
  ``prompt_mask`` and ``response_mask`` side by side; ``position_ids`` count real tokens from 0,
  so left padding does not shift positions.
- A sequence-level reward is placed on the last valid response token of ``token_rewards``.
- Every sample carries ``uid``, the index of its prompt, so group-wise estimators find the group.

Per-token fields over the response are (B, R) and aligned with ``responses``: the value at
``[:, j]`` belongs to the token ``responses[:, j]``.
"""

# -- prompts (produced by the data source) ---------------------------------------------------
PROMPT_IDS = "prompt_ids"  # (B, P) int64, left-padded prompt tokens
PROMPT_MASK = "prompt_mask"  # (B, P) int64, 1 on real prompt tokens
UID = "uid"  # (B,) int64, id of the prompt a sample answers; equal within a group
PROMPT_TEXT = "prompt_text"  # non-tensor (B,) str, the prompt as text
GROUND_TRUTH = "ground_truth"  # non-tensor (B,) str, the expected answer (may be "")
DATA_SOURCE = "data_source"  # non-tensor (B,) str, the row's data set (verl's data_source; may be "")
EXTRA_INFO = "extra_info"  # non-tensor (B,) str, the row's extra_info as JSON ("null" when none)

# -- rollout (produced by generate) ----------------------------------------------------------
RESPONSES = "responses"  # (B, R) int64, right-padded sampled tokens
RESPONSE_MASK = "response_mask"  # (B, R) int64, 1 up to and including EOS
INPUT_IDS = "input_ids"  # (B, T) int64, prompt_ids ++ responses
ATTENTION_MASK = "attention_mask"  # (B, T) int64, prompt_mask ++ response_mask
POSITION_IDS = "position_ids"  # (B, T) int64, cumsum(attention_mask) - 1, clamped at 0
TRUNCATED = "truncated"  # (B,) bool, response reached max length without EOS
ROLLOUT_LOG_PROBS = "rollout_log_probs"  # (B, R) float, log-probs the rollout engine sampled with
# (B,) bool, whether the row's rollout_log_probs were recorded (absent: every row's were); a row
# without them holds zeros (rollout.log_prob_check_samples)
ROLLOUT_LOG_PROBS_RECORDED = "rollout_log_probs_recorded"
WEIGHT_VERSION = "weight_version"  # (B,) int64, policy version (actor updates applied) that generated the sample
# (B,) int64, the version of its last token: above weight_version when new weights loaded while
# the sample was in flight (trainer.async.partial_rollout), else equal to it
WEIGHT_VERSION_LAST = "weight_version_last"
WEIGHT_LOADS = "weight_loads"  # (B,) int64, weight loads while in flight (a rollout engine's, partial rollouts)

# -- forward passes ---------------------------------------------------------------------------
OLD_LOG_PROBS = "old_log_probs"  # (B, R) float, actor log-probs before the update (behaviour policy)
REF_LOG_PROBS = "ref_log_probs"  # (B, R) float, reference model log-probs
TEACHER_LOG_PROBS = "teacher_log_probs"  # (B, R) float, a frozen teacher's log-probs of the student's tokens (distillation)
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"  # (B, R) float, detached truncated-IS weight (update-internal)
ENTROPY = "entropy"  # (B, R) float, per-token entropy of the actor's distribution
VALUES = "values"  # (B, R) float, critic value estimates

# -- rewards and advantages -------------------------------------------------------------------
SCORES = "scores"  # (B,) float, sequence-level reward from a reward node
TOKEN_REWARDS = "token_rewards"  # (B, R) float, SCORES placed on the last valid response token
ADVANTAGES = "advantages"  # (B, R) float, per-token advantages (zero outside response_mask)
RETURNS = "returns"  # (B, R) float, value targets
BASELINE_SCORES = "baseline_scores"  # (B,) float, reward of the baseline (ReMax: greedy) response

# -- costs (Safe-RLHF): the same shapes as their reward twins ---------------------------------
COSTS = "costs"  # (B,) float, sequence-level cost from a cost node
COST_VALUES = "cost_values"  # (B, R) float, cost-critic value estimates
COST_ADVANTAGES = "cost_advantages"  # (B, R) float, per-token cost advantages
COST_RETURNS = "cost_returns"  # (B, R) float, cost-critic value targets

# -- preference pairs (produced by the preference data source, ``hybridflow.data.preferences``) --
# A pair batch holds B pairs: prompt_ids, prompt_mask, uid and prompt_text as a prompt batch,
# then two responses to each prompt, right-padded to one length R, EOS last. "Chosen" is the
# response a scalar model must score higher: the preferred one for a reward model, the less safe
# one for a cost model.
CHOSEN_IDS = "chosen_ids"  # (B, R) int64, right-padded tokens of the response that must score higher
CHOSEN_MASK = "chosen_mask"  # (B, R) int64, 1 on the chosen response's tokens, EOS included
REJECTED_IDS = "rejected_ids"  # (B, R) int64, right-padded tokens of the other response
REJECTED_MASK = "rejected_mask"  # (B, R) int64, 1 on the rejected response's tokens, EOS included
PAIR_MARGIN = "pair_margin"  # (B,) float, how far chosen must score above rejected (0: plain Bradley-Terry)
CHOSEN_SAFETY_SIGN = "chosen_safety_sign"  # (B,) float, cost pairs: +1 if the chosen response is unsafe, -1 if safe
REJECTED_SAFETY_SIGN = "rejected_safety_sign"  # (B,) float, cost pairs: the same for the rejected response

# Which of these fields each graph-level key (a node's input or output) stands for is part of the
# op that writes it: ``hybridflow.graph.ops`` (``graph_keys()``).
