"""The ``single_turn`` environment: one completion per prompt (the default rollout)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_plugins.episodes import single_turn
from grpo_plugins.kinds import Environment, Episodes


class SingleTurn(Environment):
    """One completion per prompt, sampled by the run's generator in one call; every token is
    the model's. What a rollout was before environments existed."""

    def run(self, prompts: list[Any], prompt_ids: list[list[int]], columns: dict[str, list[Any]]) -> Episodes:
        return single_turn(self.generator.generate(prompt_ids))

    def run_beside(
        self, prompts: list[Any], prompt_ids: list[list[int]], columns: dict[str, list[Any]]
    ) -> Callable[[], Episodes] | None:
        call = self.generator.generate_beside(prompt_ids)
        return None if call is None else (lambda: single_turn(call()))
