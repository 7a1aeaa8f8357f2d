"""TRL 1.16's GRPO update, written out from its source so the equivalence tests run without TRL.

What each step follows in ``trl/trainer/grpo_trainer.py`` (GRPOTrainer, trl==1.16.0):

- completion mask (``_generate_single_turn``, transformers path): 1 up to and including the
  first EOS, 0 after it; a completion without EOS keeps all its tokens (``mask_truncated_
  completions`` is off by default);
- advantages (``_generate_and_score_completions``, ``multi_objective_aggregation=
  "sum_then_normalize"``): ``(r - group mean) / (std + 1e-4)`` with ``scale_rewards="group"``,
  where ``std`` is ``trl.trainer.utils.nanstd``: the *unbiased* (Bessel-corrected) std;
- per-token log-probs (``_get_per_token_logps_and_entropies`` through ``add_fused_lm_head``): the
  model is called with ``input_ids`` and ``attention_mask`` only (no ``position_ids``), the
  hidden state at position t scores token t + 1, logits are divided by the temperature before
  the log-softmax;
- loss (``_compute_loss``, ``importance_sampling_level="token"``, ``beta=0``): ``coef_1 =
  exp(logp - old)`` with ``old = logp.detach()`` when ``num_iterations == 1``, ``coef_2 =
  clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)``, per-token loss ``-min(coef_1 * A, coef_2 *
  A)``; ``loss_type="dapo"`` divides the masked sum by ``num_items_in_batch / num_processes``
  (the batch's completion tokens; one process, one accumulation step here), ``"grpo"`` averages
  per-sequence token means;
- the step (transformers' Trainer): ``clip_grad_norm_(max_grad_norm)`` then AdamW
  (``optim="adamw_torch_fused"``, the default for torch >= 2.8: ``torch.optim.AdamW(fused=True)``).

Sampling (transformers path, ``GRPOTrainer.__init__``): ``GenerationConfig(max_new_tokens,
do_sample=True, pad_token_id, bos_token_id, eos_token_id, temperature, top_p, top_k, min_p,
repetition_penalty, cache_implementation)``; transformers turns it into the warpers
temperature -> top-k -> top-p (``GenerationMixin._get_logits_processor``; each skipped at its
neutral value), and TRL's loss reads the log-probs of the sampled tokens from its own forward
at ``logits / temperature``, over the whole vocabulary.

Keyword switches (``biased_std``, ``mask_after_eos``, ``loss_type``) exist for the tests'
negative cases: each shows that changing one normalisation breaks the equality.
"""

from __future__ import annotations

import torch
from torch import nn

TRL_STD_EPSILON = 1e-4


def generation_config(temperature: float, top_k: int, top_p: float, max_new_tokens: int, pad_id: int, eos_id: int):
    """The ``GenerationConfig`` TRL 1.16 generates with (GRPOConfig defaults for the rest)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=pad_id, bos_token_id=None,
        eos_token_id=[eos_id], temperature=temperature, top_p=top_p, top_k=top_k, min_p=None,
        repetition_penalty=1.0, cache_implementation=None, disable_compile=True,
    )


def allowed_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """(N, V) bool: the tokens transformers' warpers leave to sample from, in their order."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    scores = logits.float()
    for warper in warpers:
        scores = warper(None, scores)
    return torch.isfinite(scores)


def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int], mask_after_eos: bool = True) -> torch.Tensor:
    """(B, C) int: 1 up to and including the first EOS (all ones without EOS)."""
    if not mask_after_eos:
        return torch.ones_like(completion_ids)
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
    has_eos = is_eos.any(dim=1)
    eos_idx[has_eos] = is_eos.int().argmax(dim=1)[has_eos]
    return (torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1) <= eos_idx[:, None]).int()


def group_advantages(rewards: torch.Tensor, num_generations: int, biased_std: bool = False) -> torch.Tensor:
    """(B,) ``(r - group mean) / (group std + 1e-4)``, groups of ``num_generations`` adjacent rows."""
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    std = grouped.std(dim=1, correction=0 if biased_std else 1).repeat_interleave(num_generations)
    return (rewards - mean) / (std + TRL_STD_EPSILON)


def per_token_logps(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion: int, temperature: float
) -> torch.Tensor:
    """(B, C) log-probs of the last ``num_completion`` tokens, as TRL's fused LM head computes them."""
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden[:, :-1]) / temperature
    labels = input_ids[:, 1:]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[..., None])[..., 0]
    return logps[:, -num_completion:]


def grpo_loss(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    temperature: float,
    epsilon: float = 0.2,
    loss_type: str = "dapo",
) -> torch.Tensor:
    """The scalar TRL backpropagates for one batch (one process, one accumulation step)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, mask], dim=1)
    logps = per_token_logps(model, input_ids, attention_mask, completion_ids.size(1), temperature)
    coef_1 = torch.exp(logps - logps.detach())
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
    adv = advantages[:, None]
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    mask = mask.to(per_token_loss.dtype)
    if loss_type == "dapo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    raise ValueError(f"loss_type {loss_type!r} is not written out here")


def make_optimizer(model: nn.Module, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, fused: bool = True):
    """transformers' Trainer optimizer for ``weight_decay=0``: AdamW over every trainable parameter."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=lr, betas=betas, eps=eps, weight_decay=0.0, fused=fused
    )


def train_step(model: nn.Module, optimizer, loss: torch.Tensor, max_grad_norm: float) -> dict:
    """Backward, clip, step; returns the loss, the pre-clip norm and the clipped gradients."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "grads": grads}
