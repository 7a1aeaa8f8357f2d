"""No process of a run outlives it, however the controller ends (``kill -9`` included).

A controller that starts its own local Ray starts a small reaper first, in a session of its
own, holding the read end of a pipe only the controller writes to. While the controller lives
the reaper notes every process descended from it, each second (pid and start time, so a pid
reused later is not mistaken): Ray's GCS, raylet and agents, the workers, their scoring
processes. The controller also marks its environment with ``HYBRIDFLOW_RUN_ID``, which every
later child inherits, for a process that was started and reparented between two looks (Ray's
processes rewrite their title over their environment, hence the notes too). When the
controller is gone for any reason the pipe reads EOF, and the reaper kills every process it
noted or that carries the mark. Ray's own fate-sharing left its dashboard and
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
import os, select, signal, sys, time
mark, controller = sys.argv[1].encode(), int(sys.argv[2])

def processes():
    # pid -> (parent pid, start time); the start time tells a reused pid from the one we saw
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name, "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                found[int(name)] = (int(fields[1]), fields[19])
            except (OSError, IndexError, ValueError):
                pass
    return found

def marked(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:
        return False

seen = {}  # every descendant of the controller seen while it lived: pid -> start time
while True:
    now = processes()
    children = {}
    for pid, (parent, _) in now.items():
        children.setdefault(parent, []).append(pid)
    todo = list(children.get(controller, []))
    while todo:
        pid = todo.pop()
        seen[pid] = now[pid][1]
        todo += children.get(pid, [])
    if select.select([sys.stdin], [], [], 1.0)[0] and not os.read(sys.stdin.fileno(), 1 << 16):
        break  # EOF: the controller exited or was killed
for _ in range(50):  # processes may start while we look; look again until none is left
    now = processes()
    doomed = [pid for pid, (_, started) in now.items() if pid != os.getpid()
              and (seen.get(pid) == started or marked(pid))]
    if not doomed:
        break
    for pid in doomed:
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
    _reaper = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, run_id, str(os.getpid())], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    os.environ[MARK] = run_id.partition("=")[2]
