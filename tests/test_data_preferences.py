"""Preference pairs read with HF datasets: TRL/OpenRLHF and PKU-SafeRLHF rows, the bad rows
each named by file, row and field, and the batch a scalar model's forward takes."""

from __future__ import annotations

import json

import datasets
import pytest
import torch

from hybridflow.data import keys as K
from hybridflow.data.datasets import DataError, render_prompt
from hybridflow.data.preferences import (
    PairDataset,
    collate_pairs,
    encode_pairs,
    load_pair_data,
    pair_forward_batch,
    pair_loss_inputs,
    read_pairs,
    split_pair_scores,
)
from hybridflow.data.tasks import get_task
from hybridflow.spec.graph import DataSpec
from test_data_files import chat_tokenizer

COPY = get_task("copy").tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_trl_string_rows_to_a_pair_batch(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "abc=", "chosen": "abc", "rejected": "abd"},
        {"prompt": "hgfed=", "chosen": "hgfed", "rejected": "h", "margin": 0.5},
    ])
    rows = read_pairs(path)
    assert [r["origin"] for r in rows] == [f"{path}:1", f"{path}:2"]
    assert rows[1]["chosen"] == "hgfed" and rows[1]["margin"] == 0.5 and rows[0]["margin"] == 0.0
    batch = collate_pairs(rows, COPY, max_prompt_length=8, max_response_length=6, uid_start=10)
    eos, pad = COPY.eos_token_id, COPY.pad_token_id
    assert batch.batch_size == torch.Size([2])
    assert batch[K.UID].tolist() == [10, 11]
    # prompts left-padded to the longest (6 tokens), responses right-padded to one width (6)
    assert batch[K.PROMPT_IDS][0].tolist() == [pad, pad, *ids(COPY, "abc=")]
    assert batch[K.PROMPT_MASK][0].tolist() == [0, 0, 1, 1, 1, 1]
    assert batch[K.CHOSEN_IDS].tolist() == [[*ids(COPY, "abc"), eos, pad, pad], [*ids(COPY, "hgfed"), eos]]
    assert batch[K.REJECTED_IDS].tolist() == [[*ids(COPY, "abd"), eos, pad, pad], [*ids(COPY, "h"), eos, *[pad] * 4]]
    assert batch[K.CHOSEN_MASK].tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    assert batch[K.REJECTED_MASK].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    assert batch[K.PAIR_MARGIN].tolist() == [0.0, 0.5]
    assert K.CHOSEN_SAFETY_SIGN not in batch.keys()
    assert batch[K.PROMPT_TEXT] == ["abc=", "hgfed="]


def test_chat_rows_in_their_three_shapes_render_like_prompts(tmp_path):
    tok = chat_tokenizer()
    user = [{"role": "user", "content": "Say hi"}]
    answer = [{"role": "assistant", "content": "hi!"}]
    other = [{"role": "assistant", "content": "no."}]
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": user, "chosen": answer, "rejected": other},  # TRL explicit prompt
        {"prompt": "Say hi", "chosen": user + answer, "rejected": user + other},  # H4 ultrafeedback
        {"chosen": user + answer, "rejected": user + other},  # TRL implicit prompt
        {"prompt": user, "chosen": "hi!", "rejected": "no."},  # chat prompt, string responses
    ])
    rows = read_pairs(path)
    encoded = encode_pairs(rows, tok, max_prompt_length=64, max_response_length=8)
    text, prompt_ids = render_prompt({"prompt": user}, tok)
    assert text.endswith("<|im_start|>assistant\n")
    for pair in encoded:
        assert (pair.prompt_text, pair.prompt_ids) == (text, prompt_ids)
        # what a rollout would hold: the content's tokens and EOS (<|im_end|> for ChatML)
        assert pair.chosen_ids == [*ids(tok, "hi!"), tok.convert_tokens_to_ids("<|im_end|>")]
        assert pair.rejected_ids == [*ids(tok, "no."), tok.eos_token_id]


def pku(**overrides):
    row = {
        "prompt": "abc=", "response_0": "abc", "response_1": "bbc", "better_response_id": 0,
        "safer_response_id": 1, "is_response_0_safe": False, "is_response_1_safe": True,
    }
    return {**row, **overrides}


def test_pku_saferlhf_rows_give_reward_and_cost_pairs(tmp_path):
    path = tmp_path / "pku.parquet"
    datasets.Dataset.from_list([pku(), pku(response_0="ab", better_response_id=1, safer_response_id=0,
                                           is_response_0_safe=True, is_response_1_safe=True)]).to_parquet(str(path))
    reward = read_pairs(str(path), "reward")
    assert [(r["chosen"], r["rejected"]) for r in reward] == [("abc", "bbc"), ("bbc", "ab")]
    assert reward[0]["chosen_safe"] is None and reward[0]["origin"] == f"{path}:row 0"
    cost = read_pairs(str(path), "cost")
    # chosen = the less safe response: the one a cost model scores higher
    assert [(r["chosen"], r["rejected"]) for r in cost] == [("abc", "bbc"), ("bbc", "ab")]
    assert [(r["chosen_field"], r["rejected_field"]) for r in cost] == [("response_0", "response_1"), ("response_1", "response_0")]
    batch = collate_pairs(cost, COPY, max_prompt_length=8, max_response_length=6)
    assert batch[K.CHOSEN_SAFETY_SIGN].tolist() == [1.0, -1.0]  # +1 unsafe, -1 safe
    assert batch[K.REJECTED_SAFETY_SIGN].tolist() == [-1.0, -1.0]

    # one parquet file of both formats: each row gets every column, None where it has none
    mixed = tmp_path / "mixed.parquet"
    both = [pku(), {"prompt": "ab=", "chosen": "ab", "rejected": "b"}]
    columns = {name: [row.get(name) for row in both] for name in {**both[0], **both[1]}}
    datasets.Dataset.from_dict(columns).to_parquet(str(mixed))
    assert [(r["chosen_field"], r["chosen"]) for r in read_pairs(str(mixed))] == [("response_0", "abc"), ("chosen", "ab")]


TRL_GOOD = {"prompt": "abc=", "chosen": "abc", "rejected": "abd"}
ROBOT = [{"role": "robot", "content": "x"}]
ASSIST = [{"role": "assistant", "content": "abc"}]


@pytest.mark.parametrize(
    "kind, row, expected",
    [
        ("reward", {"prompt": "abc=", "chosen": "abc"}, "rejected: missing; expected a string or chat messages"),
        ("reward", {"chosen": "abc", "rejected": "abd"}, "prompt: missing; expected a string or chat messages"),
        ("reward", {"prompt": "abc=", "chosen": "abc", "rejected": "abc"},
         "rejected: the same as chosen; expected two different responses"),
        ("reward", {"prompt": "abc=", "chosen": "", "rejected": "abd"}, "chosen: expected a non-empty response"),
        ("reward", {"prompt": "abc=", "chosen": "abc", "rejected": [{"role": "assistant", "content": " "}]},
         "rejected: expected a non-empty response"),
        ("reward", {"prompt": "abc=", "chosen": 3, "rejected": "abd"},
         "chosen: expected a string or a list of {role, content} messages"),
        ("reward", {"prompt": ["abc="], "chosen": "abc", "rejected": "abd"}, "prompt[0]: expected a {role, content} message"),
        ("reward", {"prompt": ROBOT, "chosen": "abc", "rejected": "abd"},
         "prompt[0].role: expected one of system, user, assistant, tool, got 'robot'"),
        ("reward", {"prompt": "abc=", "chosen": ROBOT + ASSIST, "rejected": "abd"},
         "chosen[0].role: expected one of system, user, assistant, tool, got 'robot'"),
        ("reward", {"prompt": "abc=", "chosen": [{"role": "user", "content": "abc"}], "rejected": "abd"},
         "chosen[0].role: expected assistant (the response is the last message), got 'user'"),
        ("reward", {"prompt": "abc=", "chosen": [{"role": "user", "content": "x="}, *ASSIST], "rejected": "abd"},
         "chosen: the messages before its response differ from prompt"),
        ("reward", {"chosen": [{"role": "user", "content": "x="}, *ASSIST],
                    "rejected": [{"role": "user", "content": "y="}, {"role": "assistant", "content": "b"}]},
         "rejected: the messages before its response differ from chosen's"),
        ("reward", {**TRL_GOOD, "margin": "big"}, "margin: expected a finite number, got 'big'"),
        ("reward", {"prompt": "abc=", "answer": "abc"}, "chosen: missing; expected a preference row"),
        ("reward", pku(better_response_id=2), "better_response_id: expected 0 or 1, got 2"),
        ("reward", pku(better_response_id="0"), "better_response_id: expected 0 or 1, got '0'"),
        ("reward", pku(better_response_id=True), "better_response_id: expected 0 or 1, got True"),
        ("reward", pku(better_response_id=None), "better_response_id: missing; expected PKU-SafeRLHF's fields"),
        ("reward", pku(response_1="abc"), "response_1: the same as response_0; expected two different responses"),
        ("reward", pku(response_0=""), "response_0: expected a non-empty response"),
        ("cost", pku(safer_response_id=-1), "safer_response_id: expected 0 or 1, got -1"),
        ("cost", pku(is_response_1_safe="yes"), "is_response_1_safe: expected true or false, got 'yes'"),
        ("cost", {k: v for k, v in pku().items() if k != "is_response_0_safe"}, "is_response_0_safe: missing"),
        ("cost", TRL_GOOD, "safer_response_id: missing; cost pairs need PKU-SafeRLHF rows"),
    ],
)
def test_bad_row_is_one_line_naming_file_row_and_field(tmp_path, kind, row, expected):
    good = pku() if kind == "cost" else TRL_GOOD
    path = write_jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(DataError) as excinfo:
        read_pairs(path, kind, "data.val_files")
    message = str(excinfo.value)
    assert message.startswith(f"{path}:2: {expected}"), message
    assert "\n" not in message
    assert excinfo.value.field == "data.val_files"


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"prompt": "abcdefgh=", "chosen": "a", "rejected": "b"}, "prompt 'abcdefgh=' is 9 tokens, expected 1 to data.max_prompt_length = 8"),
        ({"prompt": "abc=", "chosen": "abc", "rejected": "abcdef"},
         "rejected: the response is 7 tokens with its EOS, expected at most data.max_response_length = 6"),
        (pku(response_1="abcdefgh"), "response_1: the response is 9 tokens with its EOS"),
        ({"prompt": "abc=", "chosen": "abc", "rejected": "xyz"}, "rejected: has characters outside the built-in task's tokenizer: 'xyz'"),
    ],
)
def test_row_over_the_length_limit_names_row_and_field(tmp_path, row, expected):
    path = write_jsonl(tmp_path / "long.jsonl", [TRL_GOOD, row])
    rows = read_pairs(path)
    with pytest.raises(DataError) as excinfo:
        collate_pairs(rows, COPY, max_prompt_length=8, max_response_length=6)
    assert str(excinfo.value).startswith(f"{path}:2: {expected}"), str(excinfo.value)


def test_load_pair_data_reads_train_files_first_and_splits(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{**TRL_GOOD, "chosen": c} for c in ("a", "b", "c", "d")])
    val = write_jsonl(tmp_path / "val.jsonl", [{**TRL_GOOD, "chosen": "e"}, {**TRL_GOOD, "chosen": "f"}])
    rows, held_out = load_pair_data(DataSpec(train_files=train, num_val=1), None)
    assert [r["chosen"] for r in rows] == ["a", "b", "c"] and [r["chosen"] for r in held_out] == ["d"]
    rows, held_out = load_pair_data(DataSpec(train_files=train, val_files=val, num_val=1), None)
    assert len(rows) == 4 and [r["chosen"] for r in held_out] == ["e"]

    bad_train = write_jsonl(tmp_path / "bad_train.jsonl", [{"prompt": "abc="}])
    bad_val = write_jsonl(tmp_path / "bad_val.jsonl", [{"prompt": "abc="}])
    with pytest.raises(DataError, match="bad_train.jsonl:1: chosen: missing") as excinfo:
        load_pair_data(DataSpec(train_files=bad_train, val_files=bad_val), None)
    assert excinfo.value.field == "data.train_files"
    with pytest.raises(DataError, match="data.train_files: expected preference files"):
        load_pair_data(DataSpec(), None)


def test_pair_forward_batch_interleaves_chosen_and_rejected(tmp_path):
    rows = read_pairs(write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "abc=", "chosen": "abc", "rejected": "ab"},
        {"prompt": "ab=", "chosen": "ab", "rejected": "abcd", "margin": 2.0},
    ]))
    pairs = collate_pairs(rows, COPY, max_prompt_length=8, max_response_length=6, uid_start=5)
    batch = pair_forward_batch(pairs)
    assert batch.batch_size == torch.Size([4])
    eos, pad = COPY.eos_token_id, COPY.pad_token_id
    # sample 3 is pair 1's rejected response after its left-padded prompt
    assert batch[K.INPUT_IDS][3].tolist() == [pad, *ids(COPY, "ab="), *ids(COPY, "abcd"), eos]
    assert batch[K.ATTENTION_MASK][3].tolist() == [0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert batch[K.POSITION_IDS][3].tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert batch[K.INPUT_IDS][2].tolist() == [pad, *ids(COPY, "ab="), *ids(COPY, "ab"), eos, pad, pad]
    assert torch.equal(batch[K.RESPONSES][0::2], pairs[K.CHOSEN_IDS])
    assert torch.equal(batch[K.RESPONSE_MASK][1::2], pairs[K.REJECTED_MASK])
    assert batch[K.UID].tolist() == [5, 5, 6, 6] and batch[K.PAIR_MARGIN].tolist() == [0, 0, 2, 2]

    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    inputs = pair_loss_inputs(batch, scores)
    assert inputs["chosen_scores"].tolist() == [1.0, 3.0] and inputs["rejected_scores"].tolist() == [2.0, 4.0]
    assert inputs["margin"].tolist() == [0.0, 2.0] and "chosen_signs" not in inputs
    assert split_pair_scores(scores)[1].tolist() == [2.0, 4.0]
    # in-order micro-batches of 2 keep the pairs; of 3 they split one
    assert pair_loss_inputs(batch[2:], scores[2:])["chosen_scores"].tolist() == [3.0]
    with pytest.raises(ValueError, match="split a preference pair"):
        pair_loss_inputs(batch[1:3], scores[1:3])
    with pytest.raises(ValueError, match="split a preference pair"):
        pair_loss_inputs(batch[:3], scores[:3])


def test_cost_pairs_carry_their_signs_to_the_loss(tmp_path):
    rows = read_pairs(write_jsonl(tmp_path / "c.jsonl", [pku(), pku(safer_response_id=0, is_response_1_safe=False)]), "cost")
    batch = pair_forward_batch(collate_pairs(rows, COPY, max_prompt_length=8, max_response_length=6))
    inputs = pair_loss_inputs(batch, torch.zeros(4))
    # pair 0: response_0 (unsafe) is chosen over the safe response_1; pair 1: response_1
    # (unsafe) over response_0 (unsafe as well)
    assert inputs["chosen_signs"].tolist() == [1.0, 1.0]
    assert inputs["rejected_signs"].tolist() == [-1.0, 1.0]


def test_pair_dataset_serves_fixed_size_batches_and_resumes(tmp_path):
    rows = read_pairs(write_jsonl(tmp_path / "p.jsonl", [{**TRL_GOOD, "chosen": c} for c in "abcde"]))
    dataset = PairDataset(rows, COPY, max_prompt_length=8, max_response_length=6, pairs_per_iteration=3, seed=1)
    first = [dataset.next_batch() for _ in range(3)]  # 9 pairs: into the second epoch
    assert all(b.batch_size == torch.Size([3]) for b in first)
    assert [b[K.UID].tolist() for b in first] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    served = [COPY.decode(ids[:1]) for b in first for ids in b[K.CHOSEN_IDS]]
    assert sorted(served[:5]) == list("abcde")  # the first epoch is a permutation of the pairs

    resumed = PairDataset(rows, COPY, max_prompt_length=8, max_response_length=6, pairs_per_iteration=3, seed=1)
    resumed.load_state_dict(dataset.state_dict())
    assert torch.equal(resumed.next_batch()[K.CHOSEN_IDS], dataset.next_batch()[K.CHOSEN_IDS])

    too_long = read_pairs(write_jsonl(tmp_path / "long.jsonl", [TRL_GOOD, {**TRL_GOOD, "rejected": "abcdefgh"}]))
    with pytest.raises(DataError, match=r"long.jsonl:2: rejected: the response is 9 tokens"):
        PairDataset(too_long, COPY, max_prompt_length=8, max_response_length=6, pairs_per_iteration=1)
    with pytest.raises(DataError, match="no training pairs"):
        PairDataset([], COPY, max_prompt_length=8, max_response_length=6, pairs_per_iteration=1)


def test_a_json_array_file_reads_like_json_lines(tmp_path):
    rows = [TRL_GOOD, {**TRL_GOOD, "chosen": "a", "margin": 1}]
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(rows, indent=2))
    read = read_pairs(str(path))
    assert [(r["chosen"], r["margin"], r["origin"]) for r in read] == [("abc", 0.0, f"{path}:row 0"), ("a", 1.0, f"{path}:row 1")]
    path.write_text(json.dumps([TRL_GOOD, {**TRL_GOOD, "rejected": "abc"}]))
    with pytest.raises(DataError, match=r"pairs.json:row 1: rejected: the same as chosen"):
        read_pairs(str(path))
    path.write_text('[\n{"prompt": "a=",\n "chosen": }]')
    with pytest.raises(DataError, match=r"pairs.json:3: expected valid JSON"):
        read_pairs(str(path))
    path.write_text('[["a"]]')
    with pytest.raises(DataError, match=r"pairs.json:row 0: expected a JSON object"):
        read_pairs(str(path))
