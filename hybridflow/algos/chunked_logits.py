"""Log-probs and entropy from final hidden states without a full-vocabulary logits tensor.

An LM head over a micro-batch of N tokens with a V-word vocabulary makes an (N, V) logits
tensor; with a real vocabulary (SmolLM2: 49,152) and a few thousand tokens that is hundreds of
MB in float32, and ``log_softmax`` + entropy then make several more of the same size, all kept
for the backward. :func:`chunked_log_probs_entropy` computes the same two (N,) read-outs a chunk
of ``chunk_tokens`` tokens at a time and keeps only the hidden states and one log-sum-exp and
entropy per token; its backward recomputes each chunk's logits. Peak extra memory is a few
(chunk_tokens, V) float32 tensors, in the forward and in the backward.

Gradients, with ``z = hidden @ weight.T / temperature`` (float32), ``p = softmax(z)`` and
``lse = logsumexp(z)``:

- ``log_prob = z[target] - lse``: ``d log_prob / dz = onehot(target) - p``;
- ``entropy = -sum(p * log p)``: ``d entropy / dz = -p * (log p + entropy)``.

The weight may be the input embedding itself (tied embeddings): its gradient from here is added
to the embedding's by autograd like any other use.
"""

from __future__ import annotations

import torch

__all__ = ["chunked_log_probs_entropy"]


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n, D) x (V, D) -> (n, V) float32 logits / temperature; the product in the inputs' dtype."""
    logits = hidden @ weight.T
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return logits / temperature


class _ChunkedLogProbsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_tokens):
        num = hidden.shape[0]
        out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        log_probs = torch.empty(num, dtype=out_dtype, device=hidden.device)
        entropy = torch.empty(num, dtype=out_dtype, device=hidden.device)
        lse = torch.empty(num, dtype=out_dtype, device=hidden.device)
        for start in range(0, num, chunk_tokens):
            stop = min(start + chunk_tokens, num)
            log_p = _chunk_logits(hidden[start:stop], weight, temperature)
            lse[start:stop] = torch.logsumexp(log_p, dim=-1)
            log_p -= lse[start:stop, None]  # in place: one (chunk, V) tensor less
            log_probs[start:stop] = log_p.gather(1, targets[start:stop, None])[:, 0]
            entropy[start:stop] = -(log_p.exp() * log_p).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_tokens = chunk_tokens
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_tokens = ctx.temperature, ctx.chunk_tokens
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        accumulate = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_weight = torch.zeros_like(weight, dtype=accumulate) if need_weight else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            stop = min(start + chunk_tokens, hidden.shape[0])
            h = hidden[start:stop]
            log_p = _chunk_logits(h, weight, temperature)
            log_p -= lse[start:stop, None]
            grad_z = log_p.exp()  # p, turned into dL/dz in place below
            # dL/dz = p * (-g_lp - g_ent * (log p + H)) + onehot(target) * g_lp
            if grad_entropy is not None:
                coef = log_p.add_(entropy[start:stop, None]).mul_(-grad_entropy[start:stop, None])
                if grad_log_probs is not None:
                    coef -= grad_log_probs[start:stop, None]
                grad_z *= coef
            elif grad_log_probs is not None:
                grad_z *= -grad_log_probs[start:stop, None]
            else:
                grad_z.zero_()
            if grad_log_probs is not None:
                grad_z.scatter_add_(1, targets[start:stop, None], grad_log_probs[start:stop, None])
            if temperature != 1.0:
                grad_z /= temperature
            grad_z = grad_z.to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:stop] = grad_z @ weight
            if need_weight and grad_weight.dtype == h.dtype:
                grad_weight.addmm_(grad_z.T, h)  # in place: no (V, D) temporary per chunk
            elif need_weight:
                grad_weight += (grad_z.T @ h).to(grad_weight.dtype)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_log_probs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy at each position, a chunk at a time.

    Equals ``log_probs_from_logits(logits, targets)`` and ``entropy_from_logits(logits)`` with
    ``logits = (hidden @ weight.T).float() / temperature`` (up to float rounding), in the
    forward and in the backward, without holding more than ``chunk_tokens`` rows of logits.

    Args:
        hidden: (N, D) final hidden states (after the model's last norm); float32, float64 or
            a half dtype (the product then runs in it, the softmax in float32).
        weight: (V, D) the LM head's weight (no bias), same dtype as ``hidden``.
        targets: (N,) int64 token ids in ``[0, V)``.
        temperature: divides the logits.
        chunk_tokens: rows of logits computed at once (any N; the last chunk may be shorter).

    Returns:
        ``(log_probs, entropy)``, each (N,) float32 (float64 for float64 inputs), both
        differentiable with respect to ``hidden`` and ``weight``.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden (N, D) and weight (V, D) expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    # Autocast off: the products run in the inputs' dtype, which the caller chose.
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedLogProbsEntropy.apply(hidden, weight, targets, float(temperature), int(chunk_tokens))
