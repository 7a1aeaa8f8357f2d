"""Rewards cannot hang or derail a run (issue 24, defects 6-8): a rule stuck in C code is killed
within its timeout, a rule that raises or returns a non-number or a value that is not finite in
float32 (1e308) is an error, handled by ``on_error`` or stopping the run with one short line."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.rewards.pool import ScorePool
from hybridflow.data.echo import shorten
from hybridflow.rewards.rule import RewardError, score_items
from hybridflow.spec.graph import DEFAULT_SCORE_TIMEOUT_S, ScoreOptions

ROOT = Path(__file__).resolve().parent.parent
HERE = "tests.test_reward_reliability"


# Rules the pool and the Ray workers import by name (module level).
def stuck_in_c(prompt, response, truth):
    return float(sum(range(10**13)))  # one C call: no signal handler runs until it returns


def too_big_for_float32(prompt, response, truth):
    return 1e308  # a finite float, inf in the batch's float32


def raises_with_data(prompt, response, truth):
    raise ValueError("cannot grade " + prompt * 1_000_000)


def returns_text(prompt, response, truth):
    return "high"


def copy_or_stuck(prompt, response, truth):
    return stuck_in_c(prompt, response, truth) if response == "x" else 1.0


def test_a_score_process_imports_its_rule_without_torch():
    """A pool process imports only its scorer's module: the built-in rules (and the package
    around them) load no torch, transformers or Ray, which cost ~6 s of CPU per reward rank."""
    probe = ("import sys; from hybridflow.data.tasks import copy_reward; import hybridflow.rewards.pool; "
             "print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_score_options_have_a_default_timeout():
    assert ScoreOptions().timeout_s == DEFAULT_SCORE_TIMEOUT_S == 30.0


def test_a_call_stuck_in_c_is_stopped_within_timeout_plus_5s_and_its_process_replaced():
    pool = ScorePool(1, preload=[f"{HERE}:copy_or_stuck"])
    try:
        pool.call(f"{HERE}:copy_or_stuck", [("p", "a", "")], 5.0)  # started, scorer imported
        started = time.perf_counter()
        outcomes = pool.call(f"{HERE}:copy_or_stuck", [("p", "x", "")], 2.0)
        assert outcomes == [("timeout", "")]
        assert time.perf_counter() - started < 2.0 + 5.0
        # The killed process was replaced: the pool scores again.
        assert pool.call(f"{HERE}:copy_or_stuck", [("p", "a", ""), ("p", "b", "")], 5.0) == [("ok", 1.0)] * 2
    finally:
        pool.close()


STUCK = "tests.stuck_rules"


def test_a_chunk_finds_its_one_stuck_call_in_timeout_s_not_timeout_s_per_item():
    """Eight items in one chunk, the fourth stuck in C: the watchdog ends that call after
    timeout_s, the others are scored (the ones before it again), one pass, no item-by-item."""
    pool = ScorePool(1, preload=[f"{STUCK}:stuck_on_x"], chunks_per_worker=1)
    try:
        pool.call(f"{STUCK}:stuck_on_x", [("p", "a", "")], 5.0)
        items = [("p", "x" if i == 3 else "a", "") for i in range(8)]
        started = time.perf_counter()
        outcomes = pool.call(f"{STUCK}:stuck_on_x", items, 2.0)
        assert outcomes == [("ok", 1.0)] * 3 + [("timeout", "")] + [("ok", 1.0)] * 4
        assert time.perf_counter() - started < 2.0 + 5.0
    finally:
        pool.close()


@pytest.mark.parametrize("options, message, bound_s", [
    ({"first_timeout_stops": True}, r"^sample \d took longer than timeout_s=1 s$", 1.0),
    ({"max_timeout_frac": 0.0625}, r"^2 of the batch's 16 calls took longer than timeout_s=1 s, more than max_timeout_frac=0.0625$", 2.0),
    ({"batch_timeout_s": 2.5, "max_timeout_frac": 1.0}, r"^the batch's 16 calls took longer than batch_timeout_s=2.5 s", 2.5),
], ids=["first_timeout", "timeout_share", "batch_bound"])
def test_a_batch_stuck_on_every_call_stops_early(options, message, bound_s):
    """Every call stuck in C, timeout 1 s, 16 items on one process: without a stop this takes
    over 16 s (it took 16 x timeout_s x 2 before the watchdog); each stop comes near its bound
    (the slack is for replacing a process on a loaded machine)."""
    from hybridflow.rewards.pool import BatchStopped

    pool = ScorePool(1, preload=[f"{STUCK}:stuck_on_x"])
    try:
        pool.call(f"{STUCK}:stuck_on_x", [("p", "a", "")], 5.0)  # started, rule imported
        started = time.perf_counter()
        with pytest.raises(BatchStopped, match=message):
            pool.call(f"{STUCK}:stuck_on_x", [("p", "x", "")] * 16, 1.0, **options)
        assert time.perf_counter() - started < bound_s + 6.0
    finally:
        pool.close()


def test_a_stuck_scoring_process_dies_with_the_process_that_owns_its_pool(tmp_path):
    """kill -9 of the process holding a ScorePool whose call is stuck in C: the scoring
    process must not live on reparented to init, burning a core (PR_SET_PDEATHSIG)."""
    import os
    import signal
    import uuid

    from test_run_cleanup import assert_all_gone, kill_tagged

    mark = tmp_path / "call.mark"
    tag = f"HYBRIDFLOW_TEST_TAG={uuid.uuid4().hex}"
    owner = (f"from hybridflow.rewards.pool import ScorePool\n"
             f"ScorePool(1, preload=['{STUCK}:stuck_after_a_mark']).call('{STUCK}:stuck_after_a_mark', "
             f"[('p', 'x', {str(mark)!r})], 600.0)")
    env = {**os.environ, "HYBRIDFLOW_TEST_TAG": tag.partition("=")[2], "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", owner], cwd=ROOT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not mark.exists():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        assert_all_gone(tag, within_s=10)
    finally:
        kill_tagged(tag)


def test_1e308_is_an_error_not_an_inf_reward():
    items = [("p", "r", ""), ("p", "r", "")]
    with pytest.raises(RewardError, match=r"sample 0: ValueError: returned 1e\+308, not finite in float32"):
        score_items(too_big_for_float32, items, on_error="fail", name="big")
    scores, num_errors, _ = score_items(too_big_for_float32, items, on_error="default", default_reward=-1.0)
    assert scores.tolist() == [-1.0, -1.0] and num_errors == 2
    # Within float32's range a large score is kept.
    scores, num_errors, _ = score_items(lambda *a: 3e38, items[:1])
    assert math.isfinite(float(scores[0])) and num_errors == 0


@pytest.mark.parametrize("rule, message", [
    (raises_with_data, r"sample 0: ValueError: cannot grade p=p=p=.*\(\d+ more characters\)"),
    (returns_text, r"sample 0: TypeError: returned str 'high', expected a number"),
])
def test_a_failing_rule_is_one_short_line(rule, message):
    with pytest.raises(RewardError, match=message) as info:
        score_items(rule, [("p=", "r", "")], on_error="fail", name="r")
    text = str(info.value)
    assert "\n" not in text and len(text) < 300


def test_shorten_cuts_and_flattens():
    assert shorten("a\nb") == "a b"
    assert shorten("x" * 150, 100) == "x" * 100 + "... (50 more characters)"


def _run(overrides: list[str], run_dir: Path, capsys) -> tuple[int, str]:
    from hybridflow.cli.main import main

    code = main(["run", "tests/bad_inputs/base.yaml", "trainer.iterations=1", "trainer.save_final=false",
                 *overrides, "--run-dir", str(run_dir)])
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_a_rule_that_raises_stops_the_run_with_one_line(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, err = _run([f"models.reward.source.rule={HERE}:raises_with_data"], tmp_path / "run", capsys)
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("stopped:")]
    assert len(lines) == 1 and len(lines[0]) < 300, err[-2000:]
    assert "reward tests.test_reward_reliability:raises_with_data: sample 0: ValueError: cannot grade" in lines[0]
    assert "Traceback" not in err and "Unhandled error" not in err and "File " not in err


@pytest.mark.slow
def test_1e308_with_on_error_default_is_counted_and_the_run_goes_on(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, err = _run([f"models.reward.source.rule={HERE}:too_big_for_float32",
                      "nodes.reward.options={on_error: default, default_reward: 0.5, unfinished: keep}"],
                     tmp_path / "run", capsys)
    assert code == 0, err[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1  # the iteration ran to its end: update, metrics
    assert rows[0]["reward/num_errors"] == 4.0  # 2 prompts x n=2, every one an error
    assert rows[0]["reward/mean"] == 0.5
    assert rows[0]["guard/skipped_updates"] == 0  # the update ran on finite advantages


@pytest.mark.slow
@pytest.mark.parametrize("options, stopped, bound_s", [
    ("{timeout_s: 2}", "sample \\d+ took longer than timeout_s=2 s", 2.0 + 10.0),
    ("{timeout_s: 2, on_error: default, batch_timeout_s: 5, max_timeout_frac: 1.0}",
     "the batch's \\d+ calls took longer than batch_timeout_s=5 s", 5.0 + 10.0),
], ids=["on_error_fail", "batch_bound"])
def test_a_rule_stuck_on_every_sample_stops_the_run_soon(options, stopped, bound_s, ray_session, tmp_path,
                                                         monkeypatch, capsys):
    """Every call stuck in C on real Ray: on_error fail stops the run within timeout_s + 10 s of
    the first call, on_error default within its batch bound + 10 s, each with one line. (Before,
    a rank's batch cost timeout_s per sample twice over: 4 samples, 16 s.)"""
    monkeypatch.chdir(ROOT)
    mark = tmp_path / "first_call.mark"
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "ground_truth": str(mark)}) + "\n" for p in ("ab=", "ba=")))
    code, err = _run([f"models.reward.source.rule={STUCK}:stuck_after_a_mark", f"data.train_files={rows}",
                      "data.num_val=0", "trainer.val_interval=0", "models.actor.rollout.n=4",
                      f"nodes.reward.options={options}"],
                     tmp_path / "run", capsys)
    ended = time.time()
    assert code == 1, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("stopped:")]
    assert len(lines) == 1 and re.search(f"reward {STUCK}:stuck_after_a_mark: {stopped}", lines[0]), err[-2000:]
    assert ended - float(mark.read_text()) < bound_s


# -- in the worker's own process (built-in rules; options.num_workers: 0) -----------------------


def _loops_on_x(prompt, response, truth):
    while response == "x":  # stuck in Python, catching what it can
        try:
            pass
        except Exception:
            pass
    return 1.0


def _sleeps_on_x(prompt, response, truth):
    if response == "x":
        time.sleep(3.0)  # blocked in C: cannot be interrupted, only left behind
    return 1.0


def _rule_threads() -> int:
    import threading

    return sum(t.name == "hybridflow-rule" for t in threading.enumerate())


def _until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize("rule", [_loops_on_x, _sleeps_on_x], ids=["python_loop", "blocked_in_c"])
def test_in_process_a_stuck_call_is_a_timeout_and_the_batch_goes_on(rule):
    """The fourth of eight calls hangs: it is a timeout after timeout_s, the others are scored
    once each, in order; a Python loop is stopped (its helper thread ends), a sleep in C is left
    to end on its own without the batch waiting for it."""
    from hybridflow.rewards.in_process import call_in_process

    calls = []
    counting = lambda p, r, g: calls.append(r) or rule(p, r, g)  # noqa: E731
    items = [("p", "x" if i == 3 else f"a{i}", "") for i in range(8)]
    started = time.monotonic()
    outcomes = call_in_process(counting, items, 0.3)
    assert time.monotonic() - started < 2.0
    assert outcomes == [("ok", 1.0)] * 3 + [("timeout", "")] + [("ok", 1.0)] * 4
    assert sorted(calls) == sorted(r for _, r, _ in items)
    assert _until(lambda: _rule_threads() == 0), "the abandoned helper never ended"


@pytest.mark.parametrize("options, message", [
    ({"first_timeout_stops": True}, r"^sample 0 took longer than timeout_s=0.2 s$"),
    ({"max_timeout_frac": 0.125}, r"^2 of the batch's 8 calls took longer than timeout_s=0.2 s, more than max_timeout_frac=0.125$"),
    ({"batch_timeout_s": 0.5, "max_timeout_frac": 1.0}, r"^the batch's 8 calls took longer than batch_timeout_s=0.5 s"),
], ids=["first_timeout", "timeout_share", "batch_bound"])
def test_in_process_a_batch_stuck_on_every_call_stops_early(options, message):
    from hybridflow.rewards.in_process import call_in_process
    from hybridflow.rewards.pool import BatchStopped

    started = time.monotonic()
    with pytest.raises(BatchStopped, match=message):
        call_in_process(_loops_on_x, [("p", "x", "")] * 8, 0.2, **options)
    assert time.monotonic() - started < 1.5
    assert _until(lambda: _rule_threads() == 0)


def test_in_process_errors_and_values_are_outcomes():
    from hybridflow.rewards.in_process import call_in_process

    def rule(p, r, g):
        return {"a": 1.0, "b": "two"}[r]

    assert call_in_process(rule, [("p", "a", ""), ("p", "c", ""), ("p", "b", "")], 1.0) == [
        ("ok", 1.0), ("error", "KeyError: 'c'"), ("ok", "two")]
    assert call_in_process(rule, [], 1.0) == []


def test_built_in_task_rules_score_in_process_and_others_in_a_scoring_process():
    """options.num_workers: null (the default) keeps hybridflow.data.tasks' rules in the worker
    (no process round trip per batch) and sends any other scorer to a killable process."""
    from hybridflow.rewards.remote import RewardSources
    from hybridflow.spec.graph import ModelSource

    assert ScoreOptions().num_workers is None
    built_in = RewardSources(ModelSource(rule="hybridflow.data.tasks:copy_reward"))
    other = RewardSources(ModelSource(rule=f"{HERE}:too_big_for_float32"))
    try:
        assert built_in._pool_of(None) is None
        assert isinstance(built_in._pool_of(2), ScorePool)
        assert isinstance(other._pool_of(None), ScorePool) and other._pool.num_workers == 1
        assert other._pool_of(0) is None
        result = built_in.score(["ab="], ["ab"], ["ab"], on_error="fail", default_reward=0.0,
                                timeout_s=1.0, num_workers=None)
        assert result.scores.tolist() == [1.0]
    finally:
        built_in.close()
        other.close()
