"""Shared fixtures: tiny random models and a locally built tokenizer (never the hub)."""

from __future__ import annotations

import os
from pathlib import Path

# Tiny models gain nothing from intra-op threads, and on a 2-core machine two threads per
# process (tests, workers and DDP subprocesses at once) fight for the cores. Set before torch
# is imported, so subprocesses inherit it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests never read or write the user's compile cache (tests of the cache name their own).
os.environ["GRPO_PLUGINS_COMPILE_CACHE"] = "off"

import pytest  # noqa: E402

from grpo_plugins.testing import tiny_model_spec  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _fresh_compiler_caches() -> object:
    """Each test file starts with torch.compile's in-process caches empty: the decode layer is
    compiled for many tiny models across files, and dynamo's recompile limit (8 per function)
    would otherwise make a file's outcome depend on which files ran before it."""
    import torch

    torch._dynamo.reset()
    yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The ``model:`` mapping for a tiny random Llama with a character-level tokenizer."""
    return tiny_model_spec(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The ``model:`` mapping for a tiny random Qwen2 with a character-level tokenizer."""
    return tiny_model_spec(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def one_process_run(tiny_model: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of test_distributed's config trained by one process (8 rows a
    micro-step): the reference that two-process runs in test_distributed and test_row_chunks
    compare with. The same run for each of them, so it runs once (per pytest worker)."""
    import test_distributed

    return test_distributed.one_process_run(tiny_model, tmp_path_factory.mktemp("one_process_run"))


@pytest.fixture()
def bwrap() -> None:
    """Skip a test that needs the bubblewrap sandbox where it is unusable -- but fail when the
    ``CI`` variable is set: CI installs bubblewrap (scripts/setup.sh) and must run these tests."""
    from builtin_rewards.sandbox import bwrap_problem

    problem = bwrap_problem()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the sandbox tests, but bubblewrap is unusable: {problem}")
        pytest.skip(f"bubblewrap is unusable here: {problem}")


@pytest.fixture()
def cache_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every KV cache the static decoder allocates from now on, in order."""
    import grpo_plugins.generators.static_decode as static_decode

    rows: list[int] = []
    allocate = static_decode.DecodeState.allocate

    def tracked(parts: object, B: int, *args: object) -> object:
        rows.append(B)
        return allocate(parts, B, *args)

    monkeypatch.setattr(static_decode.DecodeState, "allocate", staticmethod(tracked))
    return rows
