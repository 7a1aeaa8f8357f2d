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


# -- the torch train engine on a real tiny transformers model ----------------------------------

from tensordict import NonTensorStack, TensorDict  # noqa: E402

from hybridflow.algos import agg_loss  # noqa: E402
from hybridflow.data import keys as K  # noqa: E402
from hybridflow.engines.base import SamplingParams  # noqa: E402
from hybridflow.engines.hf_rollout import HFRolloutEngine  # noqa: E402
from hybridflow.engines.models import build_causal_lm  # noqa: E402
from hybridflow.engines.torch_engine import GATHER_BEFORE_HEAD_VOCAB, TorchTrainEngine  # noqa: E402
from hybridflow.spec.engines import TorchTrainSpec  # noqa: E402
from hybridflow.spec.graph import ModelSource, OptimSpec  # noqa: E402

PAD, EOS, VOCAB = 0, 1, 2 * GATHER_BEFORE_HEAD_VOCAB  # a vocabulary the chunked read-out serves


def _source(tied: bool) -> ModelSource:
    return ModelSource(config={"tie_word_embeddings": tied})


def _rollouts(tied: bool) -> TensorDict:
    """4 prompts x 3 samples of ragged lengths (two prompts shared, for share_prompts)."""
    ids = torch.tensor([[PAD, PAD, 5, 6, 7], [3, 4, 5, 6, 7], [PAD, 9, 2, 3, 10], [PAD] * 4 + [8]])
    prompts = TensorDict(
        {
            K.PROMPT_IDS: ids,
            K.PROMPT_MASK: (ids != PAD).long(),
            K.UID: torch.arange(4),
            K.PROMPT_TEXT: NonTensorStack(*"abcd"),
            K.GROUND_TRUTH: NonTensorStack(*"abcd"),
        },
        batch_size=[4],
    )
    torch.manual_seed(0)
    # Generated by a 12-word model, which ends samples early: ragged lengths, so masks matter.
    rollout = HFRolloutEngine(build_causal_lm(_source(tied), 12, PAD, EOS, seed=3), eos_id=EOS, pad_id=PAD)
    return rollout.generate(prompts, SamplingParams(n=3, max_new_tokens=9, temperature=1.5))


def _loss_with_entropy(mb, out):
    """Token-mean NLL minus an entropy bonus: both read-outs carry gradient."""
    value = -out["log_probs"] - 0.3 * out["entropy"]
    return agg_loss(value, mb[K.RESPONSE_MASK], "token-mean", out["num_global_tokens"]), {}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_engine_chunked_read_outs_and_step_equal_full_logits(tied, layout):
    torch.set_num_threads(1)
    batch = _rollouts(tied)
    assert batch[K.RESPONSE_MASK].sum(-1).min() < batch[K.RESPONSES].shape[1]  # ragged: masks matter

    def engine(chunk):
        spec = TorchTrainSpec(
            micro_batch_size=6, remove_padding=layout == "packed", share_prompts=layout == "shared",
            optim=OptimSpec(grad_clip=None), logits_chunk_tokens=chunk,
        )
        return TorchTrainEngine(build_causal_lm(_source(tied), VOCAB, PAD, EOS, seed=2), spec)

    full, chunked = engine(None), engine(5)  # 5 divides no micro-batch's token count here
    assert chunked._chunk_head is not None and full._chunk_head is None
    assert (chunked.module.get_output_embeddings().weight is chunked.module.get_input_embeddings().weight) == tied
    projected: list[int] = []
    chunked.module.get_output_embeddings().register_forward_hook(lambda m, a, o: projected.append(a[0].shape[-2]))
    a, b = full.forward(batch, temperature=0.8), chunked.forward(batch, temperature=0.8)
    assert projected and set(projected) == {0}  # the model's own head projected no token
    mask = batch[K.RESPONSE_MASK].bool()
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0)
        assert bool((b[key][~mask] == 0).all())
    # One SGD step of lr 1: the weights move by minus the gradient, so equal weights after it
    # mean equal gradients (of the transformer body, the embedding and the head).
    for e in (full, chunked):
        e.optimizer = torch.optim.SGD(e.module.parameters(), lr=1.0)
    start = [p.detach().clone() for p in full.module.parameters()]
    loss_a = full.train_step(batch, _loss_with_entropy, temperature=0.8)["loss"]
    loss_b = chunked.train_step(batch, _loss_with_entropy, temperature=0.8)["loss"]
    assert abs(loss_a - loss_b) < 1e-5
    moved = max((p - q).abs().max().item() for p, q in zip(full.module.parameters(), start))
    diff = max((p - q).abs().max().item() for p, q in zip(full.module.parameters(), chunked.module.parameters()))
    assert moved > 1e-3 and diff < 1e-5 * max(1.0, moved), (diff, moved)


def test_engine_bfloat16_compute_chunked_close_to_full():
    batch = _rollouts(True)

    def engine(chunk):
        spec = TorchTrainSpec(micro_batch_size=6, compute_dtype="bfloat16", logits_chunk_tokens=chunk)
        return TorchTrainEngine(build_causal_lm(_source(True), VOCAB, PAD, EOS, seed=2), spec)

    full, chunked = engine(None), engine(4)
    a, b = full.forward(batch), chunked.forward(batch)
    assert b["log_probs"].dtype == torch.float32
    # Both project in bfloat16; only the order of float32 reductions differs.
    assert (a["log_probs"] - b["log_probs"]).abs().max().item() < 1e-4
    metrics = chunked.train_step(batch, _loss_with_entropy)
    assert metrics["skipped_step"] == 0.0 and all(p.dtype == torch.float32 for p in chunked.module.parameters())


def test_a_small_vocabulary_keeps_the_models_logits():
    model = build_causal_lm(_source(True), 64, PAD, EOS, seed=2)
    assert TorchTrainEngine(model, TorchTrainSpec())._chunk_head is None


def test_engine_lora_chunked_equals_full_logits():
    """A LoRA actor (every linear layer but the head, tied head frozen): the chunked read-out
    passes no gradient to the frozen head and the adapters' step equals the full logits' one."""
    from hybridflow.spec.graph import LoraSpec

    batch = _rollouts(True)

    def engine(chunk):
        spec = TorchTrainSpec(
            micro_batch_size=6, optim=OptimSpec(grad_clip=None), logits_chunk_tokens=chunk,
            lora=LoraSpec(rank=4, alpha=8, target_modules="all-linear"),
        )
        e = TorchTrainEngine(build_causal_lm(_source(True), VOCAB, PAD, EOS, seed=2), spec)
        e.optimizer = torch.optim.SGD([p for p in e.module.parameters() if p.requires_grad], lr=1.0)
        return e

    full, chunked = engine(None), engine(5)
    assert chunked._chunk_head is not None and not chunked._chunk_head.weight.requires_grad
    a, b = full.forward(batch), chunked.forward(batch)
    torch.testing.assert_close(b["log_probs"], a["log_probs"], atol=1e-5, rtol=0)
    full.train_step(batch, _loss_with_entropy)
    chunked.train_step(batch, _loss_with_entropy)
    trained = [(n, p) for n, p in full.module.named_parameters() if p.requires_grad]
    other = dict(chunked.module.named_parameters())
    assert trained and all("lora" in n for n, _ in trained)
    diff = max((p - other[n]).abs().max().item() for n, p in trained)
    assert diff < 1e-5, diff
    # The step moved the adapters (B starts at 0, so a moved B means a real gradient).
    assert max(p.abs().max().item() for n, p in trained if "lora_B" in n) > 1e-4
