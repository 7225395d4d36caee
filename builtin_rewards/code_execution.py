"""Code-execution reward: run the completion's Python against test cases in the sandbox."""

from __future__ import annotations

import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from builtin_rewards._text import column, completion_text
from builtin_rewards.sandbox import (
    Isolation,
    SandboxLimits,
    check_isolation,
    host_bounds,
    run_function_test,
    run_python,
)

logger = logging.getLogger(__name__)
_LOGGED: list[bool] = []  # the host's bounds are said once per process

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> str:
    """The last fenced code block of a completion, or the whole text when there is none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _same_output(got: str, expected: str) -> bool:
    def lines(s: str) -> list[str]:
        return [line.rstrip() for line in s.strip().splitlines()]

    return lines(got) == lines(expected)


class CodeExecution:
    """Fraction of the test cases the completion's Python code passes, run in a sandbox.

    Test cases come from a dataset column (``tests``), per sample a list (or its JSON string)
    of either ``{"input": stdin, "output": expected stdout}`` mappings (the program runs with
    that stdin; the reward compares its stdout) or strings of Python test code (e.g.
    ``assert square(3) == 9``), which run in a trusted sandbox of their own that calls the
    completion's functions in another sandbox and gets back only plain data. Either way the
    verdict is decided outside the completion's process: exiting early, printing, or rewriting
    hooks cannot pass a test. Each test is a fresh sandbox (:mod:`builtin_rewards.sandbox`)
    killed after ``timeout`` seconds. A completion can make a test fail, never the reward raise.
    """

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        column: str = Field("tests", description="Dataset column holding each sample's test cases.")
        timeout: float = Field(5.0, gt=0, description="Wall-clock seconds per test before the sandbox is killed.")
        cpu_seconds: int = Field(5, ge=1, description="CPU-time limit per test (RLIMIT_CPU).")
        memory_mb: int = Field(
            512, ge=16, description="Address-space limit per test (RLIMIT_AS); its cgroup's bound adds disk_mb + 64 MiB."
        )
        max_output_bytes: int = Field(1 << 20, ge=1024, description="Output and file-size limit (RLIMIT_FSIZE).")
        disk_mb: int = Field(64, ge=1, description="Size of the sandbox's writable tmpfs.")
        max_workers: int | None = Field(None, ge=1, description="Tests run in parallel; default: CPU count.")
        all_or_nothing: bool = Field(False, description="1.0 only when every test passes, else 0.0.")
        sandbox: Isolation = Field(
            "bwrap",
            description="bwrap (bubblewrap; required by default) or unsafe_local: a plain process with "
            "rlimits, Landlock and an audit hook, which does not contain hostile code.",
        )

    def __init__(self, params: Params | None = None) -> None:
        self.params = p = params or self.Params()
        check_isolation(p.sandbox)
        if p.sandbox == "bwrap" and not _LOGGED:
            _LOGGED.append(True)
            text, bounded = host_bounds()
            (logger.info if bounded else logger.warning)("code_execution sandbox: %s", text)
        self.limits = SandboxLimits(
            timeout=p.timeout,
            cpu_seconds=p.cpu_seconds,
            memory_mb=p.memory_mb,
            max_output_bytes=p.max_output_bytes,
            disk_mb=p.disk_mb,
        )

    def _run_test(self, code: str, test: str | dict[str, Any]) -> bool:
        try:
            if isinstance(test, str):
                return run_function_test(code, test, self.limits, isolation=self.params.sandbox)
            result = run_python(code, str(test.get("input", "")), self.limits, isolation=self.params.sandbox)
            return result.ok and _same_output(result.stdout, str(test["output"]))
        except Exception:  # noqa: BLE001 - whatever a completion provokes, it scores 0 for this test
            return False

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        p = self.params
        tests = column(kwargs, p.column, "code_execution", len(completions))
        jobs: list[tuple[int, str, str | dict[str, Any]]] = []
        counts = []
        for i, (completion, cases) in enumerate(zip(completions, tests)):
            cases = json.loads(cases) if isinstance(cases, str) else list(cases or [])
            for case in cases:
                if not isinstance(case, str) and not (isinstance(case, dict) and "output" in case):
                    raise ValueError(f"a test case must be a string or an {{input, output}} mapping, got {case!r}")
            counts.append(len(cases))
            code = extract_code(completion_text(completion))
            jobs.extend((i, code, case) for case in cases)
        passed = [0] * len(completions)
        # Each job ends within its timeout, so a batch takes at most ceil(len(jobs) / workers) timeouts.
        with ThreadPoolExecutor(max_workers=p.max_workers or os.cpu_count() or 1) as pool:
            futures = []
            for _, code, case in jobs:
                try:
                    futures.append(pool.submit(self._run_test, code, case))
                except RuntimeError:  # no thread could be started (the host is short of tasks): run it here
                    futures.append(None)
            for (i, code, case), future in zip(jobs, futures):
                passed[i] += int(future.result() if future is not None else self._run_test(code, case))
        out = []
        for n_passed, n_tests in zip(passed, counts):
            if n_tests == 0:
                out.append(0.0)
            elif p.all_or_nothing:
                out.append(float(n_passed == n_tests))
            else:
                out.append(n_passed / n_tests)
        return out
