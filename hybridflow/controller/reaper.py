"""No process of a run outlives it, however the controller ends (``kill -9`` included).

A controller that starts its own local Ray marks its environment with ``HYBRIDFLOW_RUN_ID``
first, so every process the run starts inherits the mark: Ray's GCS, raylet and agents, the
workers, and the workers' scoring processes (even after they are reparented to init). A small
reaper process, in a session of its own, holds the read end of a pipe only the controller
writes to; when the controller is gone for any reason the pipe reads EOF, and the reaper kills
every process that carries the run's mark. Ray's own fate-sharing left its dashboard and
runtime-env agents running for minutes after a ``kill -9``, and a scoring process stuck in C
kept burning a core, reparented to init.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

MARK = "HYBRIDFLOW_RUN_ID"

_REAPER = r"""
import os, signal, sys, time
mark = sys.argv[1].encode()
sys.stdin.buffer.read()  # returns at EOF: the controller exited or was killed
for _ in range(50):  # processes may start while we look; look again until none is left
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if mark in environ:
            found.append(int(name))
    if not found:
        break
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.2)
"""

_reaper: subprocess.Popen | None = None


def mark_run() -> None:
    """Start this run's reaper and mark the environment every later child inherits. Call it
    before starting a local Ray; once per process (a no-op after), and where /proc is missing
    (not Linux). A mark inherited from a parent's run is replaced: this run's processes are
    this run's reaper's to end."""
    global _reaper
    if _reaper is not None or not os.path.isdir("/proc"):
        return
    run_id = f"{MARK}={uuid.uuid4().hex}"
    # The reaper itself does not carry the mark (its environment is copied before it is set),
    # and stays alive through a Ctrl-C to the controller's process group (a session of its own).
    _reaper = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, run_id], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    os.environ[MARK] = run_id.partition("=")[2]
