"""The shipped command writing preference pairs from the copy task's rule: reward pairs ranked
by the rule, cost pairs labelled by letter_cost, held-out pairs from disjoint prompts, and files
the preference reader takes as they are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.data.preference_pairs import MIN_SCORE_GAP, corrupt, main, make_pairs
from hybridflow.data.preferences import collate_pairs, read_pairs
from hybridflow.data.tasks import copy_reward, get_task, letter_cost
from hybridflow.spec.graph import DataSpec

ROOT = Path(__file__).resolve().parent.parent


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_reward_pairs_rank_by_the_rule_with_disjoint_held_out_prompts(tmp_path, capsys):
    out, val_out = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    assert main(["--task", "copy", "--out", str(out), "--val-out", str(val_out),
                 "--num-train", "60", "--num-val", "20", "--pairs-per-prompt", "3", "--seed", "4"]) == 0
    assert f"{out}: 180 reward pairs from 60 prompts" in capsys.readouterr().out
    train, val = read_jsonl(out), read_jsonl(val_out)
    assert len(train) == 180 and len(val) == 60
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert len({r["prompt"] for r in train}) == 60
    for row in train + val:
        answer = row["prompt"].rstrip("=")
        assert copy_reward(row["prompt"], row["chosen"], answer) > copy_reward(row["prompt"], row["rejected"], answer)
    # each prompt's first pair is the correct copy against a corruption; the others rank two
    # imperfect responses as often as not
    assert all(row["chosen"] == row["prompt"].rstrip("=") for row in train[::3])
    assert sum(row["chosen"] != row["prompt"].rstrip("=") for row in train) > 30
    # the pairs of two samples are clear preferences: at least MIN_SCORE_GAP apart
    for k, row in enumerate(train):
        if k % 3:
            answer = row["prompt"].rstrip("=")
            gap = copy_reward(row["prompt"], row["chosen"], answer) - copy_reward(row["prompt"], row["rejected"], answer)
            assert gap >= MIN_SCORE_GAP - 1e-9, row
    # the reader takes them as they are, within the default graph lengths
    rows = read_pairs(str(out))
    spec = DataSpec()
    batch = collate_pairs(rows, get_task("copy").tokenizer(), spec.max_prompt_length, spec.max_response_length)
    assert batch.batch_size[0] == 180


def test_cost_rows_are_pku_saferlhf_rows_labelled_by_letter_cost(tmp_path):
    out, val_out = tmp_path / "cost.parquet", tmp_path / "cost_val.jsonl"
    main(["--kind", "cost", "--out", str(out), "--val-out", str(val_out), "--num-train", "50", "--num-val", "10",
          "--pairs-per-prompt", "2"])
    val = read_jsonl(val_out)
    reward_rows, cost_pairs = read_pairs(str(out), "reward"), read_pairs(str(out), "cost")
    assert len(reward_rows) == len(cost_pairs) == 100 and len(val) == 20
    assert not {r["prompt"] for r in cost_pairs} & {r["prompt"] for r in val}
    for row in val:
        responses = [row["response_0"], row["response_1"]]
        answer = row["prompt"].rstrip("=")
        costs = [letter_cost(row["prompt"], r, answer) for r in responses]
        rewards = [copy_reward(row["prompt"], r, answer) for r in responses]
        assert sorted(costs) == [0.0, 1.0]  # one safe, one unsafe
        assert [row["is_response_0_safe"], row["is_response_1_safe"]] == [c == 0.0 for c in costs]
        assert costs[row["safer_response_id"]] == 0.0
        assert rewards[row["better_response_id"]] > rewards[1 - row["better_response_id"]]
    for pair in cost_pairs:  # chosen: the less safe response, the one a cost model scores higher
        assert "a" in pair["chosen"] and "a" not in pair["rejected"]
        assert (pair["chosen_safe"], pair["rejected_safe"]) == (False, True)
    # a prompt with an "a": its first pair is the conflict, the correct copy is the unsafe one
    conflicts = [(r, c) for r, c in zip(reward_rows[::2], cost_pairs[::2]) if "a" in r["prompt"]]
    assert conflicts
    for reward_row, cost_pair in conflicts:
        assert reward_row["chosen"] == cost_pair["chosen"] == reward_row["prompt"].rstrip("=")
    # both safety ids occur in both positions: the order of the responses is random
    assert {r["safer_response_id"] for r in val} == {0, 1}


def test_same_seed_same_pairs_other_seed_others():
    first = make_pairs("copy", "reward", 20, 5, 2, seed=1)
    assert make_pairs("copy", "reward", 20, 5, 2, seed=1) == first
    assert make_pairs("copy", "reward", 20, 5, 2, seed=2) != first


def test_corruptions_stay_non_empty_and_bounded():
    import random

    rng = random.Random(0)
    for _ in range(500):
        text = corrupt("ab", "abcdefgh", rng, 3, max_chars=3)
        assert 1 <= len(text) <= 3


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--task", "product", "--kind", "cost"], "which task 'product' never writes"),
        (["--num-train", "100000"], "but task 'copy' has"),
        (["--pairs-per-prompt", "0"], "--pairs-per-prompt must be >= 1"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, expected):
    with pytest.raises(SystemExit) as excinfo:
        main(["--out", str(tmp_path / "t.jsonl"), "--val-out", str(tmp_path / "v.jsonl"), *argv])
    assert excinfo.value.code == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "t.jsonl").exists()


def test_samples_span_random_collapsed_partial_and_correct_responses():
    import random

    from hybridflow.data.preference_pairs import sample_response

    rng = random.Random(0)
    answer = "cabhe"
    drawn = [sample_response(answer, "abcdefgh", rng, 6) for _ in range(2000)]
    scores = [copy_reward(answer + "=", r, answer) for r in drawn]
    assert all(1 <= len(r) <= 6 for r in drawn)
    assert sum(s == 0.0 for s in scores) > 100 and sum(s == 1.0 for s in scores) > 100
    assert sum(0.0 < s < 1.0 for s in scores) > 800  # partial copies, graded by the rule
    # strings collapsed on one letter, as a policy that over-optimises a reward writes
    # (uniform random letters alone would give about one such string in 2000)
    assert sum(len(r) >= 4 and len(set(r)) == 1 for r in drawn) >= 8


def test_runs_as_a_module(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "hybridflow.data.preference_pairs", "--out", str(tmp_path / "t.jsonl"),
         "--val-out", str(tmp_path / "v.jsonl"), "--num-train", "3", "--num-val", "2"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert len(read_jsonl(tmp_path / "v.jsonl")) == 8  # four pairs per prompt by default


def test_pairs_from_samples_rank_disjoint_widest_first_and_drop_ties():
    from hybridflow.data.preference_pairs import pairs_from_samples

    responses = ["abc", "abd", "abc", "xyz", "ab", "", "abe"]
    scores = [1.0, 0.67, 0.9, 0.0, 0.67, 0.5, 0.67]
    rows = pairs_from_samples("abc=", responses, scores)
    # unique non-empty: abc 1.0, abd .67, xyz 0, ab .67, abe .67 -> ranked abc, abd, ab, abe, xyz
    assert [(r["chosen"], r["rejected"]) for r in rows] == [("abc", "xyz")]  # abd vs abe: a tie
    assert rows[0]["chosen_score"] == 1.0 and rows[0]["rejected_score"] == 0.0
    rows = pairs_from_samples([{"role": "user", "content": "q"}], ["a", "b", "c", "d"], [4, 3, 2, 1], max_pairs=5)
    assert [(r["chosen"], r["rejected"]) for r in rows] == [("a", "d"), ("b", "c")]
    assert rows[0]["prompt"] == [{"role": "user", "content": "q"}]
    assert pairs_from_samples(rows[0]["prompt"], ["a", "b", "c", "d"], [4, 3, 2, 1], max_pairs=1) == rows[:1]
    assert pairs_from_samples("p", ["a", "a"], [1.0, 0.0]) == []
    # the reader takes the rows, score fields and all
    from hybridflow.data.preferences import pair_row

    assert pair_row(rows[1], "row", "data.train_files")["rejected"] == "c"
