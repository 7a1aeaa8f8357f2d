"""Where a worker process's own output goes.

Worker processes print what their libraries print: transformers and torch warnings, vLLM's
start-up log, gloo's lines. Ray forwards all of it to the controller's console, where it buries
the lines a user runs for (the metrics every N iterations, the summary). Unless ``hybridflow run
--verbose``, each worker instead appends it to ``RUN_DIR/workers.log``: a Ray setup hook
(``start_ray``) points the process's stdout and stderr there before any library is imported.
A worker's failure still reaches the controller as an exception and is printed there.
"""

from __future__ import annotations

import os
import sys

LOG_ENV = "HYBRIDFLOW_WORKER_LOG"
SETUP_HOOK = "hybridflow.workers.output.redirect_to_log"


def redirect_to_log() -> None:
    """Ray's ``worker_process_setup_hook``: send file descriptors 1 and 2 (so C libraries too)
    to the file named by ``$HYBRIDFLOW_WORKER_LOG``; left as they are where it cannot be opened
    (a node of a cluster that does not share the run directory)."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
