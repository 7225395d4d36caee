"""Scoring completions: resolving reward components and running them (the TRL reward contract).

A reward is any callable ``fn(prompts, completions, completion_ids=..., **columns)`` returning one
``float`` or ``None`` ("not applicable") per completion, plain or ``async def`` -- exactly TRL's
contract, so existing TRL/Unsloth reward functions work unchanged.

* :mod:`~grpo_plugins.rewards.resolution`: names to components, the task's default rewards, the
  weights;
* :mod:`~grpo_plugins.rewards.runner`: :class:`RewardRunner`, which calls them concurrently and
  checks what they return;
* :mod:`~grpo_plugins.rewards.worker`: the worker processes of ``executor: process`` rewards.
"""

from __future__ import annotations

from grpo_plugins.registry import IMPORT_DISTRIBUTION
from grpo_plugins.rewards.resolution import (
    RewardConfigError,
    resolve_reward,
    reward_specs_for,
    reward_weights_mismatch,
)
from grpo_plugins.rewards.runner import RewardError, RewardRunner, reward_runner

__all__ = [
    "IMPORT_DISTRIBUTION",
    "RewardConfigError",
    "RewardError",
    "RewardRunner",
    "resolve_reward",
    "reward_runner",
    "reward_specs_for",
    "reward_weights_mismatch",
]
