"""Engines on a real tiny transformers model: rollout fields, generate, train forward/step, LR."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from hybridflow.algos import agg_loss
from hybridflow.data import keys as K
from hybridflow.data.batch import build_rollout_fields, place_sequence_reward, repeat_interleave_td
from hybridflow.engines.base import SamplingParams
from hybridflow.engines.hf_rollout import HFRolloutEngine
from hybridflow.engines.models import build_causal_lm, build_value_model
from hybridflow.engines.schedule import lr_factor
from hybridflow.engines.torch_engine import TorchTrainEngine
from hybridflow.graph.ops import graph_keys
from hybridflow.spec.engines import TorchTrainSpec
from hybridflow.spec.graph import ModelSource, OptimSpec, TrainEngineSpec

PAD, EOS, VOCAB = 0, 1, 12
TINY = ModelSource(config={})

torch.set_num_threads(1)


def _model(seed: int = 0):
    return build_causal_lm(TINY, VOCAB, PAD, EOS, seed=seed, dtype="float32")


def _prompts() -> TensorDict:
    ids = torch.tensor([[PAD, PAD, 5, 6, 7], [3, 4, 5, 6, 7], [PAD, 9, 2, 3, 10]])
    return TensorDict(
        {
            K.PROMPT_IDS: ids,
            K.PROMPT_MASK: (ids != PAD).long(),
            K.UID: torch.arange(3),
            K.PROMPT_TEXT: NonTensorStack("p0", "p1", "p2"),
            K.GROUND_TRUTH: NonTensorStack("g0", "g1", "g2"),
            K.DATA_SOURCE: NonTensorStack("d", "d", "d"),
            K.EXTRA_INFO: NonTensorStack("null", "null", "null"),
        },
        batch_size=[3],
    )


# -- data helpers ------------------------------------------------------------------------------


def test_build_rollout_fields_hand_cases():
    prompt_ids = torch.tensor([[PAD, PAD, 5], [3, 4, 5], [PAD, 6, 7]])
    prompt_mask = (prompt_ids != PAD).long()
    responses = torch.tensor(
        [
            [8, EOS, 9, 9],  # EOS mid: what follows becomes pad
            [8, 9, 10, EOS],  # EOS at the last position: not truncated
            [8, 9, 10, 11],  # no EOS: truncated, all tokens valid
        ]
    )
    out = build_rollout_fields(prompt_ids, prompt_mask, responses, EOS, PAD)
    assert out[K.RESPONSES].tolist() == [[8, EOS, PAD, PAD], [8, 9, 10, EOS], [8, 9, 10, 11]]
    assert out[K.RESPONSE_MASK].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert out[K.TRUNCATED].tolist() == [False, False, True]
    assert out[K.INPUT_IDS].tolist()[0] == [PAD, PAD, 5, 8, EOS, PAD, PAD]
    assert out[K.ATTENTION_MASK].tolist()[0] == [0, 0, 1, 1, 1, 0, 0]
    # Left padding does not shift positions; padding after EOS repeats the last one.
    assert out[K.POSITION_IDS].tolist() == [
        [0, 0, 0, 1, 2, 2, 2],
        [0, 1, 2, 3, 4, 5, 6],
        [0, 0, 1, 2, 3, 4, 5],
    ]
    assert out[K.RESPONSE_MASK].dtype == torch.int64 and out[K.TRUNCATED].dtype == torch.bool


def test_place_sequence_reward_and_repeat():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    rewards = place_sequence_reward(torch.tensor([2.0, -1.0, 0.5]), mask)
    assert rewards.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.5, 0.0, 0.0]]

    repeated = repeat_interleave_td(_prompts(), 2)
    assert repeated.batch_size == torch.Size([6])
    assert repeated[K.UID].tolist() == [0, 0, 1, 1, 2, 2]
    assert list(repeated[K.PROMPT_TEXT]) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert list(repeated[K.GROUND_TRUTH]) == ["g0", "g0", "g1", "g1", "g2", "g2"]
    assert torch.equal(repeated[K.PROMPT_IDS][2], _prompts()[K.PROMPT_IDS][1])
    assert repeated[3:5][K.GROUND_TRUTH].tolist() == ["g1", "g2"]  # slices like an indexed batch
    # Mutable items are copied per sample, as tensordict's indexing does.
    prompts = _prompts()
    prompts.set("tools", NonTensorStack.from_list([{"calls": []}, {"calls": []}, {"calls": []}]))
    tools = repeat_interleave_td(prompts, 2)["tools"].tolist()
    tools[0]["calls"].append("x")
    assert tools[1] == {"calls": []} and prompts["tools"].tolist()[0] == {"calls": []}


# -- models ------------------------------------------------------------------------------------


def test_build_is_seeded_and_loads_from_path(tmp_path):
    state_a, state_b = _model(seed=3).state_dict(), _model(seed=3).state_dict()
    assert all(torch.equal(v, state_b[k]) for k, v in state_a.items())
    assert not torch.equal(_model(seed=4).lm_head.weight, state_a["lm_head.weight"])
    _model(seed=3).save_pretrained(tmp_path)
    loaded = build_causal_lm(ModelSource(path=str(tmp_path)), VOCAB, PAD, EOS, seed=9)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in state_a.items())
    critic = build_value_model(ModelSource(path=str(tmp_path)), VOCAB, PAD, EOS, seed=9)
    assert torch.equal(critic.model.embed_tokens.weight, state_a["model.embed_tokens.weight"])
    assert critic.score.weight.shape == (1, 64) and critic.dropout.p == 0.0


# -- rollout -----------------------------------------------------------------------------------


def test_generate_fields_and_rollout_log_probs_match_training():
    engine = TorchTrainEngine(_model(), TorchTrainSpec(micro_batch_size=5))
    rollout = HFRolloutEngine(engine.module, eos_id=EOS, pad_id=PAD)
    torch.manual_seed(0)
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=8)
    out = rollout.generate(_prompts(), params)

    assert out.batch_size == torch.Size([12])
    # The weight versions are the worker's to stamp (it counts the syncs), not the engine's.
    engine_keys = [k for k in graph_keys()["responses"] if k not in (K.WEIGHT_VERSION, K.WEIGHT_VERSION_LAST)]
    for key in engine_keys + [K.PROMPT_IDS, K.PROMPT_MASK]:
        assert key in out.keys(), key
    assert out[K.RESPONSES].shape == (12, 8) and out[K.INPUT_IDS].shape == (12, 13)
    assert out[K.UID].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert list(out[K.PROMPT_TEXT]) == ["p0"] * 4 + ["p1"] * 4 + ["p2"] * 4

    mask = out[K.RESPONSE_MASK]
    lengths = mask.sum(-1)
    # A prefix of ones; EOS is the last valid token unless truncated; pad after it.
    assert torch.equal(mask, (torch.arange(8)[None] < lengths[:, None]).long())
    last_token = out[K.RESPONSES].gather(1, (lengths - 1)[:, None])[:, 0]
    assert torch.equal(out[K.TRUNCATED], last_token != EOS)
    assert bool((lengths[out[K.TRUNCATED]] == 8).all())
    assert bool((out[K.RESPONSES][mask == 0] == PAD).all())
    assert bool((out[K.ROLLOUT_LOG_PROBS][mask == 0] == 0).all())
    assert out[K.TRUNCATED].any() and not out[K.TRUNCATED].all(), "want both kinds in the sample"

    # Same seed, same samples.
    torch.manual_seed(0)
    assert torch.equal(rollout.generate(_prompts(), params)[K.RESPONSES], out[K.RESPONSES])

    train = engine.forward(out, temperature=0.7)
    assert train["log_probs"].shape == (12, 8) and train["entropy"].shape == (12, 8)
    diff = (train["log_probs"] - out[K.ROLLOUT_LOG_PROBS]).abs().max().item()
    assert diff < 1e-5, diff
    assert bool((train["entropy"][mask == 1] > 0).all())


def _argmax_decode(model, prompt_ids, prompt_mask, num_tokens):
    """Greedy decode without KV cache, positions as in hybridflow.data.keys."""
    ids, attention_mask = prompt_ids, prompt_mask
    done = torch.zeros(len(ids), dtype=torch.bool)
    for _ in range(num_tokens):
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(
                input_ids=ids, attention_mask=attention_mask, position_ids=positions
            ).logits
        next_token = torch.where(done, PAD, logits[:, -1].argmax(-1))
        done |= next_token == EOS
        ids = torch.cat([ids, next_token[:, None]], 1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(next_token)[:, None]], 1)
    return ids[:, prompt_ids.shape[1] :]


def test_greedy_generate_equals_argmax_decode():
    # Untied: a random tied tiny model greedily repeats its last prompt token, a weak test.
    model = build_causal_lm(ModelSource(config={"tie_word_embeddings": False}), VOCAB, PAD, EOS, 5)
    rollout = HFRolloutEngine(model, eos_id=EOS, pad_id=PAD)
    out = rollout.generate(_prompts(), SamplingParams(n=2, greedy=True, max_new_tokens=6))
    prompts = _prompts()
    expected = _argmax_decode(model.eval(), prompts[K.PROMPT_IDS], prompts[K.PROMPT_MASK], 6)
    assert torch.equal(out[K.RESPONSES][0::2], expected)
    assert torch.equal(out[K.RESPONSES][1::2], expected)
    assert out[K.TRUNCATED][0::2].tolist() == [True, True, False]  # both kinds, for this seed


def _sample(rollout: HFRolloutEngine) -> TensorDict:
    torch.manual_seed(0)
    return rollout.generate(_prompts(), SamplingParams(n=2, max_new_tokens=6))


def test_load_weights_copies_or_shares():
    engine = TorchTrainEngine(_model(seed=0), TorchTrainSpec())
    other = HFRolloutEngine(_model(seed=5), eos_id=EOS, pad_id=PAD)
    before = _sample(other)
    reference = _sample(HFRolloutEngine(engine.module, eos_id=EOS, pad_id=PAD))
    assert not torch.equal(before[K.ROLLOUT_LOG_PROBS], reference[K.ROLLOUT_LOG_PROBS])

    other.load_weights(engine.named_weights())
    num_params = len(list(engine.module.parameters()))
    assert other.last_load == {"copied": num_params, "shared": 0}
    after = _sample(other)
    assert torch.equal(after[K.RESPONSES], reference[K.RESPONSES])
    assert torch.equal(after[K.ROLLOUT_LOG_PROBS], reference[K.ROLLOUT_LOG_PROBS])
    assert other.model.lm_head.weight is other.model.model.embed_tokens.weight  # still tied

    shared = HFRolloutEngine(engine.module, eos_id=EOS, pad_id=PAD)
    pointers = [p.data_ptr() for p in engine.module.parameters()]
    shared.load_weights(engine.named_weights())
    assert shared.last_load == {"copied": 0, "shared": num_params}
    assert pointers == [p.data_ptr() for p in shared.model.parameters()]

    with pytest.raises(KeyError):
        other.load_weights(iter([("no.such.weight", torch.zeros(1))]))


# -- training ----------------------------------------------------------------------------------


def _rollout_batch(seed: int = 0) -> TensorDict:
    torch.manual_seed(seed)
    rollout = HFRolloutEngine(_model(seed=seed), eos_id=EOS, pad_id=PAD)
    return rollout.generate(_prompts(), SamplingParams(n=2, max_new_tokens=6))


def _nll_loss(mb: TensorDict, out: dict[str, torch.Tensor]):
    """Token-mean negative log-likelihood of the responses (global normaliser)."""
    loss = agg_loss(
        -out["log_probs"], mb[K.RESPONSE_MASK], "token-mean", out["num_global_tokens"]
    )
    return loss, {"mb_tokens": float(mb[K.RESPONSE_MASK].sum())}


def test_train_steps_lower_the_loss():
    batch = _rollout_batch()
    spec = TorchTrainSpec(micro_batch_size=4, optim=OptimSpec(lr=5e-3))
    engine = TorchTrainEngine(_model(seed=2), spec)
    before = [p.detach().clone() for p in engine.module.parameters()]
    losses = [engine.train_step(batch, _nll_loss)["loss"] for _ in range(5)]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    moved = max((p - q).abs().max().item() for p, q in zip(engine.module.parameters(), before))
    assert moved > 1e-3
    metrics = engine.train_step(batch, _nll_loss)
    assert {"loss", "grad_norm", "lr", "mb_tokens"} <= set(metrics)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert metrics["mb_tokens"] > 0 and metrics["skipped_step"] == 0


def test_a_dropped_engine_is_freed_at_once():
    """No reference cycle through the scheduler: under DDP, torch's collector cannot free one, so
    the process group outlived ``destroy_process_group`` and its gloo threads ran into the
    interpreter's shutdown, where they aborted a rank now and then."""
    engine = TorchTrainEngine(_model(seed=2), TorchTrainSpec(micro_batch_size=4))
    engine.train_step(_rollout_batch()[:4], _nll_loss)
    ref = weakref.ref(engine)
    del engine
    assert ref() is None


def test_train_loss_equals_forward_token_mean():
    batch = _rollout_batch()
    engine = TorchTrainEngine(_model(seed=2), TorchTrainSpec(micro_batch_size=4))
    log_probs = engine.forward(batch)["log_probs"]
    mask = batch[K.RESPONSE_MASK]
    expected = -(log_probs * mask).sum() / mask.sum()
    assert abs(engine.train_step(batch, _nll_loss)["loss"] - expected.item()) < 1e-5


def test_lr_schedule_warmup_then_cosine():
    optim = OptimSpec(lr=0.1, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1, grad_clip=None)
    engine = TorchTrainEngine(_model(), TorchTrainSpec(optim=optim), total_steps=6)
    batch = _rollout_batch()[:2]
    lrs = [engine.train_step(batch, _nll_loss)["lr"] for _ in range(7)]

    def cosine(progress):
        return 0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    expected = [0.05, 0.1, cosine(0), cosine(1 / 4), cosine(2 / 4), cosine(3 / 4), cosine(1)]
    assert lrs == pytest.approx(expected, abs=1e-12)
    assert lr_factor(100, optim, 6) == pytest.approx(0.1)
    constant = OptimSpec(warmup_steps=3)
    assert [lr_factor(s, constant, 0) for s in range(5)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1])
    with pytest.raises(ValueError, match="cosine"):
        TorchTrainEngine(_model(), TorchTrainSpec(optim=optim))


def test_state_dict_round_trip_and_save_hf(tmp_path):
    batch = _rollout_batch()
    spec = TorchTrainSpec(micro_batch_size=4, optim=OptimSpec(warmup_steps=3))
    engine = TorchTrainEngine(_model(seed=2), spec)
    engine.train_step(batch, _nll_loss)
    torch.save(engine.state_dict(), tmp_path / "ckpt.pt")
    copy = TorchTrainEngine(_model(seed=7), spec)
    copy.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    for _ in range(2):  # optimizer moments and the LR step count came along
        assert engine.train_step(batch, _nll_loss) == copy.train_step(batch, _nll_loss)
    named = dict(engine.named_weights())
    assert all(torch.equal(named[k], v) for k, v in copy.named_weights())

    engine.save_hf(str(tmp_path / "hf"))
    loaded = build_causal_lm(ModelSource(path=str(tmp_path / "hf")), VOCAB, PAD, EOS, seed=0)
    assert all(torch.equal(named[k], v) for k, v in loaded.named_parameters())


def test_a_resume_takes_the_graphs_learning_rate_and_keeps_the_step_count(tmp_path):
    """`models.actor.train.optim.lr` changed on resume: the loaded engine steps at the new lr,
    with the warm-up position (the checkpoint's step count) carried over."""
    batch = _rollout_batch()
    old = TorchTrainSpec(micro_batch_size=4, optim=OptimSpec(lr=1e-3, warmup_steps=4))
    engine = TorchTrainEngine(_model(seed=2), old)
    engine.train_step(batch, _nll_loss)
    state = engine.state_dict()
    new = TorchTrainSpec(micro_batch_size=4, optim=OptimSpec(lr=1e-2, warmup_steps=4))
    resumed = TorchTrainEngine(_model(seed=7), new)
    resumed.load_state_dict(state)
    # one step done: the next is warm-up step 2 of 4, at the new lr
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [1e-2 * 2 / 4]
    resumed.train_step(batch, _nll_loss)
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [1e-2 * 3 / 4]
    # the same lr on resume changes nothing: the lr the checkpointed engine would step at next
    same = TorchTrainEngine(_model(seed=7), old)
    same.load_state_dict(engine.state_dict())
    assert [g["lr"] for g in same.optimizer.param_groups] == [g["lr"] for g in engine.optimizer.param_groups]


def test_value_engine_forward_and_step():
    batch = _rollout_batch()
    critic = build_value_model(TINY, VOCAB, PAD, EOS, seed=0)
    engine = TorchTrainEngine(critic, TorchTrainSpec(micro_batch_size=4), kind="value")
    values = engine.forward(batch)["values"]
    assert values.shape == batch[K.RESPONSES].shape
    assert bool((values[batch[K.RESPONSE_MASK] == 0] == 0).all())

    def mse(mb, out):
        err = (out["values"] - 1.0) ** 2
        return agg_loss(err, mb[K.RESPONSE_MASK], "token-mean", out["num_global_tokens"]), {}

    losses = [engine.train_step(batch, mse)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]


# -- the registry and the contract --------------------------------------------------------------


def test_engine_registries_hold_the_spec_names_and_import_lazily():
    import subprocess
    import sys
    import typing

    from hybridflow.engines.base import ROLLOUT_ENGINES, TRAIN_ENGINES, RolloutEngine, TrainEngine
    from hybridflow.spec.graph import ModelSpec

    # A graph file's train/rollout section is the union of the registered engines' configs.
    for registry, field in ((TRAIN_ENGINES, "train"), (ROLLOUT_ENGINES, "rollout")):
        union = ModelSpec.model_fields[field].annotation
        union = typing.get_args(union)[0] if field == "rollout" else union  # Optional[...]
        tags = sorted(typing.get_args(m)[1].tag for m in typing.get_args(typing.get_args(union)[0]))
        assert registry.names() == tags
    assert TRAIN_ENGINES.get("torch") is TorchTrainEngine and issubclass(TorchTrainEngine, TrainEngine)
    assert ROLLOUT_ENGINES.get("hf") is HFRolloutEngine and issubclass(HFRolloutEngine, RolloutEngine)
    with pytest.raises(KeyError, match="unknown train engine 'jax'; known: fsdp2, megatron, torch"):
        TRAIN_ENGINES.get("jax")
    # Naming the torch and hf engines loads neither megatron-core nor vLLM.
    code = (
        "import sys; from hybridflow.engines.base import ROLLOUT_ENGINES, TRAIN_ENGINES; "
        "TRAIN_ENGINES.get('torch'); ROLLOUT_ENGINES.get('hf'); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'vllm'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_torch_engine_contract_on_cpu():
    engine = TorchTrainEngine.build(_model(), TorchTrainSpec(micro_batch_size=5), kind="policy", total_steps=1, seed=0)
    assert engine.train_shard() is None and engine.dp_group is None  # full weights; default group
    assert engine.offload() == 0 and engine.reload() == 0  # already on the CPU, its home
    names = [name for name, _ in engine.named_weights()]
    assert names == [name for name, _ in engine.module.named_parameters()]
    state = engine.state_dict()  # layout-free: keyed by parameter name, no rank, no indices
    assert set(state) == {"model", "optim", "schedule"}
    assert set(names) <= set(state["model"])  # (and a tied lm_head.weight)
    assert {f"state.{n}.exp_avg" for n in names} <= set(state["optim"])
    engine.load_state_dict(state)


def test_the_engines_share_one_schedule_module_and_not_each_other():
    import subprocess
    import sys

    code = (
        "import sys, hybridflow.engines.megatron.engine as m, hybridflow.engines.torch_engine as t, "
        "hybridflow.engines.schedule as s; "
        "print(m.lr_factor is s.lr_factor is t.lr_factor); "
        "del sys.modules['hybridflow.engines.torch_engine']; import importlib; "
        "importlib.reload(m); print('hybridflow.engines.torch_engine' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]  # the megatron engine imports no torch engine
