"""Data files read with HF datasets (verl parquet, JSONL), chat rendering, the generated
arithmetic task and pad = eos masks."""

from __future__ import annotations

import json

import datasets
import pytest
import torch

from hybridflow.data import keys as K
from hybridflow.data.arith_words import DATA_SOURCE, TEMPLATES, make_problems, write_parquet
from hybridflow.data.batch import build_rollout_fields
from hybridflow.data.datasets import (
    DataError,
    PromptDataset,
    collate_prompts,
    load_data,
    read_rows,
    render_prompt,
)
from hybridflow.data.tokenizer import build_char_tokenizer
from hybridflow.spec.graph import DataSpec

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer():
    """A character tokenizer with a ChatML template whose pad = eos = ``<|im_end|>``, as
    SmolLM2's (``<|im_end|>`` also closes every turn inside a rendered prompt)."""
    alphabet = "".join(chr(c) for c in range(32, 127)) + "\n"
    tok = build_char_tokenizer(alphabet)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = tok.pad_token = "<|im_end|>"
    tok.chat_template = CHATML
    return tok


# verl's examples/data_preprocess/gsm8k.py writes rows of exactly this shape.
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def gsm8k_rows(split: str, num: int) -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"Tom has {i} apples and buys 2. How many? {GSM8K_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
            "extra_info": {"split": split, "index": i, "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}",
                           "question": f"Tom has {i} apples and buys 2. How many?"},
        }
        for i in range(num)
    ]


def test_verl_gsm8k_parquet_loads_unchanged(tmp_path):
    datasets.Dataset.from_list(gsm8k_rows("train", 5)).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(gsm8k_rows("test", 3)).to_parquet(str(tmp_path / "test.parquet"))
    data = DataSpec(train_files=str(tmp_path / "train.parquet"), val_files=[str(tmp_path / "test.parquet")])
    train, val = load_data(data, None)
    assert len(train) == 5 and len(val) == 3
    row = train[1]
    assert row["data_source"] == "openai/gsm8k"
    assert row["ground_truth"] == "3"
    assert row["prompt"] == [{"role": "user", "content": gsm8k_rows("train", 2)[1]["prompt"][0]["content"]}]
    assert json.loads(row["extra_info"])["index"] == 1
    assert row["origin"].endswith("train.parquet:row 1")

    tok = chat_tokenizer()
    batch = collate_prompts(train, tok, max_prompt_length=200)
    assert batch[K.DATA_SOURCE] == ["openai/gsm8k"] * 5
    assert json.loads(batch[K.EXTRA_INFO][4])["index"] == 4


def test_same_rows_as_jsonl_and_short_schema(tmp_path):
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps(r) for r in gsm8k_rows("train", 3)] + [
        "",
        json.dumps({"prompt": "raw text prompt", "ground_truth": "7"}),
        json.dumps({"prompt": "a number truth", "ground_truth": 12}),  # types may differ by row
    ]
    path.write_text("\n".join(lines) + "\n")
    rows = read_rows(str(path))
    assert [r["ground_truth"] for r in rows] == ["2", "3", "4", "7", "12"]
    assert rows[3]["prompt"] == "raw text prompt" and rows[3]["data_source"] == ""
    assert rows[4]["origin"].endswith("rows.jsonl:6")  # line numbers skip the blank line
    # Without val_files the last num_val rows are the validation split.
    train, val = load_data(DataSpec(train_files=str(path), num_val=2), None)
    assert len(train) == 3 and [r["prompt"] for r in val] == ["raw text prompt", "a number truth"]


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"prompt": 3}, "prompt: expected a string or a list of {role, content} messages"),
        ({"prompt": [{"role": "robot", "content": "x"}]}, "prompt[0].role: expected one of system, user, assistant, tool, got 'robot'"),
        ({"prompt": [{"role": "user", "content": None}]}, "prompt[0].content: expected a string"),
        ({"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": [1]}},
         "reward_model.ground_truth: expected a string or a number"),
        ({"data_source": 5, "prompt": "x"}, "data_source: expected a string"),
    ],
)
def test_bad_row_is_one_line_naming_file_row_and_field(tmp_path, row, expected):
    good = {"prompt": [{"role": "user", "content": "fine"}], "reward_model": {"ground_truth": "1"}}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as excinfo:
        read_rows(str(path), "data.train_files")
    message = str(excinfo.value)
    assert message == f"{path}:2: {expected}"
    assert excinfo.value.field == "data.train_files"


def test_bad_parquet_row_names_the_row(tmp_path):
    rows = gsm8k_rows("train", 3)
    rows[2]["prompt"] = [{"role": "user", "content": "x"}, {"role": "narrator", "content": "y"}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(DataError, match=r"t.parquet:row 2: prompt\[1\].role: expected one of"):
        read_rows(str(tmp_path / "t.parquet"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"broken.parquet: cannot read as parquet"):
        read_rows(str(tmp_path / "broken.parquet"))
    (tmp_path / "rows.csv").write_text("prompt\nx\n")
    with pytest.raises(DataError, match=r"rows.csv: expected a .parquet, .jsonl or .json file"):
        read_rows(str(tmp_path / "rows.csv"))


def test_unreadable_parquet_says_what_is_wrong(tmp_path):
    """No rows, a column given twice and a directory each get their own line, not the
    DatasetGenerationError (or "no such data file") they gave before."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    twice = tmp_path / "twice.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["ab="]), pa.array(["ab"]), pa.array(["x"])],
                                        names=["prompt", "ground_truth", "prompt"]), twice)
    folder = tmp_path / "folder.parquet"
    folder.mkdir()
    for path, expected in [(empty, "expected at least one row, found none"),
                           (twice, "duplicated column 'prompt'; expected each column once"),
                           (folder, "is a directory, expected a .parquet, .jsonl or .json file (data.train_files)")]:
        with pytest.raises(DataError) as excinfo:
            read_rows(str(path), "data.train_files")
        assert str(excinfo.value) == f"{path}: {expected}"


def test_chat_rendering_equals_apply_chat_template():
    tok = chat_tokenizer()
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    row = {"prompt": messages, "origin": "x"}
    text, ids = render_prompt(row, tok)
    assert ids == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert text == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    # data.system_prompt goes first when the messages have none ...
    _, with_system = render_prompt(row, tok, system_prompt="Be brief.")
    expected = [{"role": "system", "content": "Be brief."}, *messages]
    assert with_system == list(tok.apply_chat_template(expected, add_generation_prompt=True, tokenize=True, return_dict=False))
    # ... and never replaces the row's own.
    own = [{"role": "system", "content": "Mine."}, *messages]
    assert render_prompt({"prompt": own}, tok, system_prompt="Be brief.")[1] == list(
        tok.apply_chat_template(own, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    # Raw strings are tokenized as they are, no template ...
    assert render_prompt({"prompt": "ab"}, tok)[1] == tok("ab", add_special_tokens=False)["input_ids"]
    # ... unless a system prompt is set: then the string is the user's message after it.
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]
    assert render_prompt({"prompt": "ab"}, tok, system_prompt="Be brief.")[1] == list(
        tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def test_rollout_starts_from_the_rendered_ids():
    """The batch's prompt ids (left-padded) are exactly the rendered ids, the pad id inside a
    rendered prompt (``<|im_end|>`` closing the system turn) included."""
    tok = chat_tokenizer()
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}]},
        {"prompt": [{"role": "user", "content": "a longer question"}]},
    ]
    batch = collate_prompts(rows, tok, max_prompt_length=200, system_prompt="S")
    for i, row in enumerate(rows):
        ids = render_prompt(row, tok, "S")[1]
        mask = batch[K.PROMPT_MASK][i].bool()
        assert batch[K.PROMPT_IDS][i][mask].tolist() == ids
        assert ids.count(tok.pad_token_id) == 2  # the system and user turns' <|im_end|>
        assert int(mask.sum()) == len(ids)


def test_pad_equal_to_eos_masks():
    """pad = eos = <|im_end|>: the response mask keeps the first EOS (the ending the policy
    learns) and drops only what follows; prompt masks come from lengths, not from the pad id."""
    tok = chat_tokenizer()
    eos = pad = tok.eos_token_id
    assert tok.pad_token_id == tok.eos_token_id
    prompts = collate_prompts([{"prompt": [{"role": "user", "content": "q"}]},
                               {"prompt": [{"role": "user", "content": "a longer q"}]}], tok, 100)
    a = tok("12", add_special_tokens=False)["input_ids"]
    responses = torch.tensor([a + [eos, pad, pad], a + a + [7]])  # ended / truncated
    fields = build_rollout_fields(prompts[K.PROMPT_IDS], prompts[K.PROMPT_MASK], responses, eos, pad)
    assert fields[K.RESPONSE_MASK].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert fields[K.TRUNCATED].tolist() == [False, True]
    # The prompt's own <|im_end|> tokens (= pad) stay inside the attention mask.
    attention = fields[K.ATTENTION_MASK]
    row = prompts[K.PROMPT_IDS][0]
    inner_eos = (row == eos) & prompts[K.PROMPT_MASK][0].bool()
    assert int(inner_eos.sum()) == 1 and bool(attention[0, : row.shape[0]][inner_eos].all())
    # Left padding (also the pad id) is outside it.
    assert int(prompts[K.PROMPT_MASK][0].sum()) < prompts[K.PROMPT_IDS].shape[1]


def test_too_long_chat_prompt_names_the_row():
    tok = chat_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": "x" * 50}], "origin": "f.parquet:row 0"}]
    with pytest.raises(DataError, match=r"^f.parquet:row 0: prompt 'x{50}' is \d+ tokens after the chat template, expected 1 to data.max_prompt_length = 20$"):
        PromptDataset(rows, tok, max_prompt_length=20, prompts_per_iteration=1)


# -- the generated task -------------------------------------------------------------------------


def test_arith_words_is_seeded_distinct_and_verl_shaped(tmp_path):
    rows = make_problems(400, seed=3)
    assert rows == make_problems(400, seed=3) and rows != make_problems(400, seed=4)
    texts = [r["prompt"][0]["content"] for r in rows]
    assert len(set(texts)) == 400
    assert {r["extra_info"]["template"] for r in rows} == {t.name for t in TEMPLATES}
    assert all(r["data_source"] == DATA_SOURCE and int(r["reward_model"]["ground_truth"]) >= 0 for r in rows)
    # The built-in source and the parquet command give the same split.
    train, test = load_data(DataSpec(source="builtin:arith_words", num_train=300, num_val=100, seed=3), None)
    assert [r["prompt"] for r in train] == [r["prompt"] for r in rows[:300]]
    assert not {t["prompt"][0]["content"] for t in train} & {t["prompt"][0]["content"] for t in test}
    train_file, test_file = write_parquet(tmp_path, 300, 100, seed=3)
    from_files = load_data(DataSpec(train_files=str(train_file), val_files=str(test_file), num_val=100), None)
    assert [r["prompt"] for r in from_files[0]] == [r["prompt"] for r in train]
    assert [r["ground_truth"] for r in from_files[1]] == [r["ground_truth"] for r in test]


def test_arith_words_answers_follow_the_text():
    for row in make_problems(200, seed=0):
        info = row["extra_info"]
        assert str(info["answer"]) == row["reward_model"]["ground_truth"]


def test_a_row_without_ground_truth_passes_only_where_no_scorer_needs_one():
    """The refusal itself is a case of tests/bad_inputs/cases.yaml; `ground_truth: optional`
    on the score node, or a learned reward model, lets the same rows through."""
    from pathlib import Path

    from hybridflow.controller.preflight import check_score_inputs
    from hybridflow.graph.dag import load_graph

    root = Path(__file__).resolve().parent.parent
    rows = read_rows(str(root / "tests/bad_inputs/rows_no_ground_truth.jsonl"))
    assert [row["ground_truth"] for row in rows] == ["ab", ""]
    base = str(root / "tests/bad_inputs/base.yaml")
    with pytest.raises(DataError, match=r"rows_no_ground_truth.jsonl:2: reward_model.ground_truth: missing"):
        check_score_inputs(load_graph(base), rows)
    check_score_inputs(load_graph(base, ["nodes.reward.options.ground_truth=optional"]), rows)
    check_score_inputs(load_graph(base, ["models.reward.source={config: {hidden_size: 32}}"]), rows)
