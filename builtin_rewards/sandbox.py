"""Running untrusted Python in a locked-down subprocess (used by the code-execution reward).

Each run gets its own temporary directory as working directory, a clean environment, Python's
isolated mode (``-I -S -B``), resource limits (CPU time, address space, file size), a wall-clock
timeout after which its whole process group is killed, and -- through ``_sandbox_boot.py`` --
Landlock plus an audit hook so that it cannot write outside its directory (see that module).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_BOOT = str(Path(__file__).with_name("_sandbox_boot.py"))


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    timeout: float = 5.0  # wall-clock seconds, then the process group is killed
    cpu_seconds: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20  # also the largest file it may write


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


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(
    source: str,
    stdin: str = "",
    limits: SandboxLimits = SandboxLimits(),
    *,
    landlock: bool = True,
    audit_hook: bool = True,
) -> SandboxResult:
    """Run ``source`` as a Python program in the sandbox, feeding it ``stdin``.

    ``landlock`` and ``audit_hook`` switch the two write-protection layers (both on by default;
    tests turn one off to check that the other holds alone).
    """
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-") as tmp:
        work = Path(tmp) / "work"  # the program's directory; its output files sit beside it
        work.mkdir()
        (work / "solution.py").write_text(source, encoding="utf-8")
        (Path(tmp) / "stdin").write_text(stdin, encoding="utf-8")
        config = {
            "dir": str(work),
            "cpu_seconds": max(1, int(limits.cpu_seconds)),
            "memory_bytes": int(limits.memory_mb) << 20,
            "file_bytes": int(limits.max_output_bytes),
            "landlock": landlock,
            "audit_hook": audit_hook,
        }
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
        start = time.monotonic()
        with open(Path(tmp) / "stdin", "rb") as fin, open(Path(tmp) / "stdout", "wb") as fout, open(
            Path(tmp) / "stderr", "wb"
        ) as ferr:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", _BOOT, json.dumps(config)],
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                cwd=str(work),
                env=env,
                start_new_session=True,  # its own process group: the kill reaches its children
                close_fds=True,
            )
            timed_out = False
            try:
                returncode: int | None = proc.wait(timeout=limits.timeout)
            except subprocess.TimeoutExpired:
                timed_out, returncode = True, None
            _kill_group(proc.pid)  # also any child left behind after a normal exit
            if timed_out:
                proc.wait()
        seconds = time.monotonic() - start

        def read(name: str) -> str:
            with open(Path(tmp) / name, "rb") as f:
                return f.read(limits.max_output_bytes).decode("utf-8", errors="replace")

        return SandboxResult(returncode, read("stdout"), read("stderr"), timed_out, seconds)
