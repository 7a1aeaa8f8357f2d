"""Run untrusted Python in a subprocess, with limits; whatever it does comes back as a result.

What is enforced, and how (Linux; nothing here needs root):

- **Processes and network**: the code runs under ``unshare --user --map-root-user --mount --net
  --pid --fork --kill-child``: a new network namespace holds only a down loopback (no route
  anywhere: ``connect`` fails with "Network is unreachable"), and a new PID namespace whose init
  is the launcher below, so when the call ends (or is killed) every process it forked dies with
  it. A seccomp filter refuses ``socket(AF_UNIX, ...)`` and ``io_uring_setup`` (EPERM): Landlock
  does not cover ``connect`` to a socket file on the host, which would otherwise reach any
  world-writable one (``socketpair`` still works).
- **Files**: Landlock (the unprivileged Linux security module, ``landlock_restrict_self``) limits
  the process tree to reading the Python installation and the system library directories
  (``/usr``, ``/lib``, ``/lib64``, ``/bin``, ``/etc/ld.so.cache``) and to reading and writing its
  own temporary working directory (removed after the call). Reading ``/etc/passwd``, a home
  directory or another temp dir fails with ``PermissionError``.
- **Resources** (``setrlimit``, hard = soft, set before the code starts and inherited by
  everything it forks): CPU seconds (``RLIMIT_CPU``, SIGXCPU), address space (``RLIMIT_AS``: a 10
  GB allocation raises ``MemoryError``), processes (``RLIMIT_NPROC``, counted inside the new user
  namespace: a fork bomb gets ``EAGAIN``; the kernel exempts host root from this limit, so when
  started by root the sandbox runs as user ``nobody``), bytes per written file (``RLIMIT_FSIZE``: stdout and
  stderr are files too, so printing 1 GB stops at the cap with SIGXFSZ), open files, no core dumps.
  All files together: the working directory is a tmpfs of ``max_total_file_bytes`` in the call's
  own mount namespace (a write past it fails with "No space left on device").
- **Wall time**: the caller waits ``wall_timeout_s`` and then kills the whole process group.
- **Output**: stdout and stderr come back cut at ``max_output_bytes`` each.
- The interpreter (``/usr/bin/python3`` by default, readable by ``nobody``) runs isolated
  (``python -I -S``: standard library only, no ``PYTHON*`` variables) with an empty environment.

Not enforced: system-call filtering beyond the Unix-socket filter (x86_64 and aarch64; Landlock
and the namespaces cover files, network and processes). Where ``unshare`` or Landlock
is unavailable, ``Sandbox`` raises ``SandboxUnavailable`` at construction unless
``SandboxConfig.require_isolation`` is false, in which case only the rlimits, the wall timeout
and the output cut apply (``Sandbox.enforced`` says which).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class SandboxUnavailable(RuntimeError):
    """The isolation ``SandboxConfig.require_isolation`` asks for does not work on this host."""


class SandboxConfig(BaseModel):
    """Limits of one sandboxed call."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    cpu_seconds: int = Field(2, ge=1, description="CPU time (RLIMIT_CPU), seconds.")
    wall_timeout_s: float = Field(5.0, gt=0, description="Wall time before the call is killed.")
    memory_bytes: int = Field(512 * 2**20, ge=64 * 2**20, description="Address space (RLIMIT_AS).")
    max_processes: int = Field(16, ge=1, description="Processes in the sandbox (RLIMIT_NPROC).")
    max_file_bytes: int = Field(2**20, ge=1, description="Size of any file written, stdout included (RLIMIT_FSIZE).")
    max_total_file_bytes: int = Field(
        16 * 2**20, ge=2**16, description="Size of all files written in the working directory "
        "together (a tmpfs of this size; a write past it fails with 'No space left on device'). "
        "Needs the isolation (require_isolation).",
    )
    max_output_bytes: int = Field(4096, ge=1, description="stdout/stderr returned, each, cut at this many bytes.")
    python: str | None = Field(
        None,
        description="Interpreter that runs the code (stdlib only). Default: /usr/bin/python3 "
        "when it exists (readable by an unprivileged user), else this process's interpreter.",
    )
    require_isolation: bool = Field(
        True, description="Fail unless the network/PID namespaces and Landlock both work here."
    )


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int  # negative: killed by that signal
    timed_out: bool
    truncated: bool  # some output was cut at max_output_bytes

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def error(self) -> str | None:
        """One line saying what went wrong, or None."""
        if self.timed_out:
            return "timeout: wall time exceeded"
        if self.exit_code == 0:
            return None
        if self.exit_code < 0:
            name = signal.Signals(-self.exit_code).name
            reason = {"SIGXCPU": "CPU time limit", "SIGXFSZ": "output/file size limit", "SIGKILL": "killed"}
            return f"{reason.get(name, 'crashed')} ({name})"
        last = self.stderr.strip().splitlines()
        return last[-1] if last else f"exit code {self.exit_code}"


# Runs as PID 1 of the new PID namespace: applies the limits, then forks the user code and
# reports its status (a signal as 128 + signo, like a shell). Kept as a string: it executes in
# the isolated interpreter before any user code.
_LAUNCHER = r"""
import ctypes, os, resource, struct, sys
cpu, mem, nproc, fsize, total, workdir, code_path, landlock = sys.argv[1:9]
readable = sys.argv[9:]
if landlock == "1":
    libc = ctypes.CDLL(None, use_errno=True)
    # The working directory becomes a tmpfs of the total-size cap (our own mount namespace):
    # RLIMIT_FSIZE bounds each file, this bounds all of them (a write past it gets ENOSPC).
    opts = b"size=%d,nr_inodes=%d,mode=0777" % (int(total), max(64, int(total) // 4096))
    if libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", 0, opts) != 0:
        sys.exit("mount tmpfs failed: errno %d" % ctypes.get_errno())
for limit, value in ((resource.RLIMIT_AS, int(mem)), (resource.RLIMIT_NPROC, int(nproc)),
                     (resource.RLIMIT_FSIZE, int(fsize)), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_NOFILE, 64)):
    resource.setrlimit(limit, (value, value))
resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + 1))  # SIGXCPU first, SIGKILL a second later
if landlock == "1":
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, 0, 1)
    if abi < 1: sys.exit("landlock unavailable")
    ALL = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1  # every filesystem right this ABI knows
    READ = 1 | 4 | 8  # execute, read file, read dir
    attr = (ctypes.c_uint64 * 1)(ALL)
    fd = libc.syscall(444, attr, 8, 0)
    if fd < 0: sys.exit("landlock_create_ruleset failed: errno %d" % ctypes.get_errno())
    class Rule(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]
    def allow(path, rights):
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        if not os.path.isdir(path):
            rights &= 1 | 2 | 4 | (1 << 14)  # rights that apply to a file
        rule = Rule(rights, pfd)
        if libc.syscall(445, fd, 1, ctypes.byref(rule), 0) != 0:
            sys.exit("landlock_add_rule %s failed: errno %d" % (path, ctypes.get_errno()))
        os.close(pfd)
    for path in readable + [code_path]:
        allow(path, READ)
    allow(workdir, ALL)
    allow("/dev/null", 2 | 4)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(446, fd, 0) != 0:
        sys.exit("landlock_restrict_self failed: errno %d" % ctypes.get_errno())
    # Landlock does not cover connect() to a filesystem Unix socket and the network namespace
    # only hides abstract ones, so a seccomp filter refuses socket(AF_UNIX, ...) (EPERM), and
    # io_uring_setup, which could open one without that system call.
    # (arch, socket, io_uring_setup) of struct seccomp_data's arch and nr, per machine.
    known = {"x86_64": (0xC000003E, 41, 425), "aarch64": (0xC00000B7, 198, 425)}
    arch, nr_socket, nr_uring = known.get(os.uname().machine, (None, None, None))
    if arch is not None:
        ALLOW, EPERM = 0x7FFF0000, 0x00050000 | 1
        LD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06
        prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, EPERM),  # another ABI: refuse all
                (LD, 0, 0, 0), (JGE, 5, 0, 0x40000000),  # x32 system calls
                (JEQ, 4, 0, nr_uring), (JEQ, 0, 2, nr_socket),
                (LD, 0, 0, 16), (JEQ, 1, 0, 1),  # args[0] == AF_UNIX
                (RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
        filt = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *ins) for ins in prog))
        fprog = struct.pack("@HP", len(prog), ctypes.addressof(filt))  # struct sock_fprog
        if libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) != 0:
            sys.exit("seccomp filter failed: errno %d" % ctypes.get_errno())
os.chdir(workdir)
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-I", "-S", code_path])
_, status = os.waitpid(pid, 0)
sys.exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""

_UNSHARE = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork", "--kill-child"]


# The kernel exempts host root from RLIMIT_NPROC (even inside a user namespace), so a sandbox
# started by root runs as this unprivileged user instead.
NOBODY = 65534


def _interpreter(config: SandboxConfig) -> str:
    if config.python is not None:
        return config.python
    return "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def _readable_roots(python: str) -> list[str]:
    real = os.path.realpath(python)
    prefix = os.path.dirname(os.path.dirname(real))  # <prefix>/bin/python -> <prefix>
    roots = {os.path.dirname(real), prefix, "/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache"}
    if real == os.path.realpath(sys.executable):
        roots.add(sys.base_prefix)
    return sorted(roots)


@functools.cache
def _isolation_works() -> str | None:
    """None when namespaces + Landlock work here, else why not (probed once per process)."""
    if shutil.which("unshare") is None:
        return "the unshare command is missing"
    probe = Sandbox(SandboxConfig(require_isolation=False), _probe=True)
    result = probe.run("print('ok')")
    if result.stdout.strip() != "ok":
        return f"unshare/Landlock probe failed: {result.error() or result.stderr.strip()[-200:]}"
    return None


class Sandbox:
    """Runs code strings under ``config``'s limits (see the module docstring for how)."""

    def __init__(self, config: SandboxConfig | None = None, *, _probe: bool = False) -> None:
        self.config = config or SandboxConfig()
        self.isolated = True
        if not _probe:
            problem = _isolation_works()
            if problem is not None:
                if self.config.require_isolation:
                    raise SandboxUnavailable(f"sandbox: {problem} (set require_isolation: false to run with rlimits only)")
                self.isolated = False

    @property
    def enforced(self) -> list[str]:
        """What this sandbox enforces, in words (for logs and docs)."""
        base = ["rlimit cpu", "rlimit address space", "rlimit nproc", "rlimit file size", "wall timeout", "output cut"]
        isolation = ["no network (netns)", "no unix sockets (seccomp)", "pid namespace", "landlock filesystem",
                     "total file size (tmpfs)"]
        return base + (isolation if self.isolated else [])

    def run(self, code: str) -> SandboxResult:
        """Run ``code`` (a Python program) once; never raises for anything the code does."""
        cfg = self.config
        with tempfile.TemporaryDirectory(prefix="hf_sandbox_") as root:
            workdir = os.path.join(root, "work")  # the code's only writable directory
            os.mkdir(workdir)
            code_path = os.path.join(root, "main.py")  # beside it: a tmpfs is mounted on it
            with open(code_path, "w") as f:
                f.write(code)
            out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
            python = _interpreter(cfg)
            argv = [
                python, "-I", "-S", "-c", _LAUNCHER,
                str(cfg.cpu_seconds), str(cfg.memory_bytes), str(cfg.max_processes),
                str(cfg.max_file_bytes), str(cfg.max_total_file_bytes), workdir, code_path,
                "1" if self.isolated else "0",
                *_readable_roots(python),
            ]
            if self.isolated:
                argv = _UNSHARE + argv
            drop = {}
            if os.geteuid() == 0:
                drop = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
                for path in (root, workdir, code_path):
                    os.chown(path, NOBODY, NOBODY)
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=workdir,
                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True, **drop,
                )
                timed_out = False
                try:
                    code_ = proc.wait(timeout=cfg.wall_timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGKILL)
                    code_ = proc.wait()
            stdout, cut_out = _read_capped(out_path, cfg.max_output_bytes)
            stderr, cut_err = _read_capped(err_path, cfg.max_output_bytes)
        exit_code = -(code_ - 128) if code_ > 128 else code_  # the launcher's 128 + signo
        return SandboxResult(stdout, stderr, exit_code, timed_out, cut_out or cut_err)


def _read_capped(path: str, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit
