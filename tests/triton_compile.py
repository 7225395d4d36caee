"""Triton kernels checked on a CPU-only machine: :func:`run_interpreted` runs a script under
Triton's interpreter; :func:`compile_for_hopper` compiles a kernel for an sm_90 GPU (Triton's
front end, its lowering and ptxas, with no device), which shows what the interpreter cannot (a
construct the compiler refuses, a shape a real ``tl.dot`` rejects)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, *args: str) -> str:
    """Run ``script`` with ``TRITON_INTERPRET=1`` in a fresh Python (``sys.argv[1]`` the
    repository root, then ``args``); asserts that it exits 0 with its last line ``ok``, and
    returns its output. Skips where Triton is missing."""
    pytest.importorskip("triton", reason="Triton is part of the dev extra on Linux")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", script, str(ROOT), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def compile_for_hopper(kernel: Any, signature: dict[str, str], constants: dict[str, Any]) -> dict[str, Any]:
    """The compiled kernel's code by stage (``ttir`` ... ``ptx``, ``cubin``); skips the test
    where Triton or its CUDA back end (with ptxas) is missing. ``signature`` gives the type of
    every argument not in ``constants`` (``*bf16``, ``i32``, ...)."""
    triton = pytest.importorskip("triton", reason="Triton is part of the dev extra on Linux")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {name: ("constexpr" if name in constants else signature[name]) for name in kernel.arg_names}
    try:
        compiled = triton.compile(ASTSource(kernel, full, constants), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except (ImportError, FileNotFoundError) as exc:  # a Triton build without the CUDA back end or ptxas
        pytest.skip(f"Triton cannot compile for CUDA here: {exc}")
    return compiled.asm
