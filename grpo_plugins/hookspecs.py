"""The hooks a grpo-plugins plugin may implement.

A plugin is a module (named by an entry point in the ``grpo_plugins`` group) that implements
one or more of these hooks, each decorated with ``@grpo_plugins.hookimpl``. Every hook receives a
``register`` callback and calls it once per component it provides::

    from grpo_plugins import hookimpl

    @hookimpl
    def register_rewards(register):
        register(my_reward)                  # name taken from the function's __name__
        register(MyReward, name="my_reward_with_params")

``register(obj, name=None, doc=None)``: ``obj`` is the component (see :mod:`grpo_plugins.kinds`
for what each kind must provide), ``name`` defaults to ``obj.name`` or ``obj.__name__``, ``doc``
to the first paragraph of its docstring. A component that declares a pydantic model as
``obj.Params`` receives its validated parameters when it is built.

The hooks are called once, when the registry is first used. A hook that raises marks its plugin
as broken (shown by ``grpo-plugins list``); the other plugins keep working.
"""

from __future__ import annotations

import pluggy

PROJECT = "grpo_plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_rewards(register):  # type: ignore[no-untyped-def]
    """Register reward functions (kind ``reward``).

    A reward is called as ``fn(prompts, completions, completion_ids=..., **dataset_columns)`` and
    returns one ``float`` or ``None`` ("not applicable") per completion, exactly as in TRL.
    """


@hookspec
def register_loss_types(register):  # type: ignore[no-untyped-def]
    """Register loss types (kind ``loss_type``): how the per-token loss is formed and reduced.

    See :class:`grpo_plugins.kinds.LossType`.
    """


@hookspec
def register_importance_sampling_levels(register):  # type: ignore[no-untyped-def]
    """Register importance-sampling levels (kind ``importance_sampling``): token, sequence, ...

    See :class:`grpo_plugins.kinds.ImportanceSampling`.
    """


@hookspec
def register_reward_scalings(register):  # type: ignore[no-untyped-def]
    """Register reward scalings (kind ``reward_scaling``): combined rewards to advantages.

    See :class:`grpo_plugins.kinds.RewardScaling`.
    """


@hookspec
def register_rollout_corrections(register):  # type: ignore[no-untyped-def]
    """Register rollout corrections (kind ``rollout_correction``) for sampler/trainer mismatch.

    See :class:`grpo_plugins.kinds.RolloutCorrection`.
    """


@hookspec
def register_generators(register):  # type: ignore[no-untyped-def]
    """Register generation backends (kind ``generator``).

    See :class:`grpo_plugins.kinds.Generator`.
    """


@hookspec
def register_tasks(register):  # type: ignore[no-untyped-def]
    """Register tasks (kind ``task``): a dataset plus its default rewards.

    See :class:`grpo_plugins.kinds.Task`.
    """
