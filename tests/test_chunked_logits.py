"""Chunked log-probs and entropy (hybridflow/algos/chunked_logits.py) against the full logits."""

import pytest
import torch

from hybridflow.algos import entropy_from_logits, log_probs_from_logits
from hybridflow.algos.chunked_logits import chunked_log_probs_entropy


def _inputs(dtype, n=23, d=16, v=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(v, d, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    mask = (torch.rand(n, generator=g) > 0.3).to(dtype)
    # Downstream weights on both read-outs, as a loss with an entropy bonus has.
    w_lp = torch.randn(n, generator=g, dtype=dtype)
    w_ent = torch.randn(n, generator=g, dtype=dtype)
    return hidden, weight, targets, mask, w_lp, w_ent


def _grads(log_probs, entropy, hidden, weight, mask, w_lp, w_ent):
    loss = (log_probs * w_lp * mask).sum() + (entropy * w_ent * mask).sum()
    return torch.autograd.grad(loss, (hidden, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 5, 7, 23, 64])  # 5 and 7 do not divide 23; 64 > N
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_full_logits(dtype, chunk, temperature):
    hidden, weight, targets, mask, w_lp, w_ent = _inputs(dtype)
    logits = (hidden @ weight.T) / temperature
    ref_lp = log_probs_from_logits(logits[None], targets[None])[0]
    ref_ent = entropy_from_logits(logits[None])[0]
    ref_grads = _grads(ref_lp, ref_ent, hidden, weight, mask, w_lp, w_ent)

    lp, ent = chunked_log_probs_entropy(hidden, weight, targets, temperature, chunk)
    assert lp.dtype == dtype and ent.dtype == dtype
    grads = _grads(lp, ent, hidden, weight, mask, w_lp, w_ent)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Masked-out tokens pass no gradient to their hidden states.
    assert bool((grads[0][mask == 0] == 0).all())


def test_only_log_probs_used_and_tied_weight():
    """A loss without an entropy term (grad_entropy None) and a weight that is also used as an
    input embedding (tied): autograd adds both uses' gradients."""
    hidden, weight, targets, mask, w_lp, _ = _inputs(torch.float64, seed=1)
    tokens = torch.randint(0, weight.shape[0], (hidden.shape[0],))

    def loss(read_out):
        h = hidden + weight[tokens]  # the "embedding" use of the tied weight
        return (read_out(h) * w_lp * mask).sum()

    full = loss(lambda h: log_probs_from_logits((h @ weight.T)[None], targets[None])[0])
    chunked = loss(lambda h: chunked_log_probs_entropy(h, weight, targets, 1.0, 4)[0])
    want = torch.autograd.grad(full, (hidden, weight))
    got = torch.autograd.grad(chunked, (hidden, weight))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=0)


def test_bfloat16_products_close_to_full():
    hidden, weight, targets, *_ = _inputs(torch.float32, seed=2)
    h, w = hidden.detach().bfloat16(), weight.detach().bfloat16()
    logits = (h @ w.T).float()
    lp, ent = chunked_log_probs_entropy(h, w, targets, 1.0, 6)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, log_probs_from_logits(logits[None], targets[None])[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, entropy_from_logits(logits[None])[0], atol=1e-5, rtol=0)


def test_bad_chunk_size():
    hidden, weight, targets, *_ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_log_probs_entropy(hidden, weight, targets, 1.0, 0)
