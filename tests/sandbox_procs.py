"""Test helpers shared by the sandbox attack tests and the sandboxed python tool's tests: the host
processes of code-sandbox runs, and a thread bomb."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _parent(pid: int) -> int:
    """The parent pid of ``pid`` (0 where it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and ')'


def _a_sibling_runs_it(pid: int) -> bool:
    """Whether ``pid`` descends from this process's parent but not from this process: a run of
    another pytest worker (under pytest-xdist), still going, not one this test left behind."""
    me, parent = os.getpid(), os.getppid()
    while pid > 1:
        if pid == me:
            return False
        if pid == parent:
            return True
        pid = _parent(pid)
    return False


def sandbox_pids() -> set[int]:
    """Host pids of every process of a sandbox run still alive: its command line carries the
    sandbox's boot code. Runs of other pytest workers still in progress are left out; a process
    that escaped any run (reparented away from its worker) is not."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if b"Trusted start-up code inside the code sandbox" in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.add(int(entry))
    return {pid for pid in pids if not _a_sibling_runs_it(pid)}


#: Raw clone(CLONE_THREAD) calls with 4 KiB stacks: 20,000 threads fit in 80 MiB of address space.
CLONE_BOMB = """
import ctypes, mmap, time
libc = ctypes.CDLL(None, use_errno=True)
libc.clone.restype = ctypes.c_int
libc.clone.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
pause = ctypes.cast(libc.pause, ctypes.c_void_p)
flags = 0x100 | 0x200 | 0x400 | 0x800 | 0x10000 | 0x40000  # VM FS FILES SIGHAND THREAD SYSVSEM
area = mmap.mmap(-1, 4096 * 20000)
base = ctypes.addressof(ctypes.c_char.from_buffer(area))
made = 0
for i in range(20000):
    if libc.clone(pause, ctypes.c_void_p(base + 4096 * (i + 1) - 64), flags, None) < 0:
        break
    made += 1
print("made", made, flush=True)
time.sleep(30)
"""
