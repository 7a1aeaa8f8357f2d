"""Reward robustness and the remote reward service, over real HTTP on 127.0.0.1.

A real `hybridflow serve-reward` process serves a rule; stand-in servers in this process hang,
answer garbage, answer too much or fail once, and the client handles each as configured.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from hybridflow.data.tasks import copy_reward, reverse_reward
from hybridflow.rewards.remote import RemoteRewardError, RemoteScorer, RewardSources, aggregate
from hybridflow.rewards.rule import RewardError, score_texts_guarded
from hybridflow.spec.graph import ModelSource

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["abc=", "hello=", "xy="]
TRUTHS = ["abc", "hello", "xy"]
RESPONSES = ["abc", "hxllo", "q"]
EXPECTED = [copy_reward(p, r, g) for p, r, g in zip(PROMPTS, RESPONSES, TRUTHS)]


@pytest.fixture(scope="module")
def reward_server():
    """`hybridflow serve-reward hybridflow.data.tasks:copy_reward` on a free loopback port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridflow.cli.main", "serve-reward", "hybridflow.data.tasks:copy_reward",
         "--port", "0", "--max-request-bytes", "4096"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    assert "on http://127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
    yield line.strip().split(" on ")[-1]
    proc.terminate()
    proc.wait(timeout=10)


def stand_in_server(behaviour):
    """A loopback HTTP server whose POST handler is ``behaviour(handler, body)``."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            behaviour(self, body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def reply(handler, status: int, body: bytes) -> None:
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


# -- the real server --------------------------------------------------------------------------


def test_serve_reward_scores_like_the_local_rule(reward_server):
    with urllib.request.urlopen(reward_server + "/health", timeout=10) as r:
        assert json.loads(r.read()) == {"ok": True}
    scorer = RemoteScorer(reward_server, timeout_s=10)
    assert scorer.score(PROMPTS, RESPONSES, TRUTHS) == pytest.approx(EXPECTED, abs=1e-7)
    assert scorer.num_retries == 0


def test_client_splits_a_batch_over_its_request_bound(reward_server):
    many = 50
    scorer = RemoteScorer(reward_server, timeout_s=10, max_request_bytes=600)
    got = scorer.score(PROMPTS * many, RESPONSES * many, TRUTHS * many)
    assert got == pytest.approx(EXPECTED * many, abs=1e-7)


def test_server_refuses_a_body_over_its_bound_and_client_does_not_retry(reward_server):
    big = ["x" * 5000]
    scorer = RemoteScorer(reward_server, timeout_s=10, retries=3, backoff_s=1.0)
    started = time.monotonic()
    with pytest.raises(RemoteRewardError, match="HTTP 413"):
        scorer.score(big, big, big)
    assert scorer.num_retries == 0 and time.monotonic() - started < 1.0


def test_server_rejects_malformed_requests(reward_server):
    request = urllib.request.Request(reward_server + "/score", data=b'{"prompts": [1]}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 400
    assert "list of strings" in json.loads(info.value.read())["error"]


# -- servers that misbehave -------------------------------------------------------------------


def test_hanging_server_times_out_retries_with_backoff_then_fails():
    server, url = stand_in_server(lambda h, body: time.sleep(3))
    try:
        scorer = RemoteScorer(url, timeout_s=0.3, retries=2, backoff_s=0.1)
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match="failed after 3 attempts .*timed out"):
            scorer.score(PROMPTS, RESPONSES, TRUTHS)
        elapsed = time.monotonic() - started
        assert scorer.num_retries == 2
        assert 3 * 0.3 + 0.1 + 0.2 <= elapsed < 2.5  # three timeouts plus backoffs 0.1 and 0.2
    finally:
        server.shutdown()


@pytest.mark.parametrize("garbage", [
    b"<html>not json</html>",
    b'{"scores": [1.0]}',  # wrong length
    b'{"scores": [1.0, "a", 2.0]}',
    b'{"scores": [1.0, NaN, 2.0]}',
    b'{"result": 1}',
    b'{"scores": [' + b"0.5, " * 400 + b"0.5]}",  # over max_response_bytes
])
def test_garbage_answers_are_rejected(garbage):
    server, url = stand_in_server(lambda h, body: reply(h, 200, garbage))
    try:
        scorer = RemoteScorer(url, timeout_s=5, retries=1, backoff_s=0.0, max_response_bytes=1024)
        with pytest.raises(RemoteRewardError, match="failed after 2 attempts"):
            scorer.score(PROMPTS, RESPONSES, TRUTHS)
    finally:
        server.shutdown()


def test_a_failed_attempt_is_retried_and_then_succeeds():
    calls = []

    def flaky(handler, body):
        calls.append(body)
        if len(calls) == 1:
            reply(handler, 503, b'{"error": "busy"}')
        else:
            reply(handler, 200, json.dumps({"scores": [0.25] * len(json.loads(body)["prompts"])}).encode())

    server, url = stand_in_server(flaky)
    try:
        scorer = RemoteScorer(url, timeout_s=5, retries=2, backoff_s=0.01)
        assert scorer.score(PROMPTS, RESPONSES, TRUTHS) == [0.25] * 3
        assert scorer.num_retries == 1 and len(calls) == 2
    finally:
        server.shutdown()


def _remote_source(components, aggregate="weighted_sum", **limits):
    return ModelSource(remote={"components": components, "aggregate": aggregate, **limits})


def test_failed_source_fails_or_gets_default_reward_as_configured():
    server, url = stand_in_server(lambda h, body: reply(h, 200, b"garbage"))
    try:
        sources = RewardSources(_remote_source(
            [{"name": "bad", "url": url}, {"name": "copy", "rule": "hybridflow.data.tasks:copy_reward"}],
            retries=0,
        ))
        with pytest.raises(RewardError, match="reward bad: .*not {'scores'"):
            sources.score(PROMPTS, RESPONSES, TRUTHS, on_error="fail", default_reward=0.0, timeout_s=None)
        result = sources.score(PROMPTS, RESPONSES, TRUTHS, on_error="default", default_reward=-1.0, timeout_s=None)
        assert result.num_errors == 3
        assert result.components["bad"].tolist() == [-1.0] * 3
        assert result.scores.tolist() == pytest.approx([e - 1.0 for e in EXPECTED])
    finally:
        server.shutdown()


# -- aggregation ------------------------------------------------------------------------------


def test_aggregate_modes_on_hand_values():
    parts = {"a": torch.tensor([1.0, 0.0, 0.5]), "b": torch.tensor([0.0, 2.0, 0.5])}
    weights = {"a": 2.0, "b": -1.0}
    assert aggregate(parts, weights, "weighted_sum").tolist() == [2.0, -2.0, 0.5]
    assert aggregate(parts, weights, "mean").tolist() == [0.5, 1.0, 0.5]
    assert aggregate(parts, weights, "min").tolist() == [0.0, 0.0, 0.5]
    assert aggregate(parts, weights, "max").tolist() == [1.0, 2.0, 0.5]


def test_server_and_rule_components_aggregate_and_are_kept(reward_server):
    sources = RewardSources(_remote_source(
        [{"name": "remote_copy", "url": reward_server, "weight": 0.5},
         {"name": "reverse", "rule": "hybridflow.data.tasks:reverse_reward", "weight": 2.0}],
    ))
    result = sources.score(PROMPTS, RESPONSES, TRUTHS, on_error="fail", default_reward=0.0, timeout_s=None)
    reverse = [reverse_reward(p, r, g) for p, r, g in zip(PROMPTS, RESPONSES, TRUTHS)]
    assert result.components["remote_copy"].tolist() == pytest.approx(EXPECTED)
    assert result.components["reverse"].tolist() == pytest.approx(reverse)
    assert result.scores.tolist() == pytest.approx([0.5 * e + 2.0 * r for e, r in zip(EXPECTED, reverse)])
    assert result.num_errors == 0


# -- rule robustness --------------------------------------------------------------------------


def _raises_on_x(prompt, response, truth):
    if "x" in response:
        raise ZeroDivisionError("boom")
    return 1.0


def _slow_on_x(prompt, response, truth):
    if "x" in response:
        while True:  # a rule stuck in a pure-Python loop
            pass
    return 1.0


@pytest.mark.parametrize("rule, what", [(_raises_on_x, "ZeroDivisionError: boom"),
                                        (_slow_on_x, "took longer than timeout_s=0.2 s")])
def test_rule_that_raises_or_hangs_fails_or_defaults(rule, what):
    with pytest.raises(RewardError, match=f"sample 1.*{what}" if "boom" in what else f"sample 1 {what}"):
        score_texts_guarded(rule, PROMPTS, RESPONSES, TRUTHS, on_error="fail", timeout_s=0.2)
    scores, num_errors = score_texts_guarded(
        rule, PROMPTS, RESPONSES, TRUTHS, on_error="default", default_reward=-0.5, timeout_s=0.2
    )
    assert scores.tolist() == [1.0, -0.5, 1.0] and num_errors == 1


def test_rule_timeout_off_the_main_thread():
    """Outside the main thread (no SIGALRM) the limit still holds; the call is abandoned."""
    out = {}
    slow = lambda p, r, g: time.sleep(2.0) or 1.0 if "x" in r else 1.0  # noqa: E731
    thread = threading.Thread(target=lambda: out.update(result=score_texts_guarded(
        slow, PROMPTS, RESPONSES, TRUTHS, on_error="default", default_reward=0.0, timeout_s=0.2)))
    started = time.monotonic()
    thread.start()
    thread.join()
    assert time.monotonic() - started < 1.5
    assert out["result"][0].tolist() == [1.0, 0.0, 1.0] and out["result"][1] == 1


def test_non_number_and_nan_rule_results_are_errors():
    weird = lambda p, r, g: {"abc": float("nan"), "hxllo": "1.0"}.get(r, 1.0)  # noqa: E731
    scores, num_errors = score_texts_guarded(weird, PROMPTS, RESPONSES, TRUTHS, on_error="default")
    assert scores.tolist() == [0.0, 0.0, 1.0] and num_errors == 2


# -- through a real run -----------------------------------------------------------------------


@pytest.mark.slow
def test_grpo_run_with_remote_and_rule_rewards(ray_session, reward_server, tmp_path):
    """Two iterations where the reward is the mean of a serve-reward server (copy) and a hanging
    server (default reward 0, counted); per-component scores reach the metrics."""
    from hybridflow.controller.trainer import Trainer
    from hybridflow.graph.dag import load_graph

    hang, hang_url = stand_in_server(lambda h, body: time.sleep(2))
    try:
        source = {"remote": {"components": [{"name": "copy", "url": reward_server},
                                            {"name": "hang", "url": hang_url}],
                             "aggregate": "mean", "timeout_s": 0.2, "retries": 1, "backoff_s": 0.05}}
        graph = load_graph(ROOT / "graphs" / "grpo.yaml", [
            "trainer.iterations=2", "trainer.progress=false", "trainer.save_final=false",
            "trainer.val_interval=0", "data.prompts_per_iteration=4", "models.actor.rollout.n=4",
            f"models.reward.source={json.dumps(source)}",
            # the ending rule off: reward/mean is then exactly the components' aggregate
            "nodes.reward.options={on_error: default, default_reward: 0.0, unfinished: keep}",
        ])
        summary = Trainer(graph, run_dir=str(tmp_path / "run")).fit()
    finally:
        hang.shutdown()
    assert summary["iterations"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["reward/hang/mean"] == 0.0
        assert row["reward/num_errors"] == 16.0  # every sample of the hanging component
        assert row["reward/num_retries"] == 2.0  # one per rank
        assert row["reward/mean"] == pytest.approx(row["reward/copy/mean"] / 2, abs=1e-6)
    assert any(row["reward/copy/mean"] > 0 for row in rows)
