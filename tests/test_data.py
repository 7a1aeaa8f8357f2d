"""Prompt data: char tokenizer, built-in tasks and rewards, JSONL loading, prompt batches."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoTokenizer

from hybridflow.data import keys
from hybridflow.data.datasets import (
    DataError,
    PromptDataset,
    collate_prompts,
    load_prompt_rows,
    validation_batches,
)
from hybridflow.data.tasks import TASKS, char_accuracy, copy_reward, get_task, reverse_reward
from hybridflow.data.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return get_task("copy").tokenizer()


def _texts(batch: TensorDict, key: str) -> list[str]:
    return batch.get(key).tolist()


# -- tokenizer --------------------------------------------------------------------------------


def test_char_tokenizer_vocab_and_round_trip(tmp_path):
    tok = build_char_tokenizer("abc=")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.get_vocab() == {"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3, "b": 4, "c": 5, "=": 6}
    assert len(tok) == 7
    assert tok.padding_side == "left"
    ids = tok("cab=", add_special_tokens=False)["input_ids"]
    assert ids == [5, 3, 4, 6]
    assert tok("cab=")["input_ids"] == ids  # no special tokens added by default either
    assert tok.decode(ids) == "cab="
    assert tok.decode([0, 0] + ids + [1, 0], skip_special_tokens=True) == "cab="
    assert tok("az")["input_ids"] == [3, 2]  # unknown character -> <unk>

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.padding_side) == (0, 1, "left")
    for text in ["cab=", "a", "bb=cc", "axc"]:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode([0] + ids + [1], skip_special_tokens=True) == "cab="
    padded = loaded(["ab=", "c"], padding=True)
    assert padded["input_ids"] == [[3, 4, 6], [0, 0, 5]]


def test_char_tokenizer_rejects_bad_alphabet():
    with pytest.raises(ValueError, match="repeats"):
        build_char_tokenizer("aba")
    with pytest.raises(ValueError, match="empty"):
        build_char_tokenizer("")


# -- tasks and rewards ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("abc", "abc", 1.0),
        ("abd", "abc", 2 / 3),
        ("xyz", "abc", 0.0),
        ("abcd", "abc", 3 / 4),  # extra character is wrong
        ("ab", "abc", 2 / 3),  # missing character is wrong
        ("", "abc", 0.0),
        ("bca", "abc", 0.0),  # positions, not multiset
        ("abcabc", "abc", 0.5),
        ("", "", 1.0),
        ("a", "", 0.0),
    ],
)
def test_char_accuracy(response, truth, expected):
    assert char_accuracy(response, truth) == pytest.approx(expected)
    assert copy_reward("whatever=", response, truth) == pytest.approx(expected)


def test_builtin_tasks_prompts():
    copy = get_task("copy")
    assert copy.tokenizer().get_vocab()["="] == 11 and len(copy.tokenizer()) == 12
    rows = copy.make_prompts(200, seed=3)
    assert rows == copy.make_prompts(200, seed=3)
    assert rows != copy.make_prompts(200, seed=4)
    assert len({row["prompt"] for row in rows}) == 200
    for row in rows:
        body = row["prompt"][:-1]
        assert row["prompt"].endswith("=") and 3 <= len(body) <= 5
        assert set(body) <= set("abcdefgh")
        assert row["ground_truth"] == body
        assert copy.reward_fn(row["prompt"], body, row["ground_truth"]) == 1.0

    reverse = get_task("reverse")
    for row in reverse.make_prompts(20, seed=0):
        assert row["ground_truth"] == row["prompt"][:-1][::-1]
    assert reverse.reward_fn is reverse_reward
    assert reverse_reward("abc=", "cba", "cba") == 1.0

    with pytest.raises(KeyError, match="copy"):
        get_task("nope")
    with pytest.raises(ValueError, match="distinct"):
        copy.make_prompts(copy.num_distinct_prompts + 1, seed=0)
    assert pickle.loads(pickle.dumps(TASKS["reverse"])).answer("abc") == "cba"


def test_builtin_source_split_is_deterministic_and_disjoint():
    train, val = load_prompt_rows("builtin:copy", "/nowhere", num_train=300, num_val=40, seed=7)
    assert (len(train), len(val)) == (300, 40)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    again = load_prompt_rows("builtin:copy", "/nowhere", num_train=300, num_val=40, seed=7)
    assert again == (train, val)
    other = load_prompt_rows("builtin:copy", "/nowhere", num_train=300, num_val=40, seed=8)
    assert other[0] != train
    with pytest.raises(DataError, match="unknown built-in task 'nope'"):
        load_prompt_rows("builtin:nope", ".", 1, 1, 0)


# -- JSONL ------------------------------------------------------------------------------------


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def _one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_jsonl_rows_and_split(tmp_path):
    lines = [json.dumps({"prompt": f"p{i}", "ground_truth": f"g{i}"}) for i in range(5)]
    lines.insert(2, "")  # blank lines are skipped
    lines.append(json.dumps({"prompt": "no truth", "extra": 1}))
    _write(tmp_path / "prompts.jsonl", lines)
    train, val = load_prompt_rows("prompts.jsonl", str(tmp_path), num_train=99, num_val=2, seed=0)
    assert [r["prompt"] for r in train] == ["p0", "p1", "p2", "p3"]
    assert [r["prompt"] for r in val] == ["p4", "no truth"]
    assert val[1]["ground_truth"] == ""
    assert train[2]["origin"].endswith("prompts.jsonl:4")

    # Absolute path; more validation rows asked than the file can spare: keep one train row.
    train, val = load_prompt_rows(str(tmp_path / "prompts.jsonl"), "/elsewhere", 1, 100, 0)
    assert len(train) == 1 and len(val) == 5


def test_jsonl_errors_are_one_line(tmp_path):
    with pytest.raises(DataError) as excinfo:
        load_prompt_rows("missing.jsonl", str(tmp_path), 1, 1, 0)
    assert "missing.jsonl: no such prompt file" in _one_line_error(excinfo)

    _write(tmp_path / "bad.jsonl", ['{"prompt": "ok"}', '{"prompt": "x",'])
    with pytest.raises(DataError) as excinfo:
        load_prompt_rows("bad.jsonl", str(tmp_path), 1, 1, 0)
    assert "bad.jsonl:2: expected valid JSON" in _one_line_error(excinfo)

    _write(tmp_path / "noprompt.jsonl", ['{"prompt": "ok"}', '{"prompt": "ok"}', '{"text": "x"}'])
    with pytest.raises(DataError) as excinfo:
        load_prompt_rows("noprompt.jsonl", str(tmp_path), 1, 1, 0)
    assert _one_line_error(excinfo).endswith(
        "noprompt.jsonl:3: prompt: expected a string or a list of {role, content} messages"
    )

    _write(tmp_path / "list.jsonl", ['["prompt"]'])
    with pytest.raises(DataError, match=r"list.jsonl:1: expected a JSON object"):
        load_prompt_rows("list.jsonl", str(tmp_path), 1, 1, 0)

    _write(tmp_path / "truth.jsonl", ['{"prompt": "a", "ground_truth": [3]}'])
    with pytest.raises(DataError, match=r"truth.jsonl:1: ground_truth: expected a string or a number"):
        load_prompt_rows("truth.jsonl", str(tmp_path), 1, 1, 0)

    _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DataError, match="at least one"):
        load_prompt_rows("empty.jsonl", str(tmp_path), 1, 1, 0)


def test_too_long_prompt_names_the_row(tmp_path, tokenizer):
    _write(tmp_path / "long.jsonl", ['{"prompt": "ab="}', '{"prompt": "abcdefgh="}'])
    train, _ = load_prompt_rows("long.jsonl", str(tmp_path), 1, 0, 0)
    with pytest.raises(DataError) as excinfo:
        PromptDataset(train, tokenizer, max_prompt_length=8, prompts_per_iteration=1)
    message = _one_line_error(excinfo)
    assert "long.jsonl:2: prompt 'abcdefgh=' is 9 tokens" in message
    assert "max_prompt_length = 8" in message
    with pytest.raises(DataError, match="prompt row 0"):
        collate_prompts([{"prompt": "abcdef="}], tokenizer, max_prompt_length=4)


# -- batches ----------------------------------------------------------------------------------


def test_collate_left_pads_to_longest_prompt(tokenizer):
    rows = [{"prompt": "ab=", "ground_truth": "ab"}, {"prompt": "cdeh=", "ground_truth": "cdeh"}]
    batch = collate_prompts(rows, tokenizer, max_prompt_length=16, uid_start=5)
    assert batch.batch_size == torch.Size([2])
    # a..h = 3..10, "=" = 11, pad = 0; P is the longest prompt (5), not max_prompt_length.
    assert batch[keys.PROMPT_IDS].tolist() == [[0, 0, 3, 4, 11], [5, 6, 7, 10, 11]]
    assert batch[keys.PROMPT_MASK].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch[keys.PROMPT_IDS].dtype == torch.int64
    assert batch[keys.PROMPT_MASK].dtype == torch.int64
    assert batch[keys.UID].tolist() == [5, 6] and batch[keys.UID].dtype == torch.int64
    assert _texts(batch, keys.PROMPT_TEXT) == ["ab=", "cdeh="]
    assert _texts(batch, keys.GROUND_TRUTH) == ["ab", "cdeh"]
    # Real tokens decode back to the prompt text.
    for ids, text in zip(batch[keys.PROMPT_IDS].tolist(), _texts(batch, keys.PROMPT_TEXT)):
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_non_tensor_strings_survive_slicing_cat_and_pickle(tokenizer):
    rows = [{"prompt": p, "ground_truth": p[:-1]} for p in ["a=", "bb=", "ccc=", "a="]]
    rows[3]["ground_truth"] = ""
    batch = collate_prompts(rows, tokenizer, max_prompt_length=8)

    assert _texts(batch[1:3], keys.PROMPT_TEXT) == ["bb=", "ccc="]
    assert batch[2][keys.PROMPT_TEXT] == "ccc="
    assert _texts(batch[torch.tensor([3, 0])], keys.GROUND_TRUTH) == ["", "a"]

    joined = torch.cat([batch[0:2], batch[2:4]], dim=0)
    assert joined.batch_size == torch.Size([4])
    assert _texts(joined, keys.PROMPT_TEXT) == ["a=", "bb=", "ccc=", "a="]
    assert _texts(joined, keys.GROUND_TRUTH) == ["a", "bb", "ccc", ""]

    # Identical strings stay per-sample too. (cat needs equal P: batches are padded to their
    # own longest prompt, so both sides here hold a 4-token prompt.)
    same = collate_prompts([rows[2], rows[2]], tokenizer, 8)
    assert _texts(torch.cat([same, batch[1:2]], dim=0), keys.PROMPT_TEXT) == ["ccc=", "ccc=", "bb="]

    restored = pickle.loads(pickle.dumps(batch))
    assert _texts(restored, keys.PROMPT_TEXT) == ["a=", "bb=", "ccc=", "a="]
    assert _texts(restored[1:], keys.GROUND_TRUTH) == ["bb", "ccc", ""]
    assert torch.equal(restored[keys.PROMPT_IDS], batch[keys.PROMPT_IDS])

    # Repeating each prompt n times (what rollout does) keeps the strings aligned with uids.
    repeated = batch.repeat_interleave(2, dim=0)
    assert _texts(repeated, keys.PROMPT_TEXT)[:4] == ["a=", "a=", "bb=", "bb="]
    assert repeated[keys.UID].tolist()[:4] == [0, 0, 1, 1]


def test_validation_batches(tokenizer):
    rows = get_task("copy").make_prompts(7, seed=0)
    whole = validation_batches(rows, tokenizer, 8)
    assert len(whole) == 1 and whole[0].batch_size == torch.Size([7])
    chunks = validation_batches(rows, tokenizer, 8, chunk_size=3)
    assert [c.batch_size[0] for c in chunks] == [3, 3, 1]
    assert torch.cat([c[keys.UID] for c in chunks]).tolist() == list(range(7))
    assert sum((_texts(c, keys.PROMPT_TEXT) for c in chunks), []) == [r["prompt"] for r in rows]
    assert validation_batches([], tokenizer, 8) == []


def _prompts(batch: TensorDict) -> list[str]:
    return _texts(batch, keys.PROMPT_TEXT)


def test_dataset_cycles_without_shuffle(tokenizer):
    rows = [{"prompt": c + "=", "ground_truth": c} for c in "abcde"]
    data = PromptDataset(rows, tokenizer, 4, prompts_per_iteration=3, shuffle=False)
    batches = [_prompts(data.next_batch()) for _ in range(4)]
    assert batches == [
        ["a=", "b=", "c="],
        ["d=", "e=", "a="],
        ["b=", "c=", "d="],
        ["e=", "a=", "b="],
    ]
    assert data.state_dict() == {"epoch": 2, "position": 2, "next_uid": 12, "num_rows": 5}
    assert next(iter(data))[keys.UID].tolist() == [12, 13, 14]


def test_dataset_reshuffles_each_epoch_and_resumes_exactly(tokenizer):
    rows = get_task("copy").make_prompts(10, seed=0)

    def make():
        return PromptDataset(rows, tokenizer, 8, prompts_per_iteration=4, shuffle=True, seed=1)

    data = make()
    stream = [data.next_batch() for _ in range(10)]  # 40 prompts = 4 epochs
    flat = sum((_prompts(b) for b in stream), [])
    epochs = [flat[i : i + 10] for i in range(0, 40, 10)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(r["prompt"] for r in rows)  # each epoch sees every prompt
    assert len({tuple(e) for e in epochs}) == 4  # and in a new order
    assert epochs[0] != [r["prompt"] for r in rows]
    uids = torch.cat([b[keys.UID] for b in stream]).tolist()
    assert uids == list(range(40))

    # Same seed: same stream. Other seed: other stream.
    same_seed = make()
    assert sum((_prompts(same_seed.next_batch()) for _ in range(3)), []) == flat[:12]
    other = PromptDataset(rows, tokenizer, 8, prompts_per_iteration=4, shuffle=True, seed=2)
    assert _prompts(other.next_batch()) + _prompts(other.next_batch()) != flat[:8]

    # Resume mid-epoch from a saved state: the rest of the stream is identical.
    data = make()
    for _ in range(3):
        data.next_batch()
    state = data.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    for expected in stream[3:]:
        got = resumed.next_batch()
        assert _prompts(got) == _prompts(expected)
        assert torch.equal(got[keys.UID], expected[keys.UID])
        assert torch.equal(got[keys.PROMPT_IDS], expected[keys.PROMPT_IDS])

    with pytest.raises(DataError, match="resume state is for 10 prompts"):
        PromptDataset(rows[:5], tokenizer, 8, 4).load_state_dict(state)


def test_dataset_batch_larger_than_dataset(tokenizer):
    rows = [{"prompt": "ab=", "ground_truth": "ab"}, {"prompt": "c=", "ground_truth": "c"}]
    data = PromptDataset(rows, tokenizer, 4, prompts_per_iteration=5, shuffle=True, seed=0)
    batch = data.next_batch()
    assert batch.batch_size == torch.Size([5])
    assert batch[keys.UID].tolist() == [0, 1, 2, 3, 4]
    assert sorted(_prompts(batch)[:2]) == ["ab=", "c="]
    with pytest.raises(DataError, match="at least one row"):
        PromptDataset([], tokenizer, 4, 1)
