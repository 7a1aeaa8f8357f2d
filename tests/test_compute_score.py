"""verl-style compute_score: the built-in graders, float and dict results, several weighted
functions, and the process pool's per-item timeout."""

from __future__ import annotations

import os
import threading
import time

import pytest

from hybridflow.rewards.default import compute_score, final_answer, math_verify_score
from hybridflow.rewards.pool import ScorePool
from hybridflow.rewards.remote import RewardSources
from hybridflow.rewards.rule import RewardError
from hybridflow.spec.graph import ModelSource

HERE = "tests.test_compute_score"


# Scorers the pool imports by name (module-level, so a pool process finds them).
def float_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == ground_truth else 0.0


def dict_score(data_source, solution_str, ground_truth, extra_info=None):
    length = float(len(solution_str))
    return {"score": float(solution_str.strip() == ground_truth), "length": length, "note": "text is not logged"}


def uses_extra_info(data_source, solution_str, ground_truth, extra_info=None):
    return float(extra_info["bonus"]) if extra_info else -1.0


def hangs_on_x(data_source, solution_str, ground_truth, extra_info=None):
    if "x" in solution_str:
        time.sleep(3600)  # a grader stuck (in C code as much as in Python)
    return 1.0


def exits_on_x(data_source, solution_str, ground_truth, extra_info=None):
    if "x" in solution_str:
        os._exit(3)  # the process dies under the grader
    return 1.0


def math_verify_in_thread(data_source, solution_str, ground_truth, extra_info=None):
    """math-verify called from a non-main thread of the pool process: its signal.alarm timeout
    cannot work there, so this is what a Ray worker thread would see."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(v=math_verify_score(solution_str, ground_truth)))
    thread.start()
    thread.join()
    return out.get("v", -1.0)


def test_builtin_dispatch_on_data_source():
    # openai/gsm8k: the strict "#### N" rule, as verl's default.
    assert compute_score("openai/gsm8k", "so 3 + 4 = 7\n#### 7", "7") == 1.0
    assert compute_score("openai/gsm8k", "#### 1,234", "1234") == 1.0
    assert compute_score("openai/gsm8k", "the answer is 7", "7") == 0.0
    # math sets: math-verify, equivalent forms.
    assert compute_score("lighteval/MATH", r"so $\boxed{\frac{1}{2}}$", r"\frac{1}{2}") == 1.0
    assert compute_score("HuggingFaceH4/MATH-500", r"$\boxed{0.5}$", r"\frac{1}{2}") == 1.0
    assert compute_score("lighteval/MATH", r"$\boxed{3}$", r"\frac{1}{2}") == 0.0
    # the generated task: the final number, whatever the wording.
    assert compute_score("hybridflow/arith_words", "12 + 7 = 19", "19") == 1.0
    assert compute_score("hybridflow/arith_words", "19 apples. Then 3 more are 22.", "19") == 0.0
    assert compute_score("hybridflow/arith_words", "#### 19 (checked: 20 - 1)", "19") == 1.0
    assert compute_score("hybridflow/arith_words", r"\boxed{19} since 18 + 1", "19") == 1.0
    assert compute_score("hybridflow/arith_words", "The answer is 19. I used 4 steps.", "19") == 1.0
    assert compute_score("hybridflow/arith_words", "no idea", "19") == 0.0
    # unknown data sources: numeric truths by the final answer, others by math-verify.
    assert compute_score("my/own", "it is $1,000.", "1000") == 1.0
    assert compute_score("my/own", r"$x = \boxed{2y}$", "2y") == 1.0


def test_final_answer_preference():
    assert final_answer("5 then #### 6 then 7") == "6"
    assert final_answer("no number") is None
    assert final_answer("-3.5 and 4") == "4"


def _sources(spec, **kw):
    return RewardSources(ModelSource(compute_score=spec, **kw))


RESPONSES = ["1", "2", "x"]
TRUTHS = ["1", "3", "x"]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_compute_score_float_and_dict(num_workers):
    common = dict(on_error="fail", default_reward=0.0, timeout_s=None, num_workers=num_workers)
    sources = _sources(f"{HERE}:float_score")
    try:
        result = sources.score(["p"] * 3, RESPONSES, TRUTHS, **common)
        assert result.scores.tolist() == [1.0, 0.0, 1.0] and result.extras == {}
    finally:
        sources.close()
    sources = _sources(f"{HERE}:dict_score")
    try:
        result = sources.score(["p"] * 3, RESPONSES, TRUTHS, **common)
        assert result.scores.tolist() == [1.0, 0.0, 1.0]
        assert result.extras["length"].tolist() == [1.0, 1.0, 1.0]  # other numeric keys are logged
        assert set(result.extras) == {"length"}
    finally:
        sources.close()


def test_extra_info_and_data_source_reach_the_function():
    sources = _sources(f"{HERE}:uses_extra_info")
    try:
        result = sources.score(["p"] * 2, ["a", "b"], ["", ""], on_error="fail", default_reward=0.0,
                               timeout_s=None, num_workers=1, data_sources=["d", "d"],
                               extra_infos=[{"bonus": 0.25}, None])
        assert result.scores.tolist() == [0.25, -1.0]
    finally:
        sources.close()


def test_several_weighted_functions_each_logged():
    sources = _sources([
        {"function": f"{HERE}:float_score", "weight": 2.0},
        {"function": f"{HERE}:dict_score", "weight": -0.5, "name": "second"},
    ])
    try:
        result = sources.score(["p"] * 3, RESPONSES, TRUTHS, on_error="fail", default_reward=0.0,
                               timeout_s=None, num_workers=1)
        assert result.components["float_score"].tolist() == [1.0, 0.0, 1.0]
        assert result.components["second"].tolist() == [1.0, 0.0, 1.0]
        assert result.scores.tolist() == [1.5, 0.0, 1.5]
        assert result.extras["second/length"].tolist() == [1.0, 1.0, 1.0]
    finally:
        sources.close()


def test_pool_timeout_stops_a_hung_call_and_finds_it():
    sources = _sources(f"{HERE}:hangs_on_x")
    try:
        started = time.perf_counter()
        result = sources.score(["p"] * 6, ["a", "b", "x", "c", "d", "e"], [""] * 6, on_error="default",
                               default_reward=-1.0, timeout_s=1.0, num_workers=2)
        assert result.scores.tolist() == [1.0, 1.0, -1.0, 1.0, 1.0, 1.0]
        assert result.num_errors == 1
        assert time.perf_counter() - started < 600  # killed: the call itself would sleep an hour
        with pytest.raises(RewardError, match=r"sample 0 took longer than timeout_s=1 s"):
            sources.score(["p"], ["x"], [""], on_error="fail", default_reward=0.0, timeout_s=1.0, num_workers=2)
        # The pool still works after killing its processes.
        again = sources.score(["p"] * 2, ["a", "b"], [""] * 2, on_error="fail", default_reward=0.0,
                              timeout_s=1.0, num_workers=2)
        assert again.scores.tolist() == [1.0, 1.0]
    finally:
        sources.close()


def test_pool_survives_a_dying_process():
    sources = _sources(f"{HERE}:exits_on_x")
    try:
        result = sources.score(["p"] * 3, ["a", "x", "b"], [""] * 3, on_error="default",
                               default_reward=0.0, timeout_s=5.0, num_workers=1)
        assert result.scores.tolist() == [1.0, 0.0, 1.0] and result.num_errors == 1
    finally:
        sources.close()


def test_math_verify_works_in_the_pool_not_in_a_thread():
    """The reason for the pool: math-verify in a process's main thread grades; off it, its
    signal-based timeout fails and the call gives nothing."""
    pool = ScorePool(1)
    try:
        truth = r"\frac{1}{2}"
        main = pool.call("hybridflow.rewards.default:compute_score", [("lighteval/MATH", r"$\boxed{0.5}$", truth, None)], 10)
        assert main == [("ok", 1.0)]
        thread = pool.call(f"{HERE}:math_verify_in_thread", [("lighteval/MATH", r"$\boxed{0.5}$", truth, None)], 10)
        assert thread[0][0] == "ok" and thread[0][1] != 1.0
    finally:
        pool.close()


def test_default_compute_score_in_a_graph_source():
    sources = _sources("default")
    try:
        result = sources.score(["p"] * 2, ["#### 5", "5"], ["5", "5"], on_error="fail", default_reward=0.0,
                               timeout_s=5.0, num_workers=1, data_sources=["openai/gsm8k", "openai/gsm8k"])
        assert result.scores.tolist() == [1.0, 0.0]
    finally:
        sources.close()
