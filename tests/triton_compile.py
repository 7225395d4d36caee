"""Compile a Triton kernel for an sm_90 GPU on a CPU-only machine: Triton's front end, its
lowering and ptxas, with no device. It shows what the interpreter cannot (a construct the
compiler refuses, a shape a real ``tl.dot`` rejects) for kernels that only run on a GPU."""

from __future__ import annotations

from typing import Any

import pytest


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
