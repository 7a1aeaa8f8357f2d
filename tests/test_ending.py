"""The score node's ending rule: a response that did not end scores ``unfinished_score``."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from hybridflow.data import keys as K
from hybridflow.data.batch import build_rollout_fields
from hybridflow.data.tokenizer import build_char_tokenizer
from hybridflow.rewards.ending import apply_ending_rule, resolve_unfinished, unfinished_mask
from hybridflow.spec.graph import ScoreOptions

TOKENIZER = build_char_tokenizer("abc=")
PAD, EOS, UNK = TOKENIZER.pad_token_id, TOKENIZER.eos_token_id, TOKENIZER.unk_token_id
A, B = TOKENIZER.convert_tokens_to_ids(["a", "b"])

# (raw generated tokens, ended?) with R = 4; whatever follows the first EOS is ignored.
CASES = [
    ([A, B, EOS, PAD], True),  # answered and stopped
    ([EOS, PAD, PAD, PAD], True),  # an empty answer that stopped
    ([A, B, A, EOS], True),  # EOS as the very last allowed token
    ([A, EOS, UNK, PAD], True),  # junk after the EOS is not part of the response
    ([A, B, A, B], False),  # truncated: no EOS within the limit
    ([A, PAD, PAD, PAD], False),  # truncated, padded with special tokens (decodes to "a")
    ([A, B, PAD, EOS], False),  # a special token right before EOS
    ([A, UNK, EOS, PAD], False),
    ([A, PAD, B, EOS], True),  # a special token elsewhere is the reward's business
]


def _batch() -> TensorDict:
    raw = torch.tensor([tokens for tokens, _ in CASES])
    prompts = torch.full((len(CASES), 2), A)
    fields = build_rollout_fields(prompts, torch.ones_like(prompts), raw, EOS, PAD)
    return TensorDict(fields, batch_size=[len(CASES)])


def test_unfinished_mask_hand_cases():
    batch = _batch()
    got = unfinished_mask(batch[K.RESPONSES], batch[K.RESPONSE_MASK], EOS, TOKENIZER.all_special_ids)
    assert got.tolist() == [not ended for _, ended in CASES]
    # Every truncated response is unfinished; the rule adds the special-before-EOS ones.
    assert bool((got | ~batch[K.TRUNCATED]).all())
    assert int(got.sum()) == int(batch[K.TRUNCATED].sum()) + 2


def test_apply_ending_rule_modes_and_roles():
    batch = _batch()
    scores = torch.linspace(0.1, 0.9, len(CASES))
    ended = torch.tensor([ended for _, ended in CASES])

    replaced, unfinished = apply_ending_rule(scores, batch, TOKENIZER, ScoreOptions(), "reward")
    assert torch.equal(unfinished, ~ended)
    assert torch.equal(replaced, torch.where(ended, scores, torch.zeros_like(scores)))

    penalised, _ = apply_ending_rule(
        scores, batch, TOKENIZER, ScoreOptions(unfinished="replace", unfinished_score=1.5), "cost"
    )
    assert torch.equal(penalised, torch.where(ended, scores, torch.full_like(scores, 1.5)))
    kept, unfinished = apply_ending_rule(scores, batch, TOKENIZER, ScoreOptions(), "cost")
    assert torch.equal(kept, scores) and torch.equal(unfinished, ~ended)
    kept, _ = apply_ending_rule(scores, batch, TOKENIZER, ScoreOptions(unfinished="keep"), "reward")
    assert torch.equal(kept, scores)


@pytest.mark.parametrize(
    "mode, role, expected",
    [("auto", "reward", "replace"), ("auto", "cost", "keep"), ("keep", "reward", "keep"),
     ("replace", "cost", "replace")],
)
def test_resolve_unfinished(mode, role, expected):
    assert resolve_unfinished(mode, role) == expected


def test_unfinished_option_is_validated():
    with pytest.raises(ValueError, match="unfinished"):
        ScoreOptions(unfinished="zero")


def always_one(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A verl-style compute_score that likes every answer."""
    return 1.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_score_op_applies_the_rule_on_the_compute_score_path(tmp_path):
    """The real score op, with a compute_score source: the ending rule overrides its score."""
    from tensordict import NonTensorStack

    from hybridflow.graph.builder import GraphBuilder
    from hybridflow.workers.model_worker import ModelWorker

    g = GraphBuilder("ending")
    g.model("actor", role="actor", source={"config": {"hidden_size": 32, "num_hidden_layers": 1}},
            rollout={"engine": "hf", "n": 1})
    g.model("reward", role="reward", source={"compute_score": f"{__name__}:always_one"})
    g.node("generate", "generate", model="actor", inputs=["prompts"], outputs=["responses"])
    g.node("reward", "score", model="reward", inputs=["responses"], outputs=["scores"], num_workers=0)
    g.node("advantage", "advantage", model="actor", inputs=["responses", "scores"], outputs=["advantages"],
           estimator="grpo", scope="batch")  # one sample per prompt: batch-wide statistics
    g.node("update_actor", "update", model="actor", inputs=["responses", "advantages"], outputs=[])
    g.data(source="builtin:copy", prompts_per_iteration=2, max_prompt_length=8, max_response_length=4)
    TOKENIZER.save_pretrained(tmp_path / "tokenizer")
    worker = ModelWorker(0, 1, "127.0.0.1", _free_port(), torch.get_num_threads(), graph=g.build(),
                         models=["reward"], tokenizer_dir=str(tmp_path / "tokenizer"), total_steps=1)
    try:
        batch = _batch()
        batch[K.PROMPT_TEXT] = NonTensorStack(*["ab="] * len(CASES))
        batch[K.GROUND_TRUTH] = NonTensorStack(*["ab"] * len(CASES))
        layout = worker.graph.dispatch_layout(worker.graph.node("reward"))
        scored, meta = worker.run_op(batch, node="reward", coords=layout.coords(0))
    finally:
        worker.shutdown()
    ended = [ended for _, ended in CASES]
    assert scored[K.SCORES].tolist() == [1.0 if e else 0.0 for e in ended]
    assert meta["metrics"]["reward/unfinished_frac"] == pytest.approx(1 - sum(ended) / len(CASES))
