"""Running untrusted Python in a sandbox (used by the code-execution reward).

On Linux every run is a fresh bubblewrap (``bwrap``) sandbox: its own user, pid, network, ipc,
uts and cgroup namespaces, no capabilities, uid 65534, a new session, a cleared environment,
read-only binds of only the interpreter, its standard library and the system libraries, a
private size-capped tmpfs as working directory, no ``/proc``, a read-only minimal ``/dev``, no
nested user namespaces, and a seccomp filter that refuses to start processes (threads work),
sockets, and the kernel interfaces that reach other processes or pin memory outside the limits.
Resource limits (CPU seconds, address space, file size, open files, tasks) are set by the
trusted boot code (:mod:`builtin_rewards._sandbox_boot`) before the program runs; where the
host allows, each run also gets a pids and memory cgroup of its own, and a root trainer starts
bwrap as an unprivileged host uid (the kernel applies no task limit to uid 0). Nothing outlives
a run: at the wall-clock timeout (or when a run is no longer needed) the sandbox's init process
is killed, which ends its pid namespace, and ``--die-with-parent`` covers the trainer dying;
stdin and outputs are memory files, so nothing of a run is left on disk.

Where bubblewrap is not usable, :func:`run_python` refuses (:class:`SandboxUnavailable`) unless
``isolation="unsafe_local"``: the older process with rlimits, Landlock and an audit hook, which
does not contain a determined attacker (docs/rewards.md).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
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
import threading
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
    memory_mb: int = 512  # address space of the sandbox's one process (its cgroup: + disk_mb + 64 MiB)
    max_output_bytes: int = 1 << 20  # stdout, stderr, and the largest file it may write
    disk_mb: int = 64  # size of its writable tmpfs
    max_tasks: int = 64  # threads (RLIMIT_NPROC, and pids.max of its cgroup); processes are refused under bwrap


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
# fcntl commands refused: record locks and leases on shared read-only files, and directory
# notification (each a channel between concurrent sandboxes), and growing a pipe's buffer
# (kernel memory outside the address space): F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK,
# F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE, F_NOTIFY, F_SETPIPE_SZ.
_FCNTL_REFUSED = (5, 6, 7, 36, 37, 38, 1024, 1026, 1031)


@dataclass(frozen=True)
class _Arch:
    audit: int  # AUDIT_ARCH_*
    clone: int
    fcntl: int
    refused: dict[str, tuple[int, ...]]  # why: syscall numbers (all EPERM)


_ARCHES: dict[str, _Arch] = {
    "x86_64": _Arch(0xC000003E, 56, 72, {
        "processes (fork, vfork)": (57, 58),
        "SysV shm, semaphores, messages; POSIX message queues (memory outside RLIMIT_AS)": (29, 64, 68, 240),
        "sockets of every family (network, vsock, socket buffers)": (41, 53),
        "inotify, fanotify, file handles, file locks (channels between sandboxes)": (253, 294, 300, 303, 304, 73),
        "another process's memory, descriptors or signals": (101, 310, 311, 312, 424, 434, 438),
        "keyrings, io_uring, AIO, bpf, perf, userfaultfd, unshare, setns": (
            248, 249, 250, 425, 426, 427, 206, 321, 298, 323, 272, 308),
    }),  # fmt: skip
    "aarch64": _Arch(0xC00000B7, 220, 25, {
        "processes": (),  # aarch64 has only clone/clone3
        "SysV shm, semaphores, messages; POSIX message queues": (194, 190, 186, 180),
        "sockets of every family": (198, 199),
        "inotify, fanotify, file handles, file locks": (26, 262, 264, 265, 32),
        "another process's memory, descriptors or signals": (117, 270, 271, 272, 424, 434, 438),
        "keyrings, io_uring, AIO, bpf, perf, userfaultfd, unshare, setns": (
            217, 218, 219, 425, 426, 427, 0, 280, 241, 282, 97, 268),
    }),  # fmt: skip
}
_CLONE3 = 435  # refused with ENOSYS, so that glibc falls back to clone, whose flags are checked


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The classic-BPF seccomp program for bwrap's ``--seccomp``, or None for other machines."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        return None
    a = _ARCHES[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    allow, kill, eperm = 0x7FFF0000, 0x80000000, 0x00050000 | _EPERM  # SECCOMP_RET_ALLOW/KILL_PROCESS/ERRNO
    nr, arg0, arg1 = 0, 16, 24  # offsets in seccomp_data (low halves of the arguments)
    # (code, jt, jf, k), where a jump target may be a label (a str), resolved below
    prog: list[tuple[int, int | str, int | str, int]] = [(ld, 0, 0, 4), (jeq, 1, 0, a.audit), (ret, 0, 0, kill)]
    prog += [(ld, 0, 0, nr)]
    if machine == "x86_64":
        prog += [(jge, "deny", 0, 0x40000000)]  # the x32 ABI
    prog += [(jeq, 0, 1, _CLONE3), (ret, 0, 0, 0x00050000 | _ENOSYS)]
    for number in sorted({n for numbers in a.refused.values() for n in numbers}):
        prog += [(jeq, "deny", 0, number)]
    prog += [(jeq, 0, "not_fcntl", a.fcntl), (ld, 0, 0, arg1)]
    prog += [(jeq, "deny", 0, cmd) for cmd in _FCNTL_REFUSED]
    prog += [(ret, 0, 0, allow), ("not_fcntl", 0, 0, 0)]
    prog += [(jeq, 0, "allow", a.clone), (ld, 0, 0, arg0), (jset, "allow", "deny", _CLONE_THREAD)]
    prog += [("allow", 0, 0, 0), (ret, 0, 0, allow), ("deny", 0, 0, 0), (ret, 0, 0, eperm)]
    labels, out = {}, []
    for insn in prog:
        if isinstance(insn[0], str):
            labels[insn[0]] = len(out)
        else:
            out.append(insn)
    code = b""
    for i, (op, jt, jf, k) in enumerate(out):
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf))
        code += struct.pack("=HBBI", op, jt, jf, k)
    return code


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


#: The host uid a trainer running as root starts bubblewrap as, so that the kernel applies the
#: thread limit (it exempts uid 0) and root-only files stay unreadable. That uid must be able to
#: read the interpreter (not so for one under ``/root``) and to make user namespaces.
SANDBOX_UID = 65534


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


# -- a pids and memory cgroup per sandbox, where the host lets the trainer make one ---------------

# Run by /bin/sh before bwrap: join the cgroup (each controller's cgroup.procs, then "--"), so
# that everything bwrap starts is inside it from the start.
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
_CGROUP_SLACK_MB = 64  # the interpreter, bwrap and kernel memory of one run beyond its limits


def cgroup_bytes(limits: SandboxLimits) -> int:
    """The memory cgroup's bound for one run: memory_mb + disk_mb + 64 MiB."""
    return (int(limits.memory_mb) + int(limits.disk_mb) + _CGROUP_SLACK_MB) << 20


class _Cgroup:
    """One run's cgroup: a directory per hierarchy (one under cgroup v2, pids and memory under v1)."""

    def __init__(self, dirs: list[str]) -> None:
        self.dirs = dirs

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def remove(self, tries: int = 1) -> bool:
        """Remove it; False while the kernel is still tearing the run's processes down."""
        for attempt in range(tries):
            for d in list(self.dirs):
                try:
                    os.rmdir(d)
                except FileNotFoundError:
                    pass
                except OSError:
                    continue
                self.dirs.remove(d)
            if not self.dirs:
                return True
            if attempt + 1 < tries:
                time.sleep(0.01)
        return False


class _Cgroups:
    """Makes a cgroup with ``pids.max`` and a memory bound for each run, below a parent cgroup
    of this trainer's (removed at exit)."""

    def __init__(self, version: int, parents: dict[str, str]) -> None:
        self.version = version  # 2: one unified hierarchy; 1: pids and memory hierarchies
        self.parents = parents  # controller -> the parent directory runs are made in
        self._names = itertools.count()
        self._busy: list[_Cgroup] = []
        self._lock = threading.Lock()
        self._owner = os.getpid()
        atexit.register(self._remove_all)

    def make(self, limits: SandboxLimits) -> _Cgroup:
        """A fresh cgroup with ``limits``' bounds (raises OSError when it cannot be made)."""
        with self._lock:  # those whose processes were still going when released
            busy, self._busy = self._busy, []
        for cgroup in busy:
            self.release(cgroup)
        name = f"{os.getpid()}-{next(self._names)}"  # a forked trainer process shares the parent
        dirs = sorted({os.path.join(parent, name) for parent in self.parents.values()})
        cgroup = _Cgroup([])
        try:
            for d in dirs:
                os.mkdir(d, 0o700)
                cgroup.dirs.append(d)
            tasks, memory = str(int(limits.max_tasks) + 2), str(cgroup_bytes(limits))  # + bwrap (sh execs it), its init
            pids_dir, memory_dir = (os.path.join(self.parents[c], name) for c in ("pids", "memory"))
            if self.version == 2:
                files = [("pids.max", tasks), ("memory.max", memory), ("memory.swap.max", "0")]
            else:
                files = [("pids.max", tasks), ("memory.limit_in_bytes", memory)]
                files.append(("memory.memsw.limit_in_bytes", memory))  # memory + swap
            for file, value in files:
                path = os.path.join(pids_dir if file.startswith("pids") else memory_dir, file)
                if file.startswith(("memory.swap", "memory.memsw")) and not os.path.exists(path):
                    continue  # no swap accounting on this host
                with open(path, "w") as f:
                    f.write(value)
        except BaseException:
            self.release(cgroup)
            raise
        return cgroup

    def release(self, cgroup: _Cgroup) -> None:
        if not cgroup.remove():
            with self._lock:
                self._busy.append(cgroup)

    def _remove_all(self) -> None:
        if os.getpid() != self._owner:
            return  # a forked process: the parent cgroups are its parent's
        for cgroup in self._busy:
            cgroup.remove(tries=100)
        for parent in set(self.parents.values()):
            with contextlib.suppress(OSError):
                os.rmdir(parent)


def _cgroup_mounts() -> tuple[tuple[str, str] | None, dict[str, tuple[str, str]]]:
    """The cgroup v2 mount and {v1 controller: its mount}, each as (the cgroup the mount shows
    at its top, the mount point), from /proc/self/mountinfo."""
    v2, v1 = None, {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            mount, fstype, options = (fields[3], fields[4]), fields[sep + 1], fields[sep + 3].split(",")
            if fstype == "cgroup2" and v2 is None:
                v2 = mount
            elif fstype == "cgroup":
                for controller in ("pids", "memory"):
                    if controller in options:
                        v1.setdefault(controller, mount)
    return v2, v1


def _cgroup_dir(mount: tuple[str, str], path: str) -> str:
    """The directory of cgroup ``path`` (as /proc/self/cgroup names it) under ``mount``."""
    top, point = mount
    if top != "/" and (path == top or path.startswith(top + "/")):
        path = path[len(top) :] or "/"
    return point.rstrip("/") + path


def _remove_stale(where: str) -> None:
    """Remove the (empty) cgroups left by trainer processes that were killed before their exit."""
    for entry in os.listdir(where):
        pid = entry.removeprefix("grpo-sandbox-")
        if entry.startswith("grpo-sandbox-") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            stale = os.path.join(where, entry)
            for child in os.listdir(stale):
                with contextlib.suppress(OSError):
                    if os.path.isdir(os.path.join(stale, child)):
                        os.rmdir(os.path.join(stale, child))
            with contextlib.suppress(OSError):
                os.rmdir(stale)


def _own_cgroups() -> dict[str, str]:
    """{controller ("unified" for cgroup v2): this process's cgroup} from /proc/self/cgroup."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else ["unified"]:
                own[controller] = path
    return own


def _find_cgroups() -> _Cgroups:
    """Where this trainer can make per-run cgroups with both a pids and a memory bound (raises
    OSError, ValueError or KeyError where it cannot: no permission, no delegation, controllers
    missing)."""
    v2, v1 = _cgroup_mounts()
    own = _own_cgroups()
    name = f"grpo-sandbox-{os.getpid()}"
    if "pids" in v1 and "memory" in v1:
        parents = {c: os.path.join(_cgroup_dir(v1[c], own[c]), name) for c in ("pids", "memory")}
        version = 1
    else:
        if v2 is None:
            raise OSError("no cgroup v2 mount")
        # A sibling of this process's cgroup (cgroup v2 puts no processes in a cgroup that
        # hands controllers to its children); its parent must hand it pids and memory.
        here = _cgroup_dir(v2, own["unified"])
        above = here if own["unified"] == "/" else os.path.dirname(here)
        with open(os.path.join(above, "cgroup.subtree_control")) as f:
            if not {"pids", "memory"} <= set(f.read().split()):
                raise OSError(f"{above} does not delegate the pids and memory controllers")
        parents = {c: os.path.join(above, name) for c in ("pids", "memory")}
        version = 2
    made = []
    try:
        for parent in sorted(set(parents.values())):
            _remove_stale(os.path.dirname(parent))
            os.mkdir(parent, 0o700)
            made.append(parent)
        if version == 2:
            with open(os.path.join(parents["pids"], "cgroup.subtree_control"), "w") as f:
                f.write("+pids +memory")
        cgroups = _Cgroups(version, parents)
        trial = cgroups.make(SandboxLimits())  # every file it writes is writable, and it can be joined
        try:
            subprocess.run(["/bin/sh", "-c", _JOIN, "sh", *trial.procs_files(), "--", "true"], check=True, timeout=30)
        finally:
            cgroups.release(trial)
    except BaseException:
        for parent in made:
            with contextlib.suppress(OSError):
                os.rmdir(parent)
        raise
    return cgroups


_CGROUPS_LOCK = threading.Lock()
_CGROUPS: list[_Cgroups | None] = []  # filled once


def _cgroups() -> _Cgroups | None:
    """The per-run cgroups, or None where this host does not let the trainer make them (looked
    for once per process, by the first run)."""
    if not _CGROUPS:
        with _CGROUPS_LOCK:
            if not _CGROUPS:
                try:
                    found = _find_cgroups() if sys.platform.startswith("linux") else None
                except (OSError, ValueError, KeyError, IndexError, subprocess.SubprocessError):
                    found = None
                _CGROUPS.append(found)
    return _CGROUPS[0]


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
        run_as: int | None | Literal["auto"] = "auto",
        cgroup: bool = True,
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
            "verdict": "",
        }
        self.verdict_fd: int | None = None
        if mode == "test":  # the verdict's own file: only the trusted test side ever holds it
            self.verdict_fd = _memory_file()
            self.fds.append(self.verdict_fd)
            config["verdict"] = str(self.verdict_fd)
        argv = [";".join(f"{k}={v}" for k, v in config.items())]
        pass_fds = list(channel or ()) + ([self.verdict_fd] if self.verdict_fd is not None else [])
        self.tmp: str | None = None  # unsafe_local's working directory on the host
        self.info_fd: int | None = None
        self.cgroup: _Cgroup | None = None
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
            uid = _run_as() if run_as == "auto" else run_as
            if uid is not None:
                cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *cmd]
            manager = _cgroups() if cgroup else None
            if manager is not None:
                try:
                    self.cgroup = manager.make(limits)
                except BaseException:
                    self._free()
                    raise
                # joined before bwrap starts, so that everything it starts is inside
                cmd = ["/bin/sh", "-c", _JOIN, "sh", *self.cgroup.procs_files(), "--", *cmd]
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

    def verdict(self) -> str:
        """What the trusted test side wrote to its verdict file (after :meth:`wait`)."""
        assert self.verdict_fd is not None
        return _read_back(self.verdict_fd, 4096)

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
        if self.cgroup is not None:
            manager = _cgroups()
            assert manager is not None
            manager.release(self.cgroup)
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


_RUN_AS: list[int | None] = [None]  # set by bwrap_problem: the host uid bwrap is started as


def _run_as() -> int | None:
    """The host uid to start bwrap as (None: the trainer's own, already not root)."""
    bwrap_problem()
    return _RUN_AS[0]


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot be used here (None: it can). Checked once per process by running
    a small program in the full sandbox (bwrap fails, e.g., in containers without user namespaces).

    A trainer running as root starts bwrap as :data:`SANDBOX_UID` where that works (it needs
    unprivileged user namespaces), else as root, where the kernel does not apply the thread
    limit (docs/rewards.md)."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux (this is {sys.platform})"
    if _bwrap_path() is None:
        return "bubblewrap (bwrap) is not installed"
    problem = None
    candidates: list[int | None] = [SANDBOX_UID] if os.geteuid() == 0 and shutil.which("setpriv") else []
    for uid in [*candidates, None]:
        problem = _probe(uid)
        if problem is None:
            _RUN_AS[0] = uid
            break
    return problem


def _probe(uid: int | None) -> str | None:
    probe = "open('/tmp/probe', 'w').write('ok')\nprint(open('/tmp/probe').read())"
    try:
        with _Sandboxed("main", probe, "", SandboxLimits(timeout=30), "bwrap", run_as=uid, cgroup=False) as run:
            result = run.wait(time.monotonic() + 30)
    except OSError as exc:
        return f"bwrap could not be started: {exc}"
    if result.ok and result.stdout == "ok\n":
        return None
    detail = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
    return f"bwrap is installed but cannot run the sandbox here ({detail})"


def host_bounds() -> tuple[str, bool]:
    """Which bound applies to a run's tasks and the kernel memory it can pin on this host (the
    table in docs/rewards.md), and whether both are bounded."""
    cgroups, uid = _cgroups(), _run_as()
    who = f"bwrap runs as host uid {uid}" if uid is not None else f"bwrap runs as uid {os.geteuid()}"
    if cgroups is not None:
        return f"a pids and memory cgroup (v{cgroups.version}) per run; {who}", True
    if uid is not None or os.geteuid() != 0:
        return f"no per-run cgroup: tasks bounded by RLIMIT_NPROC, tmpfs inodes not bounded; {who}", False
    return (
        "no per-run cgroup and bwrap runs as root: a run's tasks are bounded only by its address space "
        "and tmpfs inodes not at all (let the trainer make cgroups, or run it as an ordinary user)",
        False,
    )


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
                verdict = tester.verdict()
    finally:
        for fd in (request_r, request_w, reply_r, reply_w):
            if fd >= 0:
                os.close(fd)
    return result.ok and verdict == f"PASS {nonce}\n"
