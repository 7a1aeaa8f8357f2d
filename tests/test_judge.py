"""LLM judges (issue 48): the verdict parser on numbers, ranges, labels and garbage; the judge
options and graph checks at load; and graphs/grpo_judge.yaml on real Ray, whose tiny judge (a
copy of the initial policy) writes garbage and verdicts that never end: with on_error: default
the run goes on and counts them, with on_error: fail it stops in one line naming the node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from hybridflow.graph.dag import load_graph
from hybridflow.rewards.judge import Verdict, fill_template, parse_verdict, read_verdict
from hybridflow.spec.graph import JudgeOptions
from hybridflow.spec.loading import SpecError

ROOT = Path(__file__).resolve().parent.parent
GRAPH = ROOT / "graphs" / "grpo_judge.yaml"


# -- the parser ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("Score: 7", 0.7),
    ("7/10, because it copies", 0.7),  # the first number counts
    ("0", 0.0),
    ("10.", 1.0),
    ("a solid 2.5 out of 10", 0.25),
    ("11", None),  # outside the scale
    ("-1", None),
    ("no number here", None),
    ("", None),
    ("x9\x00\ufffd", 0.9),
])
def test_a_number_in_the_scale_is_rescaled_to_0_1(text, expected):
    score = parse_verdict(text, JudgeOptions())
    assert score == (pytest.approx(expected) if expected is not None else None)


def test_a_pattern_group_picks_the_number_and_the_scale_bounds_it():
    opts = JudgeOptions(scale=(1, 5), pattern=r"Rating:\s*(\d+)")
    assert parse_verdict("I count 3 errors. Rating: 5", opts) == 1.0
    assert parse_verdict("Rating: 1", opts) == 0.0
    assert parse_verdict("Rating: 6", opts) is None
    assert parse_verdict("I count 3 errors.", opts) is None


@pytest.mark.parametrize("text, expected", [
    ("Yes.", 1.0),
    ("NO, it does not", 0.0),
    ("no... well, yes", 0.0),  # the first label found
    ("not good at all", -1.0),  # the longer label at one position
    ("good", 0.5),
    ("yesterday nobody", None),  # whole words only
    ("garbage \x00 cab=", None),
])
def test_labels_map_the_first_whole_word_label_to_its_score(text, expected):
    opts = JudgeOptions(labels={"yes": 1.0, "no": 0.0, "good": 0.5, "not good": -1.0})
    assert parse_verdict(text, opts) == expected


def test_a_verdict_that_did_not_end_is_a_timeout_even_with_a_number():
    opts = JudgeOptions()
    assert read_verdict("Score: 7 and", ended=False, options=opts) == Verdict(None, "timeout")
    assert read_verdict("garbage", ended=True, options=opts) == Verdict(None, "parse_error")
    assert read_verdict("Score: 7", ended=True, options=opts) == Verdict(pytest.approx(0.7), None)


def test_the_template_holds_prompt_response_and_ground_truth():
    template = "Q: {prompt} A: {response} ({ground_truth}) {{score}}:"
    assert fill_template(template, "ab=", "ab", "ab") == "Q: ab= A: ab (ab) {score}:"
    assert fill_template(template, "ab=", "ab", None) == "Q: ab= A: ab () {score}:"


@pytest.mark.parametrize("options, message", [
    ({"template": "{prompt} {answer}"}, "unknown placeholders ['answer']"),
    ({"template": "{prompt}"}, "must hold {response}"),
    ({"template": "{response"}, "not a format string"),
    ({"pattern": "(a)(b)"}, "at most one"),
    ({"pattern": "("}, "not a regular expression"),
    ({"scale": (5, 5)}, "min must be below max"),
    ({"labels": {"yes": 1}, "scale": (0, 1)}, "not both"),
    ({"labels": {}}, "non-empty labels"),
    ({"max_new_tokens": 0}, "greater than or equal to 1"),
])
def test_bad_judge_options_are_refused(options, message):
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]").replace("{", r"\{").replace("}", r"\}").replace("(", r"\(")):
        JudgeOptions(**options)


# -- the graph at load -----------------------------------------------------------------------


@pytest.mark.parametrize("override, field, message", [
    ("models.judge.rollout=null", "models.judge.rollout", "judge node 'judge' generates its verdicts"),
    ("models.judge.source={rule: hybridflow.data.tasks:copy_reward}", "models.judge.source", "give it weights"),
    ("models.ref.rollout={engine: hf}", "models.ref", "only an actor or a judge"),
    ("models.rule.rollout={engine: hf}", "models.rule.rollout", "only as a judge"),
    ("nodes.rule.model=judge", "nodes[3].op", "it runs judge nodes only, not score"),
    ("nodes.judge.model=ref", "nodes[2].op", "a ref cannot judge"),
])
def test_a_judge_graph_is_checked_at_load(override, field, message):
    with pytest.raises(SpecError) as info:
        load_graph(GRAPH, [override])
    assert info.value.field == field and message in str(info.value), str(info.value)


def test_the_judge_runs_on_its_rollout_engine_and_keeps_samples_per_prompt():
    graph = load_graph(GRAPH)
    node = graph.node("judge")
    assert graph.op(node).runs_rollout_engine and not graph.op(node).generates
    assert graph.judge_node("judge") is node and graph.judge_node("actor") is None
    assert graph.dispatch_layout(node) == graph.layouts["judge"]
    # judge: 16-token templates + 2 verdict tokens, one verdict per sample (8 prompts x n 8)
    assert graph.rollout_sizes("judge") == (18, 16, 64)
    assert graph.rollout_sizes("actor") == (16, 8, 64)


# -- runs on real Ray ------------------------------------------------------------------------


def _run(overrides: list[str], run_dir: Path, capsys) -> tuple[int, str]:
    from hybridflow.cli.main import main

    code = main(["run", str(GRAPH), "trainer.iterations=3", "trainer.val_interval=0", "trainer.save_final=false",
                 "data.prompts_per_iteration=4", "models.actor.rollout.n=4", *overrides, "--run-dir", str(run_dir)])
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_grpo_judge_runs_3_iterations_and_counts_garbage_and_unending_verdicts(ray_session, tmp_path, monkeypatch,
                                                                               capsys):
    """Sampled at a high temperature, the tiny judge's verdicts end early (garbage: parse
    errors), run past max_new_tokens (timeouts) or hold a label; the failures score
    default_reward and the run goes on."""
    monkeypatch.chdir(ROOT)
    code, err = _run(["nodes.judge.options.greedy=false", "models.judge.rollout.temperature=5.0",
                      "nodes.judge.options.default_reward=-1.0", "nodes.judge.options.unfinished=keep"],
                     tmp_path / "run", capsys)
    assert code == 0, err[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    parse_errors = sum(r["judge/parse_errors"] for r in rows)
    timeouts = sum(r["judge/timeouts"] for r in rows)
    assert parse_errors > 0 and timeouts > 0, (parse_errors, timeouts)
    for row in rows:  # 16 samples: a failure scores -1, a label 0 or 1
        failures = row["judge/parse_errors"] + row["judge/timeouts"]
        assert failures <= 16
        assert -failures / 16 <= row["reward/mean"] <= (16 - 2 * failures) / 16
        assert failures < 16 or row["reward/mean"] == -1.0
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    judged = [s for s in samples if s["node"] == "judge"]
    assert judged and all(isinstance(s["verdict"], str) for s in judged)


@pytest.mark.slow
def test_a_failed_verdict_under_on_error_fail_stops_the_run_in_one_line(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, err = _run(["nodes.judge.options.on_error=fail"], tmp_path / "run", capsys)
    assert code == 1, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("stopped:")]
    assert len(lines) == 1 and len(lines[0]) < 300, err[-2000:]
    assert "judge node 'judge': sample 0: " in lines[0] and "(or options.on_error: default)" in lines[0], lines[0]
    assert "Traceback" not in err and "File " not in err
