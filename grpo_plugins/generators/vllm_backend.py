"""The ``vllm`` generation backend (work in progress)."""

from __future__ import annotations

from typing import Any

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.kinds import Generator, SamplingSettings


class VLLMGenerator(Generator):
    """Sample with a colocated vLLM engine (not implemented yet)."""

    samples_from_policy = False

    def setup(self, model: Any, tokenizer: Any, sampling: SamplingSettings) -> None:
        raise GRPOPluginsError("the vllm generator is not implemented yet")
