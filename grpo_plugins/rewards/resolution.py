"""Resolving the rewards of a run: names (as :meth:`grpo_plugins.registry.Registry.get` resolves
them: ``name``, ``dist:name`` or an import path), the task's default rewards, and the reward
weights."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from grpo_plugins.config import GRPOConfig, RewardSpec
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.registry import Component, ComponentImportError, Registry, get_registry


class RewardConfigError(GRPOPluginsError, ValueError):
    """The rewards of a run are misconfigured (unknown name, bad params, weights)."""


def reward_weights_mismatch(weights: Sequence[float] | None, names: Sequence[str]) -> str | None:
    """What is wrong with ``reward_weights`` for rewards called ``names`` (one weight each, in
    order), or None when nothing is."""
    if weights is None or len(weights) == len(names):
        return None
    return (
        f"has {len(weights)} values but the run has {len(names)} rewards ({', '.join(names)}); "
        "give one weight per reward, in the same order"
    )


def resolve_reward(name: str, registry: Registry | None = None) -> Component:
    """The reward component named ``name``: a registered name, ``dist:name``, or an import path
    (``module:attr`` or ``package.module.attr``), as :meth:`Registry.get` resolves every kind.

    Raises:
        UnknownComponentError / DuplicateComponentError: from the registry, for names.
        RewardConfigError: an import path that does not import.
    """
    try:
        return (registry or get_registry()).get("reward", name)
    except ComponentImportError as exc:
        raise RewardConfigError(str(exc)) from None


def as_spec(entry: str | RewardSpec | dict[str, Any], where: str) -> RewardSpec:
    if isinstance(entry, RewardSpec):
        return entry
    if isinstance(entry, str):
        return RewardSpec(name=entry)
    try:
        return RewardSpec.model_validate(entry)
    except ValidationError as exc:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" if e["loc"] else e["msg"] for e in exc.errors()
        )
        raise RewardConfigError(f"{where}: {detail}") from None


def reward_specs_for(config: GRPOConfig, task: Any = None) -> list[RewardSpec]:
    """The run's rewards: ``config.rewards``, or the task's ``default_rewards`` when that is empty,
    each with its own weight (``config.reward_weights`` replaces those in :class:`RewardRunner`).

    ``task`` may be a built task, a registry :class:`Component` of kind task, or None.
    """
    entries: Sequence[Any] = config.rewards
    if not entries and task is not None:
        obj = task.obj if isinstance(task, Component) else task
        entries = list(getattr(obj, "default_rewards", []) or [])
    if not entries:
        raise RewardConfigError(
            "the run has no rewards: list some under 'rewards:' or choose a 'task:' with default rewards"
        )
    where = "rewards" if config.rewards else "task.default_rewards"
    return [as_spec(e, f"{where}.{i}") for i, e in enumerate(entries)]
