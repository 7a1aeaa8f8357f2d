"""A scalar (reward / cost / critic) model saved as a plain HF directory: read by plain
transformers it gives the engine's scores, LoRA merged in; a graph source naming the directory
builds the value-head model with the trained head."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoModelForTokenClassification, AutoTokenizer, Qwen2ForSequenceClassification

from hybridflow.data import keys as K
from hybridflow.data.preferences import collate_pairs, pair_forward_batch, pair_row, responses_as_text_tokens
from hybridflow.data.tasks import get_task
from hybridflow.engines.models import build_value_model, tiny_qwen2_config
from hybridflow.engines.scalar_model import save_scalar_model
from hybridflow.engines.torch_engine import TorchTrainEngine
from hybridflow.spec.engines import TorchTrainSpec
from hybridflow.spec.graph import ModelSource

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2}
PAIRS = [("abc=", "abc", "ab"), ("hgfed=", "hgfed", "hgfdd"), ("aa=", "aa", "a"), ("bcd=", "bcd", "cdb")]


@pytest.fixture(scope="module")
def tokenizer():
    return get_task("copy").tokenizer()


def _value_model(tokenizer, source=None):
    source = source or ModelSource(config=TINY)
    model = build_value_model(source, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, seed=3)
    if source.config is not None:
        with torch.no_grad():  # default init gives scores ~1e-2: spread them so a mismatch shows
            model.score.weight.normal_(0.0, 1.0)
            model.score.bias.fill_(0.3)
    return model


def _batch(tokenizer):
    rows = [pair_row({"prompt": p, "chosen": c, "rejected": r}, f"pair {i}", "test") for i, (p, c, r) in enumerate(PAIRS)]
    return pair_forward_batch(collate_pairs(rows, tokenizer, max_prompt_length=8, max_response_length=8))


def _engine_scores(model, batch):
    engine = TorchTrainEngine(model, TorchTrainSpec(micro_batch_size=3), kind="value")
    return engine, engine.forward(batch)["last_values"]


def _plain_scores(model, batch):
    """Each sample's real tokens alone (no padding), read at the last one."""
    scores = []
    for i in range(batch.batch_size[0]):
        ids = batch[K.INPUT_IDS][i][batch[K.ATTENTION_MASK][i].bool()]
        with torch.no_grad():
            scores.append(model(input_ids=ids[None]).logits[0, -1, 0])
    return torch.stack(scores)


def test_saved_scalar_model_gives_the_engines_scores_in_plain_transformers(tokenizer, tmp_path):
    batch = _batch(tokenizer)
    engine, scores = _engine_scores(_value_model(tokenizer), batch)
    assert scores.shape == (8,) and scores.std() > 0.05  # distinct scores: the check can fail

    save_scalar_model(engine.module, tmp_path / "rm", tokenizer)
    plain = AutoModelForTokenClassification.from_pretrained(tmp_path / "rm")
    assert plain.config.num_labels == 1 and not plain.training
    torch.testing.assert_close(_plain_scores(plain, batch), scores, rtol=0, atol=1e-5)
    assert AutoTokenizer.from_pretrained(tmp_path / "rm").get_vocab() == tokenizer.get_vocab()
    assert "logits[0, -1, 0]" in (tmp_path / "rm" / "README.md").read_text()

    # the way back: a node whose source is the directory builds the model with the trained head
    reloaded = _value_model(tokenizer, ModelSource(path=str(tmp_path / "rm")))
    torch.testing.assert_close(_engine_scores(reloaded, batch)[1], scores, rtol=0, atol=1e-5)

    # saving again replaces the directory whole
    with torch.no_grad():
        engine.module.score.bias.add_(1.0)
    save_scalar_model(engine.module, tmp_path / "rm", tokenizer)
    again = AutoModelForTokenClassification.from_pretrained(tmp_path / "rm")
    torch.testing.assert_close(_plain_scores(again, batch), scores + 1.0, rtol=0, atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rm"]


def test_lora_scalar_model_is_saved_merged(tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model

    batch = _batch(tokenizer)
    base_scores = _engine_scores(_value_model(tokenizer), batch)[1]
    # A LoRA scalar model as peft makes one for token classification: adapters on the backbone
    # and a trained copy of the head (modules_to_save), which the merge must keep.
    model = _value_model(tokenizer)
    # (peft's "all-linear" would put adapters on the head too, which modules_to_save refuses)
    backbone = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=backbone, task_type="TOKEN_CLS"))
    with torch.no_grad():  # trained adapters and head: B is 0 at start, so a merge would change nothing
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.normal_(0.0, 0.5)
    engine, scores = _engine_scores(model, batch)
    assert (scores - base_scores).abs().max() > 1e-2  # the adapters move the scores

    with pytest.raises(TypeError, match="pass the PeftModel"):
        save_scalar_model(engine.module, tmp_path / "unmerged", tokenizer)
    save_scalar_model(peft_model, tmp_path / "rm", tokenizer)
    plain = AutoModelForTokenClassification.from_pretrained(tmp_path / "rm")
    assert not any("lora" in name or "modules_to_save" in name for name, _ in plain.named_parameters())
    torch.testing.assert_close(_plain_scores(plain, batch), scores, rtol=0, atol=1e-5)
    # the trained model keeps its adapters: merging worked on a copy
    torch.testing.assert_close(engine.forward(batch)["last_values"], scores, rtol=0, atol=0)


def test_a_trl_sequence_classification_reward_model_loads_with_its_head(tokenizer, tmp_path):
    # TRL's RewardTrainer saves *ForSequenceClassification: the same "score" head without bias,
    # read at the last non-pad token. As a value-head model it must score the same.
    config = tiny_qwen2_config(TINY, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, num_labels=1)
    torch.manual_seed(5)
    trl_model = Qwen2ForSequenceClassification(config).eval()
    with torch.no_grad():
        trl_model.score.weight.normal_(0.0, 1.0)
    trl_model.save_pretrained(tmp_path / "trl_rm")
    batch = _batch(tokenizer)
    expected = []
    for i in range(batch.batch_size[0]):
        ids = batch[K.INPUT_IDS][i][batch[K.ATTENTION_MASK][i].bool()]
        with torch.no_grad():
            expected.append(trl_model(input_ids=ids[None]).logits[0, 0])
    model = _value_model(tokenizer, ModelSource(path=str(tmp_path / "trl_rm")))
    torch.testing.assert_close(_engine_scores(model, batch)[1], torch.stack(expected), rtol=0, atol=1e-5)


def test_only_scalar_models_are_saved(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    config = tiny_qwen2_config(TINY, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    with pytest.raises(ValueError, match="expected a \\*ForTokenClassification scalar model, got Qwen2ForCausalLM"):
        save_scalar_model(AutoModelForCausalLM.from_config(config), tmp_path / "lm")
    two = AutoModelForTokenClassification.from_config(
        tiny_qwen2_config(TINY, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, num_labels=2))
    with pytest.raises(ValueError, match="num_labels=2"):
        save_scalar_model(two, tmp_path / "two")
    assert not (tmp_path / "lm").exists() and not (tmp_path / "two").exists()


@pytest.mark.parametrize("kind", ["reward", "cost"])
def test_pairwise_training_through_the_engine_then_plain_transformers_agrees(tokenizer, tmp_path, kind):
    """The update's algorithm without a worker: pair batches through ``train_step`` with a
    registered pairwise loss; the saved model then ranks the pairs in plain transformers."""
    from hybridflow.algos import PAIR_LOSSES, pairwise_metrics
    from hybridflow.data.preference_pairs import make_pairs
    from hybridflow.data.preferences import pair_loss_inputs, split_pair_scores

    train, _ = make_pairs("copy", kind, 16, 1, 1, seed=0)  # each the correct copy against a corruption
    rows = [pair_row(row, f"pair {i}", "test", kind) for i, row in enumerate(train)]
    batch = pair_forward_batch(collate_pairs(rows, tokenizer, max_prompt_length=8, max_response_length=16))
    model = build_value_model(ModelSource(config=TINY), len(tokenizer), tokenizer.pad_token_id,
                              tokenizer.eos_token_id, seed=0)
    engine = TorchTrainEngine(model, TorchTrainSpec(micro_batch_size=8, optim={"lr": 1e-2}), kind="value")
    loss = PAIR_LOSSES.get("bradley_terry" if kind == "reward" else "safe_rlhf_cost")

    def loss_fn(micro_batch, forward):  # micro-batches of 4 pairs; the mean is over all 16
        return loss(**pair_loss_inputs(micro_batch, forward["last_values"]), num_pairs=forward["num_global_seqs"] / 2)

    signs = pair_loss_inputs(batch, torch.zeros(batch.batch_size[0]))

    def learned(scores: torch.Tensor) -> bool:
        """Every pair ranked; for costs also the sign term: unsafe costs > 0, safe ones < 0."""
        chosen, rejected = split_pair_scores(scores)
        ranked = pairwise_metrics(chosen, rejected)["rm/accuracy"] == 1.0
        if kind == "reward":
            return ranked
        return ranked and bool((signs["chosen_signs"] * chosen > 0).all() and (signs["rejected_signs"] * rejected > 0).all())

    assert not learned(engine.forward(batch)["last_values"])
    losses = [engine.train_step(batch, loss_fn)["loss"] for _ in range(100)]
    assert losses[-1] < 0.1 * losses[0]

    save_scalar_model(engine.module, tmp_path / kind, tokenizer, role=kind)
    plain = AutoModelForTokenClassification.from_pretrained(tmp_path / kind)
    assert learned(_plain_scores(plain, batch))
    assert plain.config.id2label == {0: kind}


def _rollout(tokenizer, prompt: str, responses: list[list[int]]):
    from hybridflow.data.batch import build_rollout_fields

    prompt_ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]] * len(responses))
    width = max(len(r) for r in responses)
    raw = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in responses])
    fields = build_rollout_fields(prompt_ids, torch.ones_like(prompt_ids), raw, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return TensorDict({K.PROMPT_IDS: prompt_ids, K.PROMPT_MASK: torch.ones_like(prompt_ids),
                       K.UID: torch.zeros(len(responses), dtype=torch.int64), **fields}, batch_size=[len(responses)])


def test_a_learned_scorer_reads_the_text_so_hidden_special_tokens_do_not_move_the_score(tokenizer):
    """A policy against a learned reward wrote <unk> tokens (invisible in its text, never in a
    pair) to reach scores no written answer has; read as text, the hidden tokens are gone and
    the score is the pair-encoded answer's."""
    unk, eos, c = tokenizer.unk_token_id, tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("c")
    batch = _rollout(tokenizer, "abc=", [[unk, unk, c, c, eos], [c, c, eos], [unk, c, c, unk]])
    read = responses_as_text_tokens(batch, tokenizer)
    assert read[K.RESPONSES].tolist() == [[c, c, eos], [c, c, eos], [c, c, tokenizer.pad_token_id]]
    assert read[K.RESPONSE_MASK].tolist() == [[1, 1, 1], [1, 1, 1], [1, 1, 0]]  # no EOS added to a cut one
    assert torch.equal(read[K.TRUNCATED], batch[K.TRUNCATED])  # other fields kept

    model = _value_model(tokenizer)
    _, as_tokens = _engine_scores(model, batch)
    _, as_text = _engine_scores(model, read)
    pair = _batch_of(tokenizer, [("abc=", "cc", "c")])
    _, paired = _engine_scores(model, pair)
    assert as_text[0] == pytest.approx(float(paired[0]), abs=1e-5)  # what the pairs taught it to score
    assert as_text[0] == pytest.approx(float(as_text[1]), abs=1e-5)
    assert abs(float(as_tokens[0] - as_tokens[1])) > 1e-3  # read as generated, the unks change it


def test_a_multi_turn_batch_is_read_as_its_tokens(tokenizer):
    c, eos = tokenizer.convert_tokens_to_ids("c"), tokenizer.eos_token_id
    batch = _rollout(tokenizer, "abc=", [[c, c, c, eos]])
    batch[K.RESPONSE_MASK] = torch.tensor([[1, 0, 1, 1]])  # the second token an observation
    assert responses_as_text_tokens(batch, tokenizer) is batch


def _batch_of(tokenizer, pairs):
    rows = [pair_row({"prompt": p, "chosen": ch, "rejected": r}, f"pair {i}", "test") for i, (p, ch, r) in enumerate(pairs)]
    return pair_forward_batch(collate_pairs(rows, tokenizer, max_prompt_length=8, max_response_length=8))
