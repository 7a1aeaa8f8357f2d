"""The sandbox (hybridflow/envs/sandbox.py): each escape attempt is stopped, comes back as an
error result, and the next call still works."""

from __future__ import annotations

import os
import time

import pytest

from hybridflow.envs.sandbox import Sandbox, SandboxConfig

# The wall limit leaves room for a loaded machine: a sandbox's cold start (its interpreter) took
# over 3 s on 2 vCPUs running a SmolLM2 run beside the tests, and the plain run then timed out.
LIMITS = SandboxConfig(cpu_seconds=1, wall_timeout_s=10.0, max_processes=8, max_output_bytes=1000)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS)


def _then_still_works(sandbox: Sandbox) -> None:
    result = sandbox.run("print(6 * 7)")
    assert result.ok and result.stdout.strip() == "42", result


def test_runs_code_in_its_own_writable_dir(sandbox):
    result = sandbox.run("open('f.txt', 'w').write('hi'); import os; print(open('f.txt').read(), os.getcwd())")
    assert result.ok, result
    text, cwd = result.stdout.split()
    assert text == "hi" and os.path.basename(cwd) == "work"
    assert not os.path.exists(cwd), "the working directory is removed after the call"


def test_cannot_read_files_outside_the_working_dir(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    for path in (str(secret), "/etc/passwd", os.path.expanduser("~/.bashrc")):
        result = sandbox.run(f"print(open({path!r}).read())")
        assert "top secret" not in result.stdout and "root:" not in result.stdout
        assert not result.ok and "Permission" in result.error(), (path, result)
    result = sandbox.run(f"open({str(tmp_path / 'planted.txt')!r}, 'w').write('x')")
    assert not result.ok and not (tmp_path / "planted.txt").exists()
    _then_still_works(sandbox)


def test_cannot_open_a_network_connection(sandbox):
    code = "import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('1.1.1.1', 53))\nprint('connected')"
    result = sandbox.run(code)
    assert "connected" not in result.stdout
    assert not result.ok and "unreachable" in result.error(), result
    _then_still_works(sandbox)


def test_cannot_connect_to_a_host_unix_socket(sandbox):
    """A world-writable socket file on the host: Landlock does not cover connect() to it, the
    seccomp filter refuses the AF_UNIX socket itself (abstract names included)."""
    import socket
    import tempfile
    import threading

    folder = tempfile.mkdtemp(dir="/tmp")  # not under pytest's private tmp: reachable by anyone
    os.chmod(folder, 0o777)
    path = os.path.join(folder, "host.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(1)
    server.settimeout(5)
    heard = []

    def serve():
        try:
            conn, _ = server.accept()
            heard.append(conn.recv(4))
            conn.sendall(b"pong")
        except OSError:
            pass

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        code = f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})\ns.sendall(b'ping')\nprint(s.recv(4))"
        result = sandbox.run(code)
        abstract = sandbox.run("import socket\nsocket.socket(socket.AF_UNIX).bind('\\0hybridflow')")
    finally:
        server.close()
        thread.join()
        os.unlink(path)
        os.rmdir(folder)
    assert heard == [] and "pong" not in result.stdout
    assert result.error() == "PermissionError: [Errno 1] Operation not permitted", result
    assert abstract.error() == "PermissionError: [Errno 1] Operation not permitted", abstract
    assert sandbox.run("import socket\na, b = socket.socketpair()\na.send(b'x')\nprint(b.recv(1))").ok
    _then_still_works(sandbox)


def test_all_files_together_are_capped():
    """RLIMIT_FSIZE caps each file; 200 files of 1 MB stop at max_total_file_bytes, reported
    like the per-file cap (the OSError the write got)."""
    sandbox = Sandbox(LIMITS.model_copy(update={"max_total_file_bytes": 4 * 2**20}))
    result = sandbox.run("for i in range(200):\n    open('f%d' % i, 'wb').write(b'x' * 2**20)\nprint('wrote all')")
    assert "wrote all" not in result.stdout
    assert not result.ok and result.error() == "OSError: [Errno 28] No space left on device", result
    _then_still_works(sandbox)


def test_process_count_is_capped(sandbox):
    # Counts how many children it can hold at once: at most max_processes (launcher included).
    code = (
        "import os, time\nn = 0\nfor _ in range(100):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5); os._exit(0)\n"
        "    n += 1\nprint(n)"
    )
    result = sandbox.run(code)
    assert result.stdout.strip().isdigit(), result
    assert int(result.stdout) < LIMITS.max_processes
    _then_still_works(sandbox)


def test_fork_bomb_is_stopped_and_cleaned_up(sandbox):
    start = time.monotonic()
    result = sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert not result.ok and time.monotonic() - start < LIMITS.wall_timeout_s + 3
    _then_still_works(sandbox)


def test_allocating_10_gb_fails(sandbox):
    result = sandbox.run("x = bytearray(10 * 2**30)\nprint('allocated')")
    assert "allocated" not in result.stdout and result.error() == "MemoryError", result
    _then_still_works(sandbox)


def test_infinite_loop_hits_the_cpu_limit(sandbox):
    # A generous wall timeout: on a loaded machine one CPU second takes several wall seconds,
    # and it is the CPU limit that must stop the loop.
    patient = Sandbox(LIMITS.model_copy(update={"wall_timeout_s": 30.0}))
    result = patient.run("while True:\n    pass")
    assert not result.ok and not result.timed_out and "CPU" in result.error(), result
    _then_still_works(sandbox)


def test_sleeping_forever_hits_the_wall_timeout(sandbox):
    result = sandbox.run("import time\ntime.sleep(60)")
    assert result.timed_out and result.error().startswith("timeout"), result
    _then_still_works(sandbox)


def test_printing_1_gb_is_cut(sandbox):
    start = time.monotonic()
    result = sandbox.run("import sys\nfor _ in range(2**14):\n    sys.stdout.write('x' * 2**16)")
    assert result.truncated and len(result.stdout) == LIMITS.max_output_bytes
    assert not result.ok and "File too large" in result.error(), result
    assert time.monotonic() - start < 5
    _then_still_works(sandbox)


def test_crash_is_an_error_not_an_exception(sandbox):
    result = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert result.exit_code == -11 and "SIGSEGV" in result.error()
    assert sandbox.run("raise ValueError('boom')").error() == "ValueError: boom"
