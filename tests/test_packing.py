"""Padding removal: packed forwards equal padded ones on a real transformers model."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from hybridflow.algos import agg_loss
from hybridflow.data import keys as K
from hybridflow.engines.base import SamplingParams
from hybridflow.engines.hf_rollout import HFRolloutEngine
from hybridflow.engines.models import build_causal_lm, build_value_model
from hybridflow.engines.packing import pack, pack_shared_prompts, shared_prompts_cheaper
from hybridflow.engines.torch_engine import TorchTrainEngine, check_packing
from hybridflow.spec.engines import TorchTrainSpec
from hybridflow.spec.graph import ModelSource, OptimSpec, TrainEngineSpec

PAD, EOS, VOCAB = 0, 1, 12
TINY = ModelSource(config={})

torch.set_num_threads(1)


def test_pack_places_every_valid_token_once():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [3, 4, 5, 6, 7, 8], [0, 9, 2, 0, 0, 0]])
    mask = (ids != 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = pack(ids, mask, positions, num_tail=3)
    # 6 + 3 + 2 = 11 tokens: the 6-token sample fills row 0, the other two share row 1.
    assert packed.input_ids.shape == (2, 6)
    assert packed.input_ids[0].tolist() == [3, 4, 5, 6, 7, 8]
    assert packed.input_ids[1, :5].tolist() == [5, 6, 7, 9, 2]
    assert packed.position_ids[1].tolist() == [0, 1, 2, 0, 1, 0]  # the tail restarts too
    flat = packed.input_ids.flatten()
    # Valid tail columns read their own token; padding columns read the sample's last token.
    assert flat[packed.index].tolist() == [[6, 7, 7], [6, 7, 8], [2, 2, 2]]


def test_equal_lengths_pack_into_rows_of_the_longest_sample():
    """Samples of 4 valid tokens in a padded width of 6: two never share a row, so rows of 4
    hold them in 12 tokens instead of 18."""
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [0, 3, 4, 5, 6, 0], [9, 2, 3, 4, 0, 0]])
    mask = (ids != 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    packed = pack(ids, mask, positions, num_tail=2)
    assert packed.input_ids.shape == (3, 4)
    assert sorted(packed.input_ids.tolist()) == [[3, 4, 5, 6], [5, 6, 7, 8], [9, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3]] * 3
    flat = packed.input_ids.flatten()
    assert flat[packed.index].tolist() == [[7, 8], [6, 6], [4, 4]]


def test_pack_rejects_an_empty_sample():
    ids = torch.tensor([[0, 0], [3, 4]])
    with pytest.raises(ValueError, match="at least one valid token"):
        pack(ids, (ids != 0).long(), torch.zeros_like(ids), 1)


def test_pack_shared_prompts_lays_each_prompt_once():
    # Samples 0 and 2 share the prompt [5, 6] (left-padded); sample 1 has its own, [4, 5, 6].
    ids = torch.tensor([[0, 5, 6, 7, 8], [4, 5, 6, 9, 0], [0, 5, 6, 3, 0]])
    mask = (ids != 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    shared = pack_shared_prompts(ids, mask, positions, num_tail=3, prompt_width=3)
    assert shared.num_groups == 2
    # prompt [5, 6], sample 0's [7, 8], prompt [4, 5, 6], sample 1's [9], sample 2's [3]
    assert shared.input_ids.tolist() == [[5, 6, 7, 8, 4, 5, 6, 9, 3]]
    assert shared.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 2]]
    allowed = shared.attention_mask[0, 0]
    assert allowed[8].nonzero()[:, 0].tolist() == [0, 1, 8]  # its prompt and itself, not sample 0
    assert allowed[3].nonzero()[:, 0].tolist() == [0, 1, 2, 3]
    assert allowed[7].nonzero()[:, 0].tolist() == [4, 5, 6, 7]
    # Tail columns: the last prompt token (shared), then the responses (padding: last token).
    assert shared.input_ids[0][shared.index].tolist() == [[6, 7, 8], [6, 9, 9], [6, 3, 3]]
    assert shared.index[0, 0] == shared.index[2, 0] == 1  # one position serves both samples


def _one_prompt_batch(prompt_len: int, response_len: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([torch.full((samples, prompt_len), 5), torch.full((samples, response_len), 7)], 1)
    return ids, torch.ones_like(ids)


def test_sharing_is_chosen_only_where_it_saves_flops():
    """Shared prompts cost (tokens)^2 attention in one row: worth it for long prompts and short
    responses, not for short prompts and long responses."""
    costs = dict(token_flops=1000.0, pair_flops=10.0)
    # 64-token prompt, 16-token responses, 8 samples: 192 shared tokens against 640 packed.
    assert shared_prompts_cheaper(*_one_prompt_batch(64, 16, 8), prompt_width=64, **costs)
    # 4-token prompt, 48-token responses, 16 samples: 772 tokens in one row (596k pairs) against
    # 16 rows of 52 (43k pairs) for 60 extra tokens.
    assert not shared_prompts_cheaper(*_one_prompt_batch(4, 48, 16), prompt_width=4, **costs)
    # Attention for free: any saved token pays.
    assert shared_prompts_cheaper(*_one_prompt_batch(4, 48, 16), prompt_width=4, token_flops=1.0, pair_flops=0.0)


def test_packed_rows_are_costed_after_packing():
    """The layout without sharing is costed as pack lays it out: short samples share a row, so
    fewer rows, padded tokens and pairs than the padded batch has."""
    ids, mask = _one_prompt_batch(2, 30, 8)
    mask[:, 2 + 8 :] = 0  # 10 valid tokens of 32
    costs = dict(token_flops=1.0, pair_flops=0.05)
    # Shared: 2 + 8 x 8 = 66 tokens, 66^2 pairs: 66 + 217.8 = 283.8.
    # Packed: 8 rows of 10 (fewer tokens than 3 rows of 32): 80 + 8 x 10^2 x 0.05 = 120.
    # Padded: 256 + 8 x 32^2 x 0.05 = 665.6.
    assert not shared_prompts_cheaper(ids, mask, 2, packed=True, **costs)
    assert shared_prompts_cheaper(ids, mask, 2, packed=False, **costs)


def _batch() -> TensorDict:
    """Rollouts of very different lengths, so packing moves samples between rows."""
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
    rollout = HFRolloutEngine(build_causal_lm(TINY, VOCAB, PAD, EOS, seed=3), eos_id=EOS, pad_id=PAD)
    out = rollout.generate(prompts, SamplingParams(n=3, max_new_tokens=10, temperature=1.5))
    lengths = out[K.RESPONSE_MASK].sum(-1)
    assert lengths.min() < 5 and lengths.max() == 10, lengths  # ragged, so the test means something
    return out


def _engines(kind: str, switch: str = "remove_padding", **spec):
    """Two engines of the same weights, with the spec field ``switch`` false, then true."""
    build = build_causal_lm if kind == "policy" else build_value_model
    return [
        TorchTrainEngine(
            build(TINY, VOCAB, PAD, EOS, seed=2),
            TorchTrainSpec(**{switch: on}, optim=OptimSpec(grad_clip=None), **spec),
            kind=kind,
        )
        for on in (False, True)
    ]


def _loss(key: str):
    def loss_fn(mb, out):
        value = -out[key] if key == "log_probs" else (out[key] - 1.0) ** 2
        return agg_loss(value, mb[K.RESPONSE_MASK], "token-mean", out["num_global_tokens"]), {}

    return loss_fn


def _assert_one_sgd_step_equal(reference: TorchTrainEngine, other: TorchTrainEngine, batch, key: str) -> None:
    """One plain SGD step of lr 1 moves each weight by exactly minus its gradient: equal losses
    and weights after it mean equal gradients (and the step moved something)."""
    for engine in (reference, other):
        engine.optimizer = torch.optim.SGD(engine.module.parameters(), lr=1.0)
    start = [p.detach().clone() for p in other.module.parameters()]
    loss_a = reference.train_step(batch, _loss(key))["loss"]
    loss_b = other.train_step(batch, _loss(key))["loss"]
    assert abs(loss_a - loss_b) < 1e-5
    pairs = zip(reference.module.parameters(), other.module.parameters())
    grad_diff = max((p - q).abs().max().item() for p, q in pairs)
    grad_max = max((p - q).abs().max().item() for p, q in zip(other.module.parameters(), start))
    assert grad_diff < 1e-5 * max(1.0, grad_max) and grad_max > 1e-3, (grad_diff, grad_max)


@pytest.mark.parametrize("kind, key", [("policy", "log_probs"), ("value", K.VALUES)])
def test_packed_forward_and_step_equal_padded(kind, key):
    batch = _batch()
    padded, packed = _engines(kind, micro_batch_size=5)
    a, b = padded.forward(batch, temperature=0.8), packed.forward(batch, temperature=0.8)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() < 1e-5, name
    mask = batch[K.RESPONSE_MASK].bool()
    assert bool((b[key][~mask] == 0).all())
    _assert_one_sgd_step_equal(padded, packed, batch, key)


def test_without_the_packed_mask_samples_would_leak():
    """Guards the mechanism: the same packed rows with positions 0..W-1 (one long sequence per
    row) give different log-probs, so the equality above depends on the block-diagonal mask."""
    batch = _batch()
    model = build_causal_lm(TINY, VOCAB, PAD, EOS, seed=2).eval()
    packed = pack(batch[K.INPUT_IDS], batch[K.ATTENTION_MASK], batch[K.POSITION_IDS], 11)
    with torch.no_grad():
        good = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits
        plain = torch.arange(packed.input_ids.shape[1]).expand_as(packed.input_ids)
        leaky = model(input_ids=packed.input_ids, position_ids=plain).logits
    assert (good - leaky).abs().max().item() > 1e-3


class _IgnoresPositions(torch.nn.Module):
    """A model that numbers every row 0..W-1 itself: packed samples would attend to each other."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        if attention_mask is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)


def test_a_model_that_ignores_packing_is_refused():
    model = build_causal_lm(TINY, VOCAB, PAD, EOS, seed=2)
    check_packing(model)  # a transformers model passes
    # Another model of the same class and config (the reference, say) is not probed again.
    other, calls = build_causal_lm(TINY, VOCAB, PAD, EOS, seed=3), []
    forward = other.forward
    other.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    check_packing(other)
    assert calls == []
    with pytest.raises(ValueError, match="does not keep packed sequences apart.*remove_padding: false"):
        TorchTrainEngine(_IgnoresPositions(model), TorchTrainSpec())
    TorchTrainEngine(_IgnoresPositions(model), TorchTrainSpec(remove_padding=False))  # padded: fine


def _head_inputs(engine: TorchTrainEngine) -> list[torch.Size]:
    """The shapes of what reaches the LM head, recorded on every call."""
    shapes: list[torch.Size] = []
    engine.module.get_output_embeddings().register_forward_hook(lambda m, args, out: shapes.append(args[0].shape))
    return shapes


@pytest.mark.parametrize("chunk", [None, 7])
def test_a_large_vocabulary_gathers_the_tail_before_the_head(chunk):
    """From GATHER_BEFORE_HEAD_VOCAB on, only the response tail's hidden states reach the LM
    head; the log-probs and one step's gradients equal the padded engine's as before. With
    ``logits_chunk_tokens`` the head itself projects no row: the chunked read-out does."""
    from hybridflow.engines.torch_engine import GATHER_BEFORE_HEAD_VOCAB

    batch = _batch()
    engines = [
        TorchTrainEngine(
            build_causal_lm(TINY, GATHER_BEFORE_HEAD_VOCAB, PAD, EOS, seed=2),
            TorchTrainSpec(
                remove_padding=packed, micro_batch_size=5, optim=OptimSpec(grad_clip=None),
                logits_chunk_tokens=None if not packed else chunk,
            ),
        )
        for packed in (False, True)
    ]
    padded, packed = engines
    shapes = _head_inputs(packed)
    a, b = padded.forward(batch, temperature=0.8), packed.forward(batch, temperature=0.8)
    tail = 0 if chunk else batch[K.RESPONSES].shape[1] + 1
    assert shapes and all(s[1:] == (tail, packed.module.config.hidden_size) for s in shapes), shapes
    assert (a["log_probs"] - b["log_probs"]).abs().max().item() < 1e-5
    _assert_one_sgd_step_equal(padded, packed, batch, "log_probs")


def test_a_small_vocabulary_projects_every_packed_position():
    """Below the threshold the head takes the packed rows whole (the earlier, bit-stable path)."""
    _, packed = _engines("policy", micro_batch_size=5)
    shapes = _head_inputs(packed)
    batch = _batch()
    packed.forward(batch)
    rows = [
        pack(mb[K.INPUT_IDS], mb[K.ATTENTION_MASK], mb[K.POSITION_IDS], 1).input_ids.shape
        for mb in batch.split(5)
    ]
    assert [tuple(s[:2]) for s in shapes] == [tuple(r) for r in rows], (shapes, rows)


@pytest.mark.parametrize("remove_padding", [False, True])
def test_bfloat16_compute_keeps_float32_state(remove_padding):
    """compute_dtype bfloat16: products run in bfloat16 (autocast), parameters, gradients and
    AdamW state stay float32, and the log-probs stay near the float32 engine's."""
    batch = _batch()
    engines = [
        TorchTrainEngine(
            build_causal_lm(TINY, VOCAB, PAD, EOS, seed=2),
            TorchTrainSpec(remove_padding=remove_padding, micro_batch_size=5, compute_dtype=dtype),
        )
        for dtype in ("float32", "bfloat16")
    ]
    full, mixed = engines
    seen: list[torch.dtype] = []
    mixed.module.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    a, b = full.forward(batch), mixed.forward(batch)
    assert seen and set(seen) == {torch.bfloat16}
    assert b["log_probs"].dtype == torch.float32
    diff = (a["log_probs"] - b["log_probs"]).abs().max().item()
    assert 0 < diff < 0.1, diff  # bfloat16 rounding, not another model
    start = [p.detach().clone() for p in mixed.module.parameters()]
    metrics = mixed.train_step(batch, _loss("log_probs"))
    assert metrics["skipped_step"] == 0.0 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert all(p.dtype == torch.float32 for p in mixed.module.parameters())
    states = list(mixed.optimizer.state.values())
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
    assert max((p - q).abs().max().item() for p, q in zip(mixed.module.parameters(), start)) > 0


def test_bfloat16_compute_is_refused_for_megatron():
    with pytest.raises(ValueError, match="compute_dtype is for train.engine 'torch'"):
        TrainEngineSpec(engine="megatron", compute_dtype="bfloat16")


def _shared_engines(kind: str, vocab: int, micro_batch_size: int):
    build = build_causal_lm if kind == "policy" else build_value_model
    return [
        TorchTrainEngine(
            build(TINY, vocab, PAD, EOS, seed=2),
            TorchTrainSpec(
                remove_padding=False, share_prompts=share, micro_batch_size=micro_batch_size,
                optim=OptimSpec(grad_clip=None),
            ),
            kind=kind,
        )
        for share in (False, True)
    ]


@pytest.mark.parametrize(
    "kind, key, vocab, micro_batch_size",
    [
        ("policy", "log_probs", VOCAB, 6),  # two whole groups of 3 per micro-batch
        ("policy", "log_probs", VOCAB, 5),  # groups split across micro-batches
        ("policy", "log_probs", 1024, 6),  # with the tail gathered before the LM head
        ("value", K.VALUES, VOCAB, 6),
    ],
)
def test_shared_prompts_forward_and_step_equal_padded(kind, key, vocab, micro_batch_size):
    """Each prompt once per micro-batch: outputs and one SGD step's gradients equal the padded
    engine's within float rounding, and the model sees fewer tokens than packing gives it."""
    batch = _batch()
    padded, shared = _shared_engines(kind, vocab, micro_batch_size)
    seen: list[int] = []
    shared.module.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"].numel()), with_kwargs=True)
    a, b = padded.forward(batch, temperature=0.8), shared.forward(batch, temperature=0.8)
    for name in a:
        assert (a[name] - b[name]).abs().max().item() < 1e-5, name
    response_tokens = int(batch[K.RESPONSE_MASK].sum())
    prompt_tokens = int(batch[K.PROMPT_MASK].sum())
    assert response_tokens < sum(seen) < response_tokens + prompt_tokens, seen  # prompts shared
    _assert_one_sgd_step_equal(padded, shared, batch, key)


class _Ignores4DMask(torch.nn.Module):
    """A model that drops a 4D attention mask: shared-prompt samples would see each other."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask=None, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def test_a_model_that_ignores_a_4d_mask_is_refused_for_shared_prompts():
    model = build_causal_lm(TINY, VOCAB, PAD, EOS, seed=2)
    with pytest.raises(ValueError, match="train.share_prompts: .* set share_prompts: false"):
        TorchTrainEngine(_Ignores4DMask(model), TorchTrainSpec(share_prompts=True))
    TorchTrainEngine(_Ignores4DMask(model), TorchTrainSpec())  # plain packing: fine


def test_share_prompts_is_refused_for_megatron():
    with pytest.raises(ValueError, match="share_prompts is for train.engine 'torch'"):
        TrainEngineSpec(engine="megatron", share_prompts=True)


def test_shared_prompts_under_eager_attention_equal_padded():
    """Eager attention adds the mask to its scores: the engine hands it an additive mask."""
    batch = _batch()
    padded, shared = _shared_engines("policy", VOCAB, 6)
    for engine in (padded, shared):
        engine.module.set_attn_implementation("eager")
    assert shared.module.config._attn_implementation == "eager"
    a, b = padded.forward(batch), shared.forward(batch)
    assert (a["log_probs"] - b["log_probs"]).abs().max().item() < 1e-5


def test_shared_prompts_engine_packs_where_sharing_costs_more():
    """One 3-token prompt, 8 samples of 40 tokens: one shared row would score 323^2 pairs, so the
    share_prompts engine runs the layout without sharing instead (here the padded batch, since
    these engines have remove_padding off; no 4D mask), and its outputs and gradients still
    equal the padded engine's."""
    prompts = TensorDict(
        {
            K.PROMPT_IDS: torch.tensor([[4, 5, 6]]),
            K.PROMPT_MASK: torch.ones(1, 3, dtype=torch.long),
            K.UID: torch.arange(1),
            K.PROMPT_TEXT: NonTensorStack("a"),
            K.GROUND_TRUTH: NonTensorStack("a"),
        },
        batch_size=[1],
    )
    torch.manual_seed(0)
    rollout = HFRolloutEngine(build_causal_lm(TINY, VOCAB, PAD, EOS, seed=3), eos_id=EOS, pad_id=PAD)
    batch = rollout.generate(prompts, SamplingParams(n=8, max_new_tokens=40, min_new_tokens=40))
    assert bool(batch[K.RESPONSE_MASK].all())
    padded, shared = _shared_engines("policy", VOCAB, 8)
    calls: list[tuple[tuple[int, ...], int | None]] = []

    def record(_module, _args, kwargs):
        mask = kwargs.get("attention_mask")
        calls.append((tuple(kwargs["input_ids"].shape), None if mask is None else mask.dim()))

    shared.module.register_forward_pre_hook(record, with_kwargs=True)
    a, b = padded.forward(batch), shared.forward(batch)
    assert calls == [((8, 43), 2)], calls  # the padded batch (remove_padding is off), not one row
    assert (a["log_probs"] - b["log_probs"]).abs().max().item() < 1e-5
    _assert_one_sgd_step_equal(padded, shared, batch, "log_probs")


def test_fixed_length_batch_packs_into_narrow_rows_and_equals_padded():
    """Left-padded prompts of 2-3 tokens in 4 columns, 12 response tokens each: the packed
    engine runs rows of the longest sample (15), not of the padded width (16), and its outputs
    and gradients equal the padded engine's."""
    ids = torch.tensor([[PAD, 4, 5, 6], [PAD, PAD, 7, 8]])
    prompts = TensorDict(
        {
            K.PROMPT_IDS: ids,
            K.PROMPT_MASK: (ids != PAD).long(),
            K.UID: torch.arange(2),
            K.PROMPT_TEXT: NonTensorStack("a", "b"),
            K.GROUND_TRUTH: NonTensorStack("a", "b"),
        },
        batch_size=[2],
    )
    torch.manual_seed(0)
    rollout = HFRolloutEngine(build_causal_lm(TINY, VOCAB, PAD, EOS, seed=3), eos_id=EOS, pad_id=PAD)
    batch = rollout.generate(prompts, SamplingParams(n=4, max_new_tokens=12, min_new_tokens=12))
    assert batch[K.INPUT_IDS].shape == (8, 16)
    padded, packed = _engines("policy", micro_batch_size=8)
    shapes: list[tuple[int, ...]] = []
    packed.module.register_forward_pre_hook(
        lambda _m, _a, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    a, b = padded.forward(batch), packed.forward(batch)
    assert shapes == [(8, 15)], shapes
    assert (a["log_probs"] - b["log_probs"]).abs().max().item() < 1e-5
    _assert_one_sgd_step_equal(padded, packed, batch, "log_probs")
