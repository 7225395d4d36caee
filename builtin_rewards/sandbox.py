"""Running untrusted Python in a sandbox (used by the code-execution reward).

On Linux every run is a fresh bubblewrap (``bwrap``) sandbox: its own user, pid, network, ipc,
uts and cgroup namespaces, no capabilities, uid 65534, a new session, a cleared environment,
read-only binds of only the interpreter, its standard library and the system libraries, a
private size-capped tmpfs as working directory, no ``/proc``, a read-only minimal ``/dev``, no
nested user namespaces, and a seccomp filter that refuses to start processes (threads work)
and a few kernel interfaces a program has no use for. Resource limits (CPU seconds, address
space, file size, open files, threads) are set by the trusted boot code
(:mod:`builtin_rewards._sandbox_boot`) before the program runs. Nothing outlives a run: at the
wall-clock timeout (or when a run is no longer needed) the sandbox's init process is killed,
which ends its pid namespace, and ``--die-with-parent`` covers the trainer dying; stdin and
outputs are memory files, so nothing of a run is left on disk.

Where bubblewrap is not usable, :func:`run_python` refuses (:class:`SandboxUnavailable`) unless
``isolation="unsafe_local"``: the older process with rlimits, Landlock and an audit hook, which
does not contain a determined attacker (docs/rewards.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Isolation = Literal["bwrap", "unsafe_local"]

_BOOT_SOURCE = Path(__file__).with_name("_sandbox_boot.py").read_text(encoding="utf-8")
_INSTALL_HINT = (
    "install bubblewrap >= 0.8 (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap), "
    "or set the reward's param `sandbox: unsafe_local` to run with the weaker isolation, which does "
    "not contain hostile code (docs/rewards.md)"
)


class SandboxUnavailable(RuntimeError):
    """No usable bubblewrap, and the weaker ``unsafe_local`` isolation was not asked for."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    timeout: float = 5.0  # wall-clock seconds, then the sandbox is killed
    cpu_seconds: int = 5
    memory_mb: int = 512  # address space of the sandbox's one process
    max_output_bytes: int = 1 << 20  # stdout, stderr, and the largest file it may write
    disk_mb: int = 64  # size of its writable tmpfs
    max_tasks: int = 64  # threads (RLIMIT_NPROC); starting processes is refused under bwrap


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did."""

    returncode: int | None  # None when killed at the timeout
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


# -- the seccomp filter -------------------------------------------------------------------------
# Syscall numbers differ by architecture; only these two get a filter (elsewhere bwrap runs
# without one, and the thread limit is all that bounds processes).
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
_ARCHES: dict[str, tuple[int, int, dict[int, int]]] = {
    # machine: (AUDIT_ARCH_*, clone, {syscall: errno}) -- fork/vfork, clone3 (ENOSYS makes glibc
    # fall back to clone, which is checked for CLONE_THREAD); SysV shm/semaphores/messages and
    # POSIX message queues (memory outside RLIMIT_AS); keyrings, ptrace, io_uring, bpf, perf,
    # userfaultfd, unshare/setns
    "x86_64": (0xC000003E, 56, {57: _EPERM, 58: _EPERM, 435: _ENOSYS, 29: _EPERM, 64: _EPERM, 68: _EPERM,
                                240: _EPERM, 248: _EPERM, 249: _EPERM, 250: _EPERM, 101: _EPERM, 425: _EPERM,
                                321: _EPERM, 298: _EPERM, 323: _EPERM, 272: _EPERM, 308: _EPERM}),
    "aarch64": (0xC00000B7, 220, {435: _ENOSYS, 194: _EPERM, 190: _EPERM, 186: _EPERM, 180: _EPERM, 217: _EPERM,
                                  218: _EPERM, 219: _EPERM, 117: _EPERM, 425: _EPERM, 280: _EPERM, 241: _EPERM,
                                  282: _EPERM, 97: _EPERM, 268: _EPERM}),
}


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The classic-BPF seccomp program for bwrap's ``--seccomp``, or None for other machines."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        return None
    arch, clone, denied = _ARCHES[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS

    def errno(code: int) -> int:
        return 0x00050000 | code  # SECCOMP_RET_ERRNO

    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]  # seccomp_data.arch, .nr
    if machine == "x86_64":
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, errno(_EPERM))]  # the x32 ABI
    for nr, code in denied.items():
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, errno(code))]
    prog += [
        (jeq, 0, 4, clone),
        (ld, 0, 0, 16),  # low half of args[0], the clone flags
        (jset, 0, 1, _CLONE_THREAD),
        (ret, 0, 0, allow),
        (ret, 0, 0, errno(_EPERM)),
        (ret, 0, 0, allow),
    ]
    return b"".join(struct.pack("=HBBI", *insn) for insn in prog)


# -- the sandbox's file system ------------------------------------------------------------------


@functools.cache
def _layout() -> tuple[str, tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(interpreter, read-only bind paths, (link, target) symlinks) -- what Python needs, no more."""
    exe = os.path.realpath(sys.executable)
    binds: list[str] = []

    def add(path: str) -> None:
        path = os.path.realpath(path)
        if os.path.exists(path) and not any(path == b or path.startswith(b + "/") for b in binds):
            binds[:] = [b for b in binds if not b.startswith(path + "/")] + [path]

    links: list[tuple[str, str]] = []
    for lib in ("/usr/lib", "/usr/lib64", "/lib", "/lib64"):
        if os.path.islink(lib):
            links.append((lib, os.readlink(lib)))
        elif os.path.isdir(lib):
            add(lib)
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    add(sysconfig.get_path("stdlib", vars=base))
    add(sysconfig.get_path("platstdlib", vars=base))
    # The interpreter's own lib directory: libpython, and the libraries its extension modules
    # link against where it does not use the system's (pyenv, conda).
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and os.path.realpath(libdir).startswith(os.path.realpath(sys.base_prefix) + "/"):
        add(libdir)
    add(exe)
    return exe, tuple(binds), tuple(links)


def _bwrap_args(bwrap: str, limits: SandboxLimits, seccomp_fd: int | None, info_fd: int) -> list[str]:
    exe, binds, links = _layout()
    args = [
        bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
        "--cap-drop", "ALL", "--uid", "65534", "--gid", "65534",
        "--clearenv", "--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
    ]  # fmt: skip
    for path in binds:
        args += ["--ro-bind", path, path]
    for link, target in links:
        args += ["--symlink", target, link]
    args += ["--dev", "/dev", "--size", str(int(limits.disk_mb) << 20), "--tmpfs", "/tmp"]
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return args + ["--info-fd", str(info_fd), "--", exe]


# -- one sandboxed process ----------------------------------------------------------------------


def _memory_file(data: bytes = b"") -> int:
    """An anonymous file (memfd; a deleted temp file where there is none), positioned at 0."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("grpo-sandbox")
    else:
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_back(fd: int, limit: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks, left = [], limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


class _Sandboxed:
    """One boot-code process, in bwrap or (``unsafe_local``) a plain subprocess; a context manager
    that always kills it and frees its files."""

    def __init__(
        self,
        mode: str,
        source: str,
        stdin: str,
        limits: SandboxLimits,
        isolation: Isolation,
        channel: tuple[int, int] | None = None,
        nonce: str = "",
    ) -> None:
        self.limits = limits
        data = source.encode("utf-8", errors="replace")
        self.fds = [_memory_file(data + stdin.encode("utf-8", errors="replace")), _memory_file(), _memory_file()]
        config = {
            "mode": mode,
            "source_bytes": len(data),
            "cpu_seconds": max(1, int(limits.cpu_seconds)),
            "memory_bytes": int(limits.memory_mb) << 20,
            "file_bytes": int(limits.max_output_bytes),
            "max_tasks": int(limits.max_tasks),
            "channel": ",".join(map(str, channel or ())),
            "nonce": nonce,
        }
        argv = [";".join(f"{k}={v}" for k, v in config.items())]
        pass_fds = list(channel or ())
        self.tmp: str | None = None  # unsafe_local's working directory on the host
        self.info_fd: int | None = None
        if isolation == "bwrap":
            bwrap = _bwrap_path()
            assert bwrap is not None
            program = seccomp_filter()
            seccomp_fd = _memory_file(program) if program is not None else None
            self.info_fd = _memory_file()  # bwrap writes the sandbox's init pid here
            self.fds.append(self.info_fd)
            pass_fds.append(self.info_fd)
            if seccomp_fd is not None:
                self.fds.append(seccomp_fd)
                pass_fds.append(seccomp_fd)
            cmd, cwd, env = _bwrap_args(bwrap, limits, seccomp_fd, self.info_fd), None, {}
        else:
            self.tmp = cwd = tempfile.mkdtemp(prefix="grpo-sandbox-")
            argv.append(cwd)  # also tells the boot code to add Landlock and the audit hook
            env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}
            cmd = [os.path.realpath(sys.executable)]
        cmd += ["-I", "-S", "-B", "-X", "utf8", "-c", _BOOT_SOURCE, *argv]
        self.start = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdin=self.fds[0],
                stdout=self.fds[1],
                stderr=self.fds[2],
                pass_fds=pass_fds,
                cwd=cwd,
                env=env,
                start_new_session=True,  # its own process group: the kill reaches everything it started
                close_fds=True,
            )
        except BaseException:
            self._free()
            raise

    def wait(self, deadline: float) -> SandboxResult:
        timed_out = False
        try:
            returncode: int | None = self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out, returncode = True, None
        self.kill()
        seconds = time.monotonic() - self.start
        limit = self.limits.max_output_bytes
        return SandboxResult(returncode, _read_back(self.fds[1], limit), _read_back(self.fds[2], limit), timed_out, seconds)

    def kill(self) -> None:
        """Kill everything the run started, and reap it."""
        if self.proc.poll() is None and self.info_fd is not None:
            # Killing the sandbox's init ends its pid namespace, and bwrap reaps it and exits;
            # killing bwrap first would leave that init to the host's init as a zombie.
            match = re.search(r'"child-pid":\s*(\d+)', _read_back(self.info_fd, 4096))
            if match:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(match.group(1)), signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=1.0)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> _Sandboxed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        self._free()

    def _free(self) -> None:
        for fd in self.fds:
            os.close(fd)
        if self.tmp is not None:
            _remove_tree(self.tmp)


def _remove_tree(path: str) -> None:
    """Best-effort removal (``unsafe_local`` only), never raising, whatever the program left:
    deep trees (``shutil.rmtree`` recurses), directories without permissions, immutable files."""
    fixes = ([], ["chmod", "-R", "u+rwx", "--", path], ["chattr", "-R", "-i", "-a", "--", path])
    for fix in fixes:
        try:
            if fix:
                subprocess.run(fix, capture_output=True, timeout=60)
            subprocess.run(["rm", "-rf", "--", path], capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            pass
        if not os.path.lexists(path):
            return


# -- availability -------------------------------------------------------------------------------


@functools.cache
def _bwrap_path() -> str | None:
    return shutil.which("bwrap")


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot be used here (None: it can). Checked once per process by running
    a small program in the full sandbox (bwrap fails, e.g., in containers without user namespaces)."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux (this is {sys.platform})"
    if _bwrap_path() is None:
        return "bubblewrap (bwrap) is not installed"
    probe = "open('/tmp/probe', 'w').write('ok')\nprint(open('/tmp/probe').read())"
    try:
        with _Sandboxed("main", probe, "", SandboxLimits(timeout=30), "bwrap") as run:
            result = run.wait(time.monotonic() + 30)
    except OSError as exc:
        return f"bwrap could not be started: {exc}"
    if result.ok and result.stdout == "ok\n":
        return None
    detail = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
    return f"bwrap is installed but cannot run the sandbox here ({detail})"


def check_isolation(isolation: Isolation) -> None:
    """Raise :class:`SandboxUnavailable` naming the fix when ``isolation`` cannot be provided."""
    if isolation == "bwrap":
        problem = bwrap_problem()
        if problem is not None:
            raise SandboxUnavailable(f"the code sandbox is not available: {problem}. To fix: {_INSTALL_HINT}")


# -- the two kinds of run -----------------------------------------------------------------------


def run_python(
    source: str, stdin: str = "", limits: SandboxLimits = SandboxLimits(), *, isolation: Isolation = "bwrap"
) -> SandboxResult:
    """Run ``source`` as a Python program (``__main__``) in a fresh sandbox, feeding it ``stdin``."""
    check_isolation(isolation)
    with _Sandboxed("main", source, stdin, limits, isolation) as run:
        return run.wait(run.start + limits.timeout)


def run_function_test(
    solution: str, test: str, limits: SandboxLimits = SandboxLimits(), *, isolation: Isolation = "bwrap"
) -> bool:
    """Whether Python ``test`` code (e.g. ``assert square(3) == 9``) runs to its end against ``solution``.

    Two sandboxes joined by pipes: the solution is loaded in one and answers calls with plain
    data (JSON); the test runs in the other, which only ever sees that data, so every comparison
    is made by trusted code. The verdict is a line with a random nonce that only the test's
    sandbox knows, so nothing the solution does -- exiting early, printing, rewriting hooks --
    can pass a test. Both run within ``limits.timeout`` of wall-clock time.
    """
    check_isolation(isolation)
    nonce = secrets.token_hex(16)
    request_r, request_w = os.pipe()
    reply_r, reply_w = os.pipe()
    try:
        with _Sandboxed("serve", solution, "", limits, isolation, channel=(request_r, reply_w)) as serve:
            with _Sandboxed("test", test, "", limits, isolation, channel=(reply_r, request_w), nonce=nonce) as tester:
                for fd in (request_r, request_w, reply_r, reply_w):
                    os.close(fd)
                request_r = request_w = reply_r = reply_w = -1
                result = tester.wait(serve.start + limits.timeout)
    finally:
        for fd in (request_r, request_w, reply_r, reply_w):
            if fd >= 0:
                os.close(fd)
    lines = result.stdout.splitlines()
    return result.ok and bool(lines) and lines[-1] == f"PASS {nonce}"
