"""The rule reward behind Ray Serve (issue 24: "for rewards that outgrow one machine, the same
rule served behind Ray Serve"): `hybridflow serve-reward RULE --ray-serve --replicas 2`, a real
Serve application with 2 replicas on a local Ray, scored through hybridflow's own pooled client
and through a graph's remote reward source, with the ``serve-reward`` contract: 4xx for a bad
request, a 500 naming a rule error or a score not finite in float32, JSON-only replies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest

from hybridflow.cli.main import main
from hybridflow.data.tasks import copy_reward
from hybridflow.rewards.remote import RemoteRewardError, RemoteScorer, RewardSources
from hybridflow.rewards.rule import RewardError
from hybridflow.spec.graph import ModelSource

ROOT = Path(__file__).resolve().parent.parent
RULE = "tests.test_reward_ray_serve:copy_or_fail"


def copy_or_fail(prompt, response, truth):
    """``copy_reward``, except: "boom" raises, "big" is 1e308, "pid" is the replica's pid."""
    if response == "boom":
        raise ValueError("cannot grade boom")
    if response == "big":
        return 1e308
    if response == "pid":
        return float(os.getpid())
    return copy_reward(prompt, response, truth)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory):
    """The URL of ``hybridflow serve-reward RULE --ray-serve --replicas 2`` on a free port: a
    process with its own local Ray, as a user starts it; stopped with SIGTERM at the end, which it
    handles as Ctrl-C."""
    logs = tmp_path_factory.mktemp("serve") / "out.log"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the replicas import RULE's module
    with logs.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridflow.cli.main", "serve-reward", RULE, "--ray-serve", "--replicas", "2",
             "--replica-cpus", "0.5", "--port", str(port)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while f"2 replica(s), {url}" not in logs.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, logs.read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # as `kill` sends it: serve_on_ray's finally shuts its Ray down
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            warnings.warn(f"serve-reward --ray-serve still ran 30 s after SIGTERM:\n{logs.read_text()[-2000:]}")
        else:
            assert "interrupted" in logs.read_text() and proc.returncode == 130, logs.read_text()[-2000:]


def test_serve_runs_builder_reads_its_string_arguments():
    """``serve run hybridflow.rewards.ray_serve:build_app rule=... replicas=2`` (Serve passes
    the ``key=value`` arguments as strings)."""
    from hybridflow.rewards.ray_serve import build_app

    bound = build_app({"rule": RULE, "replicas": "2", "num_cpus": "0.5"})._bound_deployment
    assert (bound.num_replicas, bound.ray_actor_options["num_cpus"], bound.init_args) == (2, 0.5, (RULE, 1 << 20))
    with pytest.raises(ValueError, match="needs rule=MODULE:FUNCTION; unknown arguments \\['replica'\\]"):
        build_app({"rule": RULE, "replica": "2"})


@pytest.mark.slow
def test_the_pooled_client_scores_on_both_replicas(serve_url):
    scorer = RemoteScorer(serve_url, retries=0)
    try:
        assert scorer.score(["ab=", "ab=", "cd="], ["ab", "x", "cd"], ["ab", "ab", "cd"]) == [1.0, 0.0, 1.0]
        pids = {scorer.score(["p"], ["pid"], [""])[0] for _ in range(30)}
        assert len(pids) == 2  # Serve spread the requests over the 2 replica processes
        assert len(scorer._client._transport._pool.connections) == 1  # one pooled connection
    finally:
        scorer.close()


@pytest.mark.slow
def test_a_bad_request_is_a_json_4xx_and_not_retried(serve_url):
    reply = httpx.post(serve_url + "/score", content=b'{"prompts": ["a"], "responses": ')
    assert reply.status_code == 400 and reply.json() == {"error": "body is not JSON"}
    reply = httpx.post(serve_url + "/score", content=b"[" * 100 + b"]" * 100)
    assert reply.status_code == 400 and "nested 100 levels deep > 32" in reply.json()["error"]
    scorer = RemoteScorer(serve_url, retries=2)
    try:
        with pytest.raises(RemoteRewardError, match="HTTP 400.*must have the same length"):
            scorer.score(["a"], ["a", "b"], ["a"])
        assert scorer.num_retries == 0
    finally:
        scorer.close()


@pytest.mark.slow
@pytest.mark.parametrize("response, reason", [("boom", "ValueError: cannot grade boom"),
                                              ("big", "not finite in float32")])
def test_a_rule_error_is_a_500_naming_it(serve_url, response, reason):
    reply = httpx.post(serve_url + "/score",
                       json={"prompts": ["p"], "responses": [response], "ground_truths": [""]})
    assert reply.status_code == 500 and b"Infinity" not in reply.content
    assert reason in reply.json()["error"]
    scorer = RemoteScorer(serve_url, retries=1, backoff_s=0.0)
    try:
        with pytest.raises(RemoteRewardError, match=f"failed after 2 attempts.*HTTP 500.*{reason}"):
            scorer.score(["p"], [response], [""])
    finally:
        scorer.close()


@pytest.mark.slow
def test_a_graphs_remote_source_scores_against_it_unchanged(serve_url):
    sources = RewardSources(ModelSource(remote={"components": [{"name": "copy", "url": serve_url}],
                                               "retries": 0}))
    try:
        result = sources.score(["ab=", "p"], ["ab", "x"], ["ab", "q"], on_error="fail", default_reward=0.0,
                               timeout_s=None)
        assert result.scores.tolist() == [1.0, 0.0] and result.num_errors == 0
        result = sources.score(["p"], ["boom"], [""], on_error="default", default_reward=-1.0, timeout_s=None)
        assert result.scores.tolist() == [-1.0] and result.num_errors == 1
        with pytest.raises(RewardError, match="reward copy: .*HTTP 500"):
            sources.score(["p"], ["big"], [""], on_error="fail", default_reward=0.0, timeout_s=None)
    finally:
        sources.close()


def test_ray_serve_without_a_fixed_port_is_one_line(capsys):
    assert main(["serve-reward", "hybridflow.data.tasks:copy_reward", "--ray-serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "error: serve-reward: --port: --ray-serve needs a fixed port and at least one replica\n"
