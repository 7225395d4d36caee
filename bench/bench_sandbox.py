"""Throughput of the code_execution reward's sandbox (CPU only; no GPU involved).

Times a batch of N completions with one test each, as the reward runs it (``max_workers``
threads, default the CPU count), for both test formats, and the latency of one sandboxed run.
With ``--baseline REF`` it also times the sandbox as it was at git commit REF (the reward and
sandbox files of that commit, imported from a temporary directory), interleaved with the
current one so that both see the same machine load.

    python bench/bench_sandbox.py [--n 8] [--repeats 15] [--baseline b1204ed]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from builtin_rewards.code_execution import CodeExecution  # noqa: E402
from builtin_rewards.sandbox import SandboxLimits, run_function_test, run_python  # noqa: E402

SOLUTION = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"
STDIN_TEST = {"input": "2 3\n", "output": "5"}
FUNCTION_TEST = "assert add(2, 3) == 5"


def load_baseline(ref: str, where: Path) -> Any:
    """The CodeExecution class of commit ``ref``, with its own sandbox modules."""
    for name in ("sandbox.py", "_sandbox_boot.py", "code_execution.py"):
        text = subprocess.run(
            ["git", "show", f"{ref}:builtin_rewards/{name}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        target = {"sandbox.py": "baseline_sandbox.py", "code_execution.py": "baseline_code_execution.py"}.get(name, name)
        (where / target).write_text(text.replace("builtin_rewards.sandbox", "baseline_sandbox"))
    sys.path.insert(0, str(where))
    return importlib.import_module("baseline_code_execution").CodeExecution


def seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8, help="completions per batch, one test each")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--baseline", default=None, help="a git commit whose sandbox to time as well")
    args = parser.parse_args()
    n = args.n
    prompts, completions = ["q"] * n, [SOLUTION] * n
    current = CodeExecution()
    cases: dict[str, Callable[[], Any]] = {
        f"reward, {n} x stdin test": lambda: current(prompts, completions, tests=[[STDIN_TEST]] * n),
        f"reward, {n} x function test": lambda: current(prompts, completions, tests=[[FUNCTION_TEST]] * n),
        "one run_python": lambda: run_python(SOLUTION, "2 3\n", SandboxLimits()),
        "one run_function_test": lambda: run_function_test(SOLUTION, FUNCTION_TEST, SandboxLimits()),
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            old = load_baseline(args.baseline, Path(tmp))()
            cases[f"baseline {args.baseline}: reward, {n} x stdin test"] = lambda: old(
                prompts, completions, tests=[[STDIN_TEST]] * n
            )
            cases[f"baseline {args.baseline}: reward, {n} x assert test"] = lambda: old(
                prompts, completions, tests=[[FUNCTION_TEST]] * n
            )
        for fn in cases.values():  # warm-up (and a check that every case scores)
            fn()
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):  # interleaved: every case sees the same load
            for name, fn in cases.items():
                times[name].append(seconds(fn))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (CPU only)",
        "python": sys.version.split()[0],
        "seconds_median": {name: round(statistics.median(t), 4) for name, t in times.items()},
        "seconds_min": {name: round(min(t), 4) for name, t in times.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
