"""Resolving the rewards of a run: names, ``dist:name`` and ``module:attr`` import paths, the
task's default rewards, and the reward weights.

How a name in ``rewards:`` is resolved (:func:`resolve_reward`):

1. ``name`` -- a registered reward (entry point or ``@grpo_plugins.reward``);
2. ``dist:name`` where ``dist`` is a distribution that registered rewards -- that one's reward;
3. ``module.path:attr`` otherwise -- imported (``attr`` may be dotted, e.g. ``Class.method``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from grpo_plugins.config import GRPOConfig, RewardSpec
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.registry import Component, Registry, get_registry, normalize_distribution

IMPORT_DISTRIBUTION = "<import>"


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


def _reward_distributions(registry: Registry) -> set[str]:
    return {normalize_distribution(c.distribution) for c in registry.components("reward")}


def _import_module(name: str) -> Any:
    """``importlib.import_module``, also finding a module in the current folder: ``python -m``
    and ``python script.py`` put their folder on the path, the ``grpo-plugins`` command does not,
    and a reward file next to the config is the common case."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = name.partition(".")[0]
        here = os.getcwd()
        local = Path(here, top).is_dir() or Path(here, f"{top}.py").is_file()
        if exc.name != top or not local or here in sys.path or "" in sys.path:
            raise
        sys.path.append(here)  # after everything installed: a local file never shadows a package
        return importlib.import_module(name)


def _import_attr(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise RewardConfigError(f"reward import path '{path}' must look like 'module.path:function'")
    try:
        obj: Any = _import_module(module_name)
    except ImportError as exc:
        raise RewardConfigError(
            f"reward '{path}': cannot import module '{module_name}' ({exc}); it is neither a "
            "registered reward nor an importable 'module:function' path"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RewardConfigError(
                f"reward '{path}': module '{module_name}' has no attribute '{attr}'"
            ) from None
    return obj


def resolve_reward(name: str, registry: Registry | None = None) -> Component:
    """The reward component named ``name``: a registered name, ``dist:name``, or ``module:attr``.

    A ``dist:name`` whose ``dist`` is a distribution that registered rewards always means that
    distribution's reward; any other ``a:b`` is imported as ``from a import b``.

    Raises:
        UnknownComponentError / DuplicateComponentError: from the registry, for bare names.
        RewardConfigError: an import path that does not import.
    """
    registry = registry or get_registry()
    if ":" not in name:
        return registry.get("reward", name)
    prefix = name.rpartition(":")[0]
    if normalize_distribution(prefix) in _reward_distributions(registry):
        return registry.get("reward", name)
    obj = _import_attr(name)
    if not callable(obj):
        raise RewardConfigError(f"reward '{name}' is a {type(obj).__name__}, not a callable")
    return Component(
        kind="reward",
        name=getattr(obj, "__name__", name.rpartition(":")[2].rpartition(".")[2]),
        obj=obj,
        distribution=IMPORT_DISTRIBUTION,
        version=None,
        plugin=name,
        doc=(inspect.getdoc(obj) or "").split("\n\n")[0],
    )


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
    with ``config.reward_weights`` (when given) replacing each reward's own weight.

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
    specs = [as_spec(e, f"{where}.{i}") for i, e in enumerate(entries)]
    problem = reward_weights_mismatch(config.reward_weights, [s.name for s in specs])
    if problem is not None:
        raise RewardConfigError(f"reward_weights {problem}")
    if config.reward_weights is not None:
        specs = [s.model_copy(update={"weight": float(w)}) for s, w in zip(specs, config.reward_weights)]
    return specs
