"""Test helper: the host processes of code-sandbox runs (shared by the sandbox attack tests and
the sandboxed python tool's tests)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def sandbox_pids() -> set[int]:
    """Host pids of every process of a sandbox run still alive: its command line carries the
    sandbox's boot code."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if b"Trusted start-up code inside the code sandbox" in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.add(int(entry))
    return pids
