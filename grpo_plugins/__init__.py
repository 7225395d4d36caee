"""grpo-plugins: a GRPO trainer in which every algorithmic choice is a plugin.

Public API: :func:`compute_loss`, :func:`compute_advantages`, :class:`GRPOConfig`,
:class:`Engine`, the registry (:func:`get_registry`, :func:`register` and one registering
decorator per component kind: ``@grpo_plugins.reward("name")``, ...), :func:`completion_text`
(the text of a completion as a reward receives it), and the ``grpo-plugins`` command line.

Heavy modules (torch, transformers) are imported on first use, so that ``grpo-plugins list`` and
``grpo-plugins validate`` start quickly.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from grpo_plugins.config import ConfigError, GRPOConfig, load_config
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.hookspecs import hookimpl
from grpo_plugins.kinds import completion_text
from grpo_plugins.registry import (
    Registry,
    environment,
    generator,
    get_registry,
    group_filter,
    importance_sampling,
    loss_type,
    register,
    reward,
    reward_scaling,
    rollout_correction,
    task,
    tool,
)

__version__ = "0.1.0"

_LAZY = {
    "compute_loss": "grpo_plugins.objective",
    "Objective": "grpo_plugins.objective",
    "validate_config": "grpo_plugins.validation",
    "compute_advantages": "grpo_plugins.advantages",
    "Engine": "grpo_plugins.engine",
}

if TYPE_CHECKING:
    from grpo_plugins.advantages import compute_advantages
    from grpo_plugins.engine import Engine
    from grpo_plugins.objective import Objective, compute_loss
    from grpo_plugins.validation import validate_config


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'grpo_plugins' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "Engine",
    "GRPOConfig",
    "GRPOPluginsError",
    "Objective",
    "Registry",
    "completion_text",
    "compute_advantages",
    "compute_loss",
    "get_registry",
    "hookimpl",
    "load_config",
    "register",
    "validate_config",
    # one registering decorator per component kind
    "reward",
    "loss_type",
    "importance_sampling",
    "reward_scaling",
    "rollout_correction",
    "generator",
    "group_filter",
    "environment",
    "tool",
    "task",
]
