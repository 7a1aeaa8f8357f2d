"""No process of a run is alive 60 s after its controller ended by SIGTERM, Ctrl-C or
``kill -9``: not Ray's own processes, not the workers, not a scoring process stuck in C
(hybridflow/controller/reaper.py; the scoring pool's PR_SET_PDEATHSIG is tested in
tests/test_reward_reliability.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
TAG = "HYBRIDFLOW_TEST_TAG"

def tagged(tag: str) -> list[int]:
    """Processes whose environment carries ``tag``: everything the controller started inherits
    it, whatever the process was reparented to since."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if tag.encode() in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def end(process: subprocess.Popen, how: str) -> None:
    if how == "kill -9":
        process.kill()
    elif how == "SIGTERM":
        process.terminate()
    else:  # a terminal's Ctrl-C: SIGINT to the whole foreground process group
        os.killpg(process.pid, signal.SIGINT)
    process.wait(timeout=60)


def assert_all_gone(tag: str, within_s: float) -> None:
    gone_by = time.monotonic() + within_s
    while tagged(tag) and time.monotonic() < gone_by:
        time.sleep(0.2)
    left = []
    for pid in tagged(tag):
        try:
            left.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:80].decode())
        except OSError:
            pass
    assert not left, left


def kill_tagged(tag: str) -> None:
    for pid in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# A controller in miniature: marks the run, then starts a process in a session of its own (as
# Ray starts its GCS and raylet) whose child is stuck in C. Both run without the mark in their
# environment, as Ray's agents and workers show none once they rewrite their process title
# over it: only the reaper's notes of the controller's descendants can find them.
FAKE_CONTROLLER = """
import os, signal, subprocess, sys, time
# Ctrl-C ends it as it ends a controller started from a terminal (a background job of a
# non-interactive shell, such as a test suite run with &, inherits SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
from hybridflow.controller.reaper import mark_run
mark_run()
plain = {"PATH": os.environ["PATH"]}
subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'sum(range(10**13))']); sum(range(10**13))"], start_new_session=True, env=plain)
time.sleep(2.5)  # the reaper looks each second
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["kill -9", "SIGTERM", "Ctrl-C"])
def test_the_reaper_kills_what_the_run_started_however_it_ends(how):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    controller = subprocess.Popen([sys.executable, "-c", FAKE_CONTROLLER], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, start_new_session=True)
    started = []
    try:
        assert controller.stdout.readline() == b"ready\n"
        started = [p for p in psutil.Process(controller.pid).children(recursive=True)
                   if "sum(range" in " ".join(p.cmdline())]
        assert len(started) == 2  # the child and the grandchild, both stuck in C
        end(controller, how)
        gone, alive = psutil.wait_procs(started, timeout=10)
        assert not alive, alive
    finally:
        if controller.poll() is None:
            controller.kill()
        for process in started:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass


@pytest.mark.slow
def test_no_process_outlives_a_real_run_killed_while_its_reward_is_stuck_in_c(tmp_path):
    """Real Ray (GCS, raylet, dashboard and runtime-env agents, workers) and a scoring process
    stuck in C: all gone within 60 s of a kill -9 of the controller (SIGTERM and Ctrl-C end it
    through the same reaper, tested above)."""
    mark = tmp_path / "scoring.mark"  # written when the first call (stuck in C) begins
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "ground_truth": str(mark)}) + "\n" for p in ("ab=", "ba=")))
    tag = f"{TAG}={uuid.uuid4().hex}"
    env = {**os.environ, TAG: tag.partition("=")[2], "RAY_AUTH_MODE": "disabled"}
    cmd = [sys.executable, "-m", "hybridflow.cli.main", "run", "tests/bad_inputs/base.yaml",
           "models.reward.source.rule=tests.stuck_rules:stuck_after_a_mark", f"data.train_files={rows}",
           "data.num_val=0", "trainer.val_interval=0", "nodes.reward.options={timeout_s: 600}",
           "--run-dir", str(tmp_path / "run")]
    controller = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not mark.exists():
            assert controller.poll() is None and time.monotonic() < deadline, "the run never began scoring"
            time.sleep(0.5)
        time.sleep(1.0)  # the scoring process is in its C loop
        end(controller, "kill -9")
        assert_all_gone(tag, within_s=60)
    finally:
        if controller.poll() is None:
            controller.kill()
        kill_tagged(tag)
