"""Shared fixtures: tiny random models and a locally built tokenizer (never the hub)."""

from __future__ import annotations

import pytest

from grpo_plugins.testing import tiny_model_spec


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The ``model:`` mapping for a tiny random Llama with a character-level tokenizer."""
    return tiny_model_spec(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The ``model:`` mapping for a tiny random Qwen2 with a character-level tokenizer."""
    return tiny_model_spec(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")
