"""The hooks a grpo-plugins plugin may implement: one registration hook per component kind.

A plugin is a module, named by an entry point in the ``grpo_plugins`` group, that implements one
or more of these hooks, each decorated with ``@grpo_plugins.hookimpl``::

    from grpo_plugins import hookimpl

    @hookimpl
    def register_rewards(register):
        register(my_reward)                          # named after my_reward.__name__
        register(MyReward, name="my_reward_with_params")

Every hook receives one argument, ``register(obj, name=None, doc=None)``, and calls it once per
component: ``obj`` is the component (a class, or for rewards and tools also a function; what
each kind implements is in :mod:`grpo_plugins.kinds`), ``name`` defaults to ``obj.name`` then
``obj.__name__``, ``doc`` to the first paragraph of the docstring.

When each hook is called: when the registry is first used (the first ``grpo-plugins list``,
``validate`` or run of a process), once for all installed plugins together, so ``tryfirst``,
``trylast`` and ``wrapper=True`` work as in any pluggy project; a plugin added later
(``Registry.add_plugin``) is called on its own when it is added. A hook that raises marks only
its own plugin broken (``grpo-plugins list`` shows it); nothing it registered is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "grpo_plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: The callback a registration hook receives: ``register(obj, name=None, doc=None)``.
Register = Callable[..., Any]


@hookspec
def register_rewards(register: Register) -> None:
    """Register reward functions (kind ``reward``).

    Args:
        register: call it once per reward. A reward is a function (or a class whose instances
            are called) ``fn(prompts, completions, completion_ids=None, **dataset_columns)``
            returning one float, or None for "not applicable", per completion (TRL's contract).
    """


@hookspec
def register_loss_types(register: Register) -> None:
    """Register loss types (kind ``loss_type``): how the per-token loss is formed and reduced.

    Args:
        register: call it once per loss type, a class like :class:`grpo_plugins.kinds.LossType`.
    """


@hookspec
def register_importance_sampling_levels(register: Register) -> None:
    """Register importance-sampling levels (kind ``importance_sampling``): token, sequence, ...

    Args:
        register: call it once per level, a class like
            :class:`grpo_plugins.kinds.ImportanceSampling`.
    """


@hookspec
def register_reward_scalings(register: Register) -> None:
    """Register reward scalings (kind ``reward_scaling``): combined rewards to advantages.

    Args:
        register: call it once per scaling, a class like :class:`grpo_plugins.kinds.RewardScaling`.
    """


@hookspec
def register_rollout_corrections(register: Register) -> None:
    """Register rollout corrections (kind ``rollout_correction``) for a sampler that is not the
    trained policy.

    Args:
        register: call it once per correction, a class like
            :class:`grpo_plugins.kinds.RolloutCorrection`.
    """


@hookspec
def register_generators(register: Register) -> None:
    """Register generation backends (kind ``generator``).

    Args:
        register: call it once per backend, a class like :class:`grpo_plugins.kinds.Generator`.
    """


@hookspec
def register_environments(register: Register) -> None:
    """Register environments (kind ``environment``): what a rollout is (one turn, several, tools).

    Args:
        register: call it once per environment, a class like
            :class:`grpo_plugins.kinds.Environment`.
    """


@hookspec
def register_tools(register: Register) -> None:
    """Register tools (kind ``tool``) that a tool-calling environment offers the model.

    Args:
        register: call it once per tool, a plain function with type hints and a Google-style
            docstring (TRL's convention).
    """


@hookspec
def register_group_filters(register: Register) -> None:
    """Register group filters (kind ``group_filter``): DAPO's dynamic sampling of informative
    groups.

    Args:
        register: call it once per filter, a class like :class:`grpo_plugins.kinds.GroupFilter`.
    """


@hookspec
def register_tasks(register: Register) -> None:
    """Register tasks (kind ``task``): a dataset plus its default rewards.

    Args:
        register: call it once per task, a class like :class:`grpo_plugins.kinds.Task`.
    """
