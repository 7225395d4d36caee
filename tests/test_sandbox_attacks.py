"""Hostile programs against the code sandbox: each test checks, from outside, that the effect did
not happen (a secret not leaked, a file's metadata unchanged, no packet received, nothing left
running, memory and disk bounded, no forged score) -- never just an error message.

Skipped only where bubblewrap is not usable; with ``CI`` set they fail instead, so CI cannot
pass without running them (``scripts/setup.sh`` installs bubblewrap).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sandbox_procs import CLONE_BOMB, sandbox_pids as _sandbox_pids

from builtin_rewards.code_execution import CodeExecution
from builtin_rewards.sandbox import SandboxLimits, _layout, run_function_test, run_python

FAST = SandboxLimits(timeout=2.0, cpu_seconds=2, memory_mb=256)
IS_ROOT = os.geteuid() == 0
# The system libraries and the interpreter's standard library are bound read-only by design;
# walks over the sandbox's file system skip them (public, and ~100k files here).
SYSTEM = [os.path.dirname(p) if os.path.isfile(p) else p for p in _layout()[1]]
WALK = f"""
import os
def walk():
    for root, dirs, files in os.walk("/"):
        dirs[:] = [d for d in dirs if os.path.join(root, d) not in {SYSTEM!r}]
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):  # not a device: ptmx would block
                yield path
"""


pytestmark = pytest.mark.usefixtures("bwrap")  # skipped where unusable, failed under CI


def run(code: str, **limits: float) -> str:
    """Run ``code`` in the sandbox; its stdout and stderr together."""
    result = run_python(code, limits=SandboxLimits(**{**FAST.__dict__, **limits}))
    return result.stdout + result.stderr


@pytest.fixture()
def helper() -> Iterator[subprocess.Popen[bytes]]:
    """An ordinary host process with a secret in its environment."""
    proc = subprocess.Popen(["sleep", "60"], env={"GRPO_HELPER_SECRET": "helper-" + uuid.uuid4().hex})
    yield proc
    proc.kill()
    proc.wait()


def _describe(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()[:200].decode(errors="replace")
    except OSError:
        return "(gone)"


def _status_total(pids: set[int], field: str) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1])
    return total


@contextlib.contextmanager
def sampling(measure: Callable[[], int], interval: float = 0.02) -> Iterator[list[int]]:
    """Call ``measure`` every ``interval`` seconds in a thread while the block runs."""
    samples: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            samples.append(measure())
            stop.wait(interval)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


# -- reading the host ---------------------------------------------------------------------------


def test_host_secrets_never_reach_the_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helper) -> None:
    secret = "grpo-secret-" + uuid.uuid4().hex
    monkeypatch.setenv("GRPO_TEST_SECRET", secret)
    secret_file = tmp_path / "secret.txt"
    secret_file.write_text(secret)
    secret_file.chmod(0o644)
    readme = Path(__file__).resolve().parents[1] / "README.md"
    code = WALK + f"""
for pid in ({os.getpid()}, {helper.pid}, 1, 2, "self"):
    for name in ("environ", "cmdline"):
        try:
            print(open(f"/proc/{{pid}}/{{name}}", "rb").read())
        except OSError:
            pass
print(dict(os.environ))
for path in ({str(secret_file)!r}, "/root/.bash_history", "/etc/shadow", {str(readme)!r}):
    try:
        print(open(path).read())
    except OSError:
        pass
seen = 0
for path in walk():
    seen += 1
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        continue
    if b"grpo-secret-" in data or b"helper-" in data or b"# grpo-plugins" in data:
        print("FOUND", path, data[:200])
print("walked", seen)
"""
    out = run(code, timeout=10, cpu_seconds=10)
    assert "walked" in out  # the attack ran to its end ...
    assert secret not in out and "FOUND" not in out  # ... and found nothing of the host's


# -- devices and metadata -----------------------------------------------------------------------


def _kernel_log() -> str | None:
    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


@contextlib.contextmanager
def _loop_device(backing: Path) -> Iterator[tuple[int, int] | None]:
    """A loop device on ``backing`` as (major, minor), where this machine lets us make one."""
    if not IS_ROOT or shutil.which("losetup") is None:
        yield None
        return
    made = subprocess.run(["losetup", "-f", "--show", str(backing)], capture_output=True, text=True)
    if made.returncode != 0:
        yield None
        return
    device = made.stdout.strip()
    try:
        st = os.stat(device)
        yield os.major(st.st_rdev), os.minor(st.st_rdev)
    finally:
        subprocess.run(["losetup", "-d", device], capture_output=True)


def test_device_nodes_cannot_reach_devices(tmp_path: Path) -> None:
    marker = "grpo-kmsg-" + uuid.uuid4().hex
    backing = tmp_path / "disk.img"
    backing.write_bytes(b"\0" * (1 << 20))
    with _loop_device(backing) as loop:
        major, minor = loop or (7, 0)
        code = f"""
import os, stat
attempts = [("/dev/kmsg", None), ("/tmp/kmsg", (stat.S_IFCHR, 1, 11)), ("/tmp/loop", (stat.S_IFBLK, {major}, {minor})),
            ("/dev/loop{minor}", None)]
for path, node in attempts:
    try:
        if node:
            os.mknod(path, node[0] | 0o666, os.makedev(node[1], node[2]))
        with open(path, "wb", buffering=0) as f:
            f.write(b"<0>{marker}\\n" * 64)
    except OSError as exc:
        print(path, exc)
print("done")
"""
        assert "done" in run(code)
        os.sync()  # a write to the loop device would sit in its page cache until flushed
        assert backing.read_bytes() == b"\0" * (1 << 20)  # nothing reached the loop device's file
    log = _kernel_log()
    if log is not None:
        assert marker not in log


FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def _metadata(path: str) -> tuple:
    st = os.stat(path)
    flags = None
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            flags = struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, b"\0" * 4))[0]
        finally:
            os.close(fd)
    xattrs = sorted(os.listxattr(path)) if hasattr(os, "listxattr") else []
    return st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_atime_ns, xattrs, flags


def test_metadata_of_outside_files_is_unchanged(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    outside.chmod(0o644)
    os.utime(outside, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    visible = [os.path.realpath(sys.executable), os.__file__]  # bound read-only into the sandbox
    targets = [str(outside), *visible]
    before = {p: _metadata(p) for p in targets}
    code = f"""
import fcntl, os, struct
for path in {targets!r}:
    for attempt in (
        lambda: os.chmod(path, 0o4777),
        lambda: os.chown(path, 65534, 65534),
        lambda: os.utime(path, (0, 0)),
        lambda: os.setxattr(path, "user.grpo", b"x"),
        lambda: os.setxattr(path, "trusted.grpo", b"x"),
    ):
        try:
            attempt()
        except OSError:
            pass
    try:
        fd = os.open(path, os.O_RDONLY)
        fcntl.ioctl(fd, {FS_IOC_SETFLAGS}, struct.pack("i", {FS_IMMUTABLE_FL}))
        os.fchmod(fd, 0o4777)
        os.fchown(fd, 0, 0)
    except OSError:
        pass
print("done")
"""
    assert "done" in run(code)
    assert {p: _metadata(p) for p in targets} == before


# -- network ------------------------------------------------------------------------------------


def _drain(sock: socket.socket, seconds: float) -> list[bytes]:
    sock.settimeout(0.05)
    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(socket.timeout, BlockingIOError):
            got.append(sock.recv(65536))
    return got


def test_no_packets_reach_the_host(tmp_path: Path) -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    port = udp.getsockname()[1]
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    tcp.settimeout(0.2)
    unix_path = str(tmp_path / "dgram.sock")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    unix.bind(unix_path)
    abstract_name = b"\0grpo-test-" + uuid.uuid4().hex.encode()
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    abstract.bind(abstract_name)
    icmp = None
    if IS_ROOT:
        icmp = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    marker = "grpo-net-" + uuid.uuid4().hex
    code = f"""
import socket, struct
m = {marker!r}.encode()
def attempt(f):
    try:
        f()
    except OSError as exc:
        print(exc)
def udp_sendto():
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(m, ("127.0.0.1", {port}))
def udp_sendmsg():
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendmsg([m], [], 0, ("127.0.0.1", {port}))
def tcp():
    socket.create_connection(("127.0.0.1", {tcp.getsockname()[1]}), timeout=0.5).sendall(m)
def unix():
    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendmsg([m], [], 0, {unix_path!r})
def abstract():
    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendmsg([m], [], 0, {abstract_name!r})
def icmp(kind):
    s = socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP)
    s.sendmsg([struct.pack("!BBHHH", 8, 0, 0, 1, 1) + m], [], 0, ("127.0.0.1", 0))
def netlink():  # create a network interface
    def attr(t, data):
        n = 4 + len(data)
        return struct.pack("HH", n, t) + data + bytes(-n % 4)
    body = struct.pack("BxHiII", 0, 0, 0, 0, 0) + attr(3, b"grpoescape0\\0") + attr(18, attr(1, b"ifb"))
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
    s.sendmsg([struct.pack("IHHII", 16 + len(body), 16, 0x605, 1, 0) + body], [], 0, (0, 0))
    print("netlink reply", s.recv(4096)[16:20])
for f in (udp_sendto, udp_sendmsg, tcp, unix, abstract, netlink):
    attempt(f)
for kind in (socket.SOCK_RAW, socket.SOCK_DGRAM):
    attempt(lambda: icmp(kind))
print("done")
"""
    try:
        assert "done" in run(code)
        assert _drain(udp, 0.3) == [] and _drain(unix, 0.1) == [] and _drain(abstract, 0.1) == []
        with pytest.raises(socket.timeout):
            tcp.accept()
        if icmp is not None:
            assert not any(marker.encode() in packet for packet in _drain(icmp, 0.2))
        assert "grpoescape0" not in os.listdir("/sys/class/net")
    finally:
        for s in (udp, tcp, unix, abstract, icmp):
            if s is not None:
                s.close()
        if "grpoescape0" in os.listdir("/sys/class/net"):
            subprocess.run(["ip", "link", "del", "grpoescape0"], capture_output=True)


# -- processes ----------------------------------------------------------------------------------


def test_nothing_outlives_the_call(tmp_path: Path) -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    port = udp.getsockname()[1]
    marker = tmp_path / "late-marker"
    code = f"""
import ctypes, os, socket, subprocess, threading, time
def linger():
    time.sleep(0.5)
    for _ in range(100):
        try:
            open({str(marker)!r}, "w").write("late")
        except OSError:
            pass
        try:
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"late", ("127.0.0.1", {port}))
        except OSError:
            pass
        time.sleep(0.05)
for start in (
    lambda: os.fork() or (os.setsid(), os.fork() or linger(), os._exit(0)),
    lambda: subprocess.Popen(["/usr/bin/sleep", "60"], start_new_session=True),
    lambda: os.posix_spawn("/usr/bin/sleep", ["sleep", "60"], {{}}),
    lambda: ctypes.CDLL(None).syscall(56, 17, 0, 0, 0, 0) == 0 and linger(),  # raw clone(SIGCHLD)
    lambda: ctypes.CDLL(None).syscall(435, 0, 0) == 0 and linger(),  # clone3
):
    try:
        start()
    except OSError as exc:
        print(exc)
threading.Thread(target=linger).start()  # a thread dies with its process, which the timeout ends
print("started", flush=True)
"""
    before = _sandbox_pids()
    result = run_python(code, limits=SandboxLimits(timeout=1.0, cpu_seconds=1, memory_mb=256))
    assert "started" in result.stdout
    deadline = time.monotonic() + 1.0  # the kernel tears the pid namespace down right after bwrap
    while _sandbox_pids() - before and time.monotonic() < deadline:
        time.sleep(0.02)
    left = {pid: _describe(pid) for pid in _sandbox_pids() - before}
    assert left == {}
    assert _drain(udp, 1.5) == []
    assert not marker.exists()
    udp.close()


def test_fork_bomb_and_thread_bomb_are_bounded() -> None:
    code = """
import os, threading, time
for _ in range(200):
    try:
        os.fork()
    except OSError:
        break
threads = 0
for _ in range(500):
    try:
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        threads += 1
    except (RuntimeError, MemoryError):
        break
print("threads", threads, flush=True)
time.sleep(30)
"""
    before = _sandbox_pids()
    with sampling(lambda: _status_total(_sandbox_pids() - before, "Threads")) as tasks:
        out = run(code, timeout=2.0, max_tasks=16)
    assert "threads" in out
    assert max(tasks) <= 16 + 2  # the limit, plus bwrap's init process and some slack for sampling


def test_memory_is_bounded_across_processes_and_threads() -> None:
    code = """
import os, threading, time
def hog():
    chunks = []
    while True:
        try:
            chunks.append(bytearray(16 << 20))
        except MemoryError:
            break
    time.sleep(30)
for _ in range(8):
    try:
        if os.fork() == 0:
            hog()
    except OSError:
        pass
for _ in range(8):
    try:
        threading.Thread(target=hog, daemon=True).start()
    except (RuntimeError, MemoryError):
        pass
print("hogging", flush=True)
hog()
"""
    before = _sandbox_pids()
    with sampling(lambda: _status_total(_sandbox_pids() - before, "VmRSS")) as rss_kib:
        out = run(code, timeout=2.0, memory_mb=192)
    assert "hogging" in out
    assert max(rss_kib) <= 192 * 1024  # within the one address space, whatever was tried


def test_memory_is_bounded_outside_the_address_space() -> None:
    # SysV shared memory and message queues outlive a detach/close: filled and let go, they
    # would hold memory that no RLIMIT_AS counts.
    code = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
for _ in range(16):
    segment = libc.shmget(0, 32 << 20, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
    address = libc.shmat(segment, None, 0) if segment >= 0 else None
    if address in (None, ctypes.c_void_p(-1).value):
        break
    ctypes.memset(address, 1, 32 << 20)
    libc.shmdt(ctypes.c_void_p(address))
for _ in range(64):  # memory files: each capped by RLIMIT_FSIZE, and by the open-file limit
    try:
        fd = os.memfd_create("hog")
        os.write(fd, b"x" * (8 << 20))
    except OSError:
        pass
print("hogged", flush=True)
"""
    base = _shmem_kib()
    with sampling(lambda: _shmem_kib() - base) as grown:
        out = run(code, timeout=3.0, memory_mb=128)
    assert "hogged" in out
    assert max(grown) < (64 + 48) * 1024  # 64 memory files of 1 MiB, plus slack for other processes


def _shmem_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    raise AssertionError("no Shmem in /proc/meminfo")


def test_disk_is_bounded_and_nothing_lands_on_the_host() -> None:
    marker = "grpo-disk-" + uuid.uuid4().hex
    code = f"""
import os
written = 0
for target in ("/tmp", "/", "/dev", "/dev/shm", "/usr/lib"):
    for i in range(400):
        try:
            with open(f"{{target}}/{marker}-{{i}}", "wb") as f:
                f.write(b"x" * (1 << 20))
                written += 1
        except OSError:
            break
for i in range(20000):
    try:
        open(f"/tmp/{marker}-small-{{i}}", "w").close()
    except OSError:
        break
print("written MiB", written, flush=True)
"""
    base = _shmem_kib()
    with sampling(lambda: _shmem_kib() - base) as grown:
        out = run(code, timeout=10, cpu_seconds=10, disk_mb=16, max_output_bytes=1 << 20)
    assert "written MiB" in out
    assert int(out.split("written MiB")[1].split()[0]) <= 16  # the tmpfs cap, whatever the target
    assert max(grown) < (16 + 48) * 1024  # tmpfs memory: the cap plus slack for other processes
    for where in {tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm", str(Path.cwd())}:
        assert glob.glob(os.path.join(where, f"{marker}*")) == []


def test_outside_processes_cannot_be_reprioritised_limited_or_signalled(helper) -> None:
    targets = [os.getpid(), helper.pid]

    def state(pid: int) -> tuple:
        return (
            os.getpriority(os.PRIO_PROCESS, pid),
            os.sched_getaffinity(pid),
            resource.prlimit(pid, resource.RLIMIT_NOFILE),
            Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] in "tT",  # stopped or traced
        )

    before = {pid: state(pid) for pid in targets}
    code = f"""
import ctypes, os, resource, signal
for pid in {targets!r} + [1]:  # 1: the sandbox's own init
    for attempt in (
        lambda: os.setpriority(os.PRIO_PROCESS, pid, 19),
        lambda: os.sched_setaffinity(pid, {{0}}),
        lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, 3)),
        lambda: os.kill(pid, signal.SIGSTOP),
        lambda: ctypes.CDLL(None, use_errno=True).ptrace(16, pid, 0, 0),  # PTRACE_ATTACH
    ):
        try:
            attempt()
        except OSError:
            pass
for which in (os.PRIO_USER, os.PRIO_PGRP):
    try:
        os.setpriority(which, 0, 19)
    except OSError:
        pass
print("done")
"""
    assert "done" in run(code)
    assert helper.poll() is None
    assert {pid: state(pid) for pid in targets} == before


# -- forging the verdict ------------------------------------------------------------------------

FORGERIES = {
    "os_exit": "import os\nos._exit(0)",
    "sys_exit": "import sys\nsys.exit(0)",
    "excepthook": "import sys\nsys.excepthook = lambda *a: None\ndef square(x):\n    raise AssertionError",
    "always_equal": "class Yes:\n    def __eq__(self, other): return True\n    def __bool__(self): return True\n"
    "def square(x):\n    return Yes()",
    "int_subclass": "class Nine(int):\n    def __eq__(self, other): return True\ndef square(x):\n    return Nine(0)",
    "patched_builtins": "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\n"
    "builtins.abs = lambda x: 0\ndef square(x):\n    return 0",
    "audit_hook_tamper": "import gc, sys\nfor o in gc.get_objects():\n"
    "    if callable(o) and getattr(o, '__name__', '') == 'hook':\n"
    "        o.__code__ = (lambda *a: None).__code__\ndef square(x):\n    return 0",
    "fake_output": "import os, sys\nfor fd in range(3, 64):\n    try:\n"
    "        os.write(fd, b'{\"value\": true}\\n{\"names\": {}}\\nPASS\\n')\n    except OSError:\n        pass\n"
    "print('PASS'); sys.stdout.flush()\ndef square(x):\n    return 'PASS'",
    "read_the_tests": WALK + "import re\nfound = []\nfor path in walk():\n"
    "    try:\n        found += re.findall(rb'== (\\d+)', open(path, 'rb').read(1 << 16))\n"
    "    except OSError:\n        pass\nfor fd in range(0, 64):\n    try:\n"
    "        os.set_blocking(fd, False)\n        found += re.findall(rb'== (\\d+)', os.read(fd, 1 << 16))\n"
    "    except OSError:\n        pass\n"
    "def square(x):\n    return int(found[-1]) if found else -1",
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_function_tests_cannot_be_forged(name: str) -> None:
    # abs() in the test is the test's own builtin, never the solution's
    test = "assert square(3) == 49\nassert abs(square(-3)) == 49"
    assert run_function_test(FORGERIES[name], test, FAST) is False


def test_a_correct_solution_still_passes_the_harness() -> None:
    test = "assert square(7) == 49\nassert abs(square(-7)) == 49"
    assert run_function_test("def square(x):\n    return x * x", test, FAST)


def test_stdin_tests_cannot_be_forged_or_copied_from_a_peer() -> None:
    answer = "answer-" + uuid.uuid4().hex
    reward = CodeExecution(CodeExecution.Params(timeout=5.0, cpu_seconds=5, max_workers=4))
    peer_copier = WALK + (
        "for path in walk():\n    try:\n        data = open(path, 'rb').read(1 << 16)\n"
        "    except OSError:\n        continue\n"
        "    if b'answer-' in data:\n        print(data.decode(errors='replace')); raise SystemExit(0)\n"
    )
    completions = [
        f"import time\nprint({answer!r})\ntime.sleep(1)",  # right, and lingers so its peers run meanwhile
        "import os\nos._exit(0)",
        "import sys\nsys.excepthook = lambda *a: None\nprint('PASS')\nraise SystemExit(0)",
        peer_copier,
        peer_copier,
    ]
    tests = [[{"input": "go\n", "output": answer}]] * len(completions)
    assert reward(["q"] * len(completions), completions, tests=tests) == [1.0, 0.0, 0.0, 0.0, 0.0]


# -- completions that try to make the reward itself fail ----------------------------------------


@pytest.mark.parametrize("isolation", ["bwrap", "unsafe_local"])  # the weaker one uses a host temp dir
def test_hostile_completions_score_zero_and_leave_nothing_behind(isolation: str) -> None:
    leftovers = set(glob.glob(os.path.join(tempfile.gettempdir(), "grpo-sandbox-*")))
    reward = CodeExecution(CodeExecution.Params(timeout=3.0, cpu_seconds=3, sandbox=isolation))
    completions = [
        "print('\\ud800')\ndef square(x): return '\ud800'",  # a lone surrogate, in the source and the output
        "import os\nfor i in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\ndef square(x): return 0",
        "import fcntl, os\nfd = os.open('f', os.O_CREAT | os.O_WRONLY)\n"
        "try:\n    fcntl.ioctl(fd, 0x40086602, b'\\x10\\0\\0\\0')\nexcept OSError:\n    pass\n"
        "os.chmod('.', 0)\ndef square(x): return 0",
        "import os, threading\ndef spam():\n    i = 0\n    while True:\n        try:\n"
        "            open(f'f{i}', 'w').close(); i += 1\n        except OSError:\n            pass\n"
        "threading.Thread(target=spam, daemon=True).start()\ndef square(x): return 0",
        "import os\nos.write(1, b'\\xff\\xfe\\x00' * 100000)\nos.close(1)\nos.close(2)\ndef square(x): return 0",
        "def square(x):\n    return 10 ** 100000",
        "def square(x):\n    a = []\n    a.append(a)\n    return a",
        "def square(x):\n    return " + "[" * 90 + "x" + "]" * 90,  # deeply nested data
    ]
    tests = [["assert square(3) == 9", {"input": "", "output": "9"}]] * len(completions)
    scores = reward(["q"] * len(completions), completions, tests=tests)
    assert scores == [0.0] * len(completions)
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "grpo-sandbox-*"))) == leftovers


# -- forging the verdict, further ---------------------------------------------------------------


def test_objects_the_solution_names_are_never_bound_on_the_trusted_side() -> None:
    # The solution's `add` claims to be operator.add (right answers, computed by trusted code),
    # and ANSWER claims to be unittest.mock.ANY (equal to everything): each is only a proxy.
    alias = (
        "import types\ndef add(a, b):\n    return 0\nadd.__module__ = 'operator'\nadd.__qualname__ = 'add'\n"
        "ANSWER = types.SimpleNamespace(__module__='unittest.mock', __qualname__='ANY', __name__='ANY')\n"
        "import unittest.mock as math\n"  # a module under a standard module's name: the test's math is its own
    )
    assert run_function_test(alias, "assert add(2, 3) == 5", FAST) is False
    assert run_function_test(alias, "assert ANSWER == 49 and ANSWER == 50", FAST) is False
    assert run_function_test(alias, "assert math.floor(2.5) == 2", FAST)  # the real math, not the alias
    own_math = "class math:\n    isclose = staticmethod(lambda *a, **k: True)\ndef area(r):\n    return 0"
    assert run_function_test(own_math, "assert math.isclose(area(2), 12.566, rel_tol=1e-3)", FAST) is False
    assert run_function_test("def add(a, b):\n    return a + b", "assert add(2, 3) == 5", FAST)


def test_frames_written_ahead_by_the_solution_are_not_taken_as_replies() -> None:
    # a well-formed greeting and answers, queued before any request was made
    frames = '{"names": {"square": "object"}, "id": 0}\\n' + '{"value": 49, "id": 1}\\n' * 8
    solution = (
        f"import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{frames}')\n"
        "    except OSError:\n        pass\ndef square(x):\n    return 0"
    )
    assert run_function_test(solution, "assert square(3) == 49\nassert abs(square(-3)) == 49", FAST) is False


def test_control_flow_exceptions_from_the_solution_are_data() -> None:
    check = "def check(candidate):\n    assert all(map(lambda x: candidate(x) == x * x, [2, 3]))\ncheck(square)"
    for raised in ("StopIteration", "StopAsyncIteration", "GeneratorExit", "SystemExit(0)", "KeyboardInterrupt"):
        assert run_function_test(f"def square(x):\n    raise {raised}", check, FAST) is False, raised
    assert run_function_test("def square(x):\n    return x * x", check, FAST)
    # a solution's generator still ends its own iteration
    squares = "def squares(n):\n    yield from (i * i for i in range(n))"
    assert run_function_test(squares, "assert list(squares(3)) == [0, 1, 4]", FAST)


def test_each_kind_of_forgery_scores_zero_beside_a_correct_solution() -> None:
    forgeries = [
        "def add(a, b):\n    return 0\nadd.__module__ = 'operator'\nadd.__qualname__ = 'add'",  # a trusted stand-in
        "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"names\": {\"add\": \"object\"}, \"id\": 0}\\n'"
        " + b'{\"value\": 5, \"id\": 1}\\n{\"value\": 2, \"id\": 2}\\n')\n    except OSError:\n        pass\ndef add(a, b):\n    return 0",
        "def add(a, b):\n    raise StopIteration",
    ]
    check = "def check(candidate):\n    assert all(map(lambda ab: candidate(*ab) == sum(ab), [(2, 3), (1, 1)]))\ncheck(add)"
    completions = [*forgeries, "def add(a, b):\n    return a + b"]
    reward = CodeExecution(CodeExecution.Params(timeout=3.0, cpu_seconds=3, max_workers=2))
    assert reward(["q"] * len(completions), completions, tests=[[check]] * len(completions)) == [0.0, 0.0, 0.0, 1.0]


def test_the_exit_status_cannot_be_forged() -> None:
    # Descriptors of the sandbox's init (bwrap reports the program's exit through one) taken with
    # pidfd_getfd and written to, then exit 3: the status must stay 3.
    code = """
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
taken = 0
pidfd = libc.syscall(434, 1, 0)  # pidfd_open(1)
for fd in range(64):
    stolen = libc.syscall(438, pidfd, fd, 0) if pidfd >= 0 else -1  # pidfd_getfd
    if stolen >= 0:
        taken += 1
        try:
            os.write(stolen, struct.pack("Q", 1))
        except OSError:
            pass
print("taken", taken, flush=True)
os._exit(3)
"""
    result = run_python(code, limits=FAST)
    assert "taken" in result.stdout
    assert result.returncode == 3 and not result.ok


# -- exhausting the host ------------------------------------------------------------------------

INODE_FLOOD = """
import os, threading, time
end = time.monotonic() + 3.0
def fill(t):
    n = 0
    try:
        while time.monotonic() < end:
            os.mkdir(f"{t}-{n}" + "x" * 200)  # an inode and a dentry with a long name each
            n += 1
    except OSError:
        pass
threads = [threading.Thread(target=fill, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.fixture()
def host_bounds() -> None:
    """The kernel-side bounds of a run need a cgroup per run (or, for tasks, an unprivileged
    host uid): skipped where neither is available, but failed under CI."""
    from builtin_rewards import sandbox

    if sandbox._cgroups() is None and sandbox._run_as() is None and IS_ROOT:
        if os.environ.get("CI"):
            pytest.fail("CI must run the host-bound tests, but no cgroup can be made and bwrap runs as root")
        pytest.skip("no per-run cgroup here and bwrap runs as root: tasks and tmpfs files are not bounded")


def _meminfo_kib(*fields: str) -> int:
    values = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()}
    return sum(values[f] for f in fields)


@pytest.mark.usefixtures("host_bounds")
def test_a_thread_bomb_is_bounded_and_a_peer_still_scores() -> None:
    reward = CodeExecution(CodeExecution.Params(timeout=3.0, cpu_seconds=3, memory_mb=256, max_workers=2))
    correct = "import time\nprint(sum(map(int, input().split())))\ntime.sleep(0.3)"  # runs beside a bomb
    before = _sandbox_pids()
    with sampling(lambda: _status_total(_sandbox_pids() - before, "Threads")) as tasks:
        scores = reward(["q"] * 3, [CLONE_BOMB, correct, CLONE_BOMB], tests=[[{"input": "2 3", "output": "5"}]] * 3)
    assert scores == [0.0, 1.0, 0.0]
    # each run bounded (two at a time, and a finished run's threads may take a moment to go):
    # unbounded, one such run makes 20,000 tasks
    assert max(tasks) <= 3 * (SandboxLimits().max_tasks + 4)
    from builtin_rewards import sandbox

    if sandbox._run_as() is not None or not IS_ROOT:  # RLIMIT_NPROC binds too: check it without the cgroup
        with sandbox._Sandboxed("main", CLONE_BOMB, "", FAST, "bwrap", cgroup=False) as bomb:
            result = bomb.wait(bomb.start + FAST.timeout)
        assert int(result.stdout.split("made")[1].split()[0]) < FAST.max_tasks


@pytest.mark.usefixtures("host_bounds")
def test_kernel_memory_of_tmpfs_files_is_bounded() -> None:
    from builtin_rewards import sandbox

    if sandbox._cgroups() is None:
        pytest.skip("the number of tmpfs files is bounded only by a per-run memory cgroup")
    reward = CodeExecution(CodeExecution.Params(timeout=4.0, cpu_seconds=4, memory_mb=64, disk_mb=1, max_workers=2))
    correct = "import time\nprint(sum(map(int, input().split())))\ntime.sleep(0.3)"  # runs beside the flood
    base = _meminfo_kib("Slab", "Shmem")
    with sampling(lambda: _meminfo_kib("Slab", "Shmem") - base) as grown:
        scores = reward(["q"] * 2, [INODE_FLOOD, correct], tests=[[{"input": "2 3", "output": "5"}]] * 2)
    assert scores == [0.0, 1.0]
    # unbounded, two threads make ~200 MiB of inodes and dentries in 3 s on a slow 2-core machine
    assert max(grown) <= (sandbox.cgroup_bytes(reward.limits) >> 10) + 32 * 1024


def test_sockets_of_every_family_are_refused() -> None:
    code = """
import socket
families = {"inet": socket.AF_INET, "inet6": socket.AF_INET6, "unix": socket.AF_UNIX, "vsock": 40,
            "netlink": socket.AF_NETLINK, "packet": 17}
for name, family in families.items():
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        try:
            socket.socket(family, kind)
            print("opened", name, kind)
        except OSError as exc:
            print("refused", name, exc.errno)
try:
    socket.socketpair()
    print("opened pair")
except OSError as exc:
    print("refused pair", exc.errno)
"""
    out = run(code)
    assert "refused pair" in out and "opened" not in out


def _concurrently(*codes: str) -> list[str]:
    outs = [""] * len(codes)

    def one(i: int) -> None:
        outs[i] = run(codes[i], timeout=3.0, cpu_seconds=3)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(codes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def test_concurrent_runs_cannot_signal_each_other() -> None:
    # Each channel a receiver and a sender in two sandboxes at once: vsock loopback, inotify and
    # dnotify on a file both see (bound read-only), and record locks and flock on it.
    shared = os.__file__
    receiver = f"""
import ctypes, fcntl, os, socket, time
heard = []
try:
    s = socket.socket(40, socket.SOCK_DGRAM)  # AF_VSOCK
    s.bind((1, 4242))  # VMADDR_CID_LOCAL
    s.settimeout(2)
    heard.append(("vsock", s.recv(100)))
except OSError:
    pass
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(os.O_NONBLOCK)
if fd >= 0 and libc.inotify_add_watch(fd, {shared!r}.encode(), 0xFFF) >= 0:
    time.sleep(1.5)
    try:
        heard.append(("inotify", os.read(fd, 4096)))
    except OSError:
        pass
f = open({shared!r}, "rb")
for attempt in (lambda: fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB),
                lambda: fcntl.lockf(f, fcntl.LOCK_SH | fcntl.LOCK_NB),
                lambda: fcntl.fcntl(os.open(os.path.dirname({shared!r}), os.O_RDONLY), 1026, 0x80000001)):
    try:
        attempt()
        heard.append(("lock", "taken"))
    except OSError:
        pass
print("heard", heard)
"""
    sender = f"""
import socket, time
for _ in range(20):
    try:
        socket.socket(40, socket.SOCK_DGRAM).sendto(b"grpo-vsock", (1, 4242))
    except OSError:
        pass
    open({shared!r}, "rb").read(1)
    time.sleep(0.1)
print("sent")
"""
    heard, sent = _concurrently(receiver, sender)
    assert "sent" in sent
    assert "heard []" in heard
