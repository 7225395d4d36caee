"""Code-execution reward: run the completion's Python against test cases in the sandbox."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from builtin_rewards._text import column, completion_text
from builtin_rewards.sandbox import SandboxLimits, run_python

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
    of either ``{"input": stdin, "output": expected stdout}`` mappings or strings of Python
    (e.g. ``assert f(2) == 4``) appended to the program, which then must exit with status 0.
    Every test runs in its own sandboxed process (see :mod:`builtin_rewards.sandbox`): own temp
    directory, no writes outside it, CPU/memory/file-size limits, and killed after ``timeout``
    seconds -- an infinite loop costs ``timeout`` and scores 0 for that test.
    """

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        column: str = Field("tests", description="Dataset column holding each sample's test cases.")
        timeout: float = Field(5.0, gt=0, description="Wall-clock seconds per test before the process is killed.")
        cpu_seconds: int = Field(5, ge=1, description="CPU-time limit per test (RLIMIT_CPU).")
        memory_mb: int = Field(512, ge=16, description="Address-space limit per test (RLIMIT_AS).")
        max_output_bytes: int = Field(1 << 20, ge=1024, description="Output and file-size limit (RLIMIT_FSIZE).")
        max_workers: int | None = Field(None, ge=1, description="Tests run in parallel; default: CPU count.")
        all_or_nothing: bool = Field(False, description="1.0 only when every test passes, else 0.0.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = p = params or self.Params()
        self.limits = SandboxLimits(
            timeout=p.timeout, cpu_seconds=p.cpu_seconds, memory_mb=p.memory_mb, max_output_bytes=p.max_output_bytes
        )

    def _run_test(self, code: str, test: Any) -> bool:
        if isinstance(test, str):
            return run_python(f"{code}\n\n{test}\n", limits=self.limits).ok
        if isinstance(test, dict) and "output" in test:
            result = run_python(code, str(test.get("input", "")), self.limits)
            return result.ok and _same_output(result.stdout, str(test["output"]))
        raise ValueError(f"a test case must be a string or an {{input, output}} mapping, got {test!r}")

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        p = self.params
        tests = column(kwargs, p.column, "code_execution", len(completions))
        jobs: list[tuple[int, str, Any]] = []
        counts = []
        for i, (completion, cases) in enumerate(zip(completions, tests)):
            cases = json.loads(cases) if isinstance(cases, str) else list(cases or [])
            counts.append(len(cases))
            code = extract_code(completion_text(completion))
            jobs.extend((i, code, case) for case in cases)
        passed = [0] * len(completions)
        with ThreadPoolExecutor(max_workers=p.max_workers or os.cpu_count() or 1) as pool:
            for (i, _, _), ok in zip(jobs, pool.map(lambda job: self._run_test(job[1], job[2]), jobs)):
                passed[i] += int(ok)
        out = []
        for n_passed, n_tests in zip(passed, counts):
            if n_tests == 0:
                out.append(0.0)
            elif p.all_or_nothing:
                out.append(float(n_passed == n_tests))
            else:
                out.append(n_passed / n_tests)
        return out
