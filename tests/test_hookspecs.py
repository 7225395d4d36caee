"""Every hookspec has a test named ``test_hook_<hookspec>``: it registers a tiny plugin that
implements only that hook and finds the component in the registry, under that kind alone and
attributed to the plugin's distribution."""

from __future__ import annotations

import sys
import types
from typing import Any

from grpo_plugins import hookimpl, hookspecs
from grpo_plugins.kinds import KINDS, Environment, GroupFilter, LossType, Task
from grpo_plugins.registry import Component, Registry

HOOKSPECS = [name for name, fn in vars(hookspecs).items() if hasattr(fn, f"{hookspecs.PROJECT}_spec")]


def registered_through(hook: str, obj: Any, name: str) -> Component:
    """Register ``obj`` as ``name`` through a plugin implementing only ``hook`` (distribution
    tiny-plugin 0.1) and return what the registry finds under that name; it must be found
    under exactly one kind."""

    @hookimpl
    def implementation(register: Any) -> None:
        register(obj, name=name)

    plugin = types.ModuleType(f"tiny_{hook}")
    setattr(plugin, hook, implementation)
    registry = Registry(entry_points=False)
    registry.add_plugin(plugin, distribution="tiny-plugin", version="0.1")
    assert registry.broken == []
    (component,) = registry.find(name)
    assert (component.obj, component.distribution, component.version) == (obj, "tiny-plugin", "0.1")
    assert component.plugin == f"tiny_{hook}"
    return component


def test_every_hookspec_has_a_test() -> None:
    tests = {name for name in vars(sys.modules[__name__]) if name.startswith("test_hook_")}
    assert len(HOOKSPECS) == len(KINDS) == 10
    assert tests == {f"test_hook_{hook}" for hook in HOOKSPECS}


def test_hook_register_rewards() -> None:
    def shortness(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        """Minus the length."""
        return [-float(len(c)) for c in completions]

    component = registered_through("register_rewards", shortness, "shortness")
    assert component.kind == "reward" and component.doc == "Minus the length."
    assert component.build()(["p", "p"], ["ab", "abcd"]) == [-2.0, -4.0]


def test_hook_register_loss_types() -> None:
    class Mean(LossType):
        def reduce(self, per_token_loss: Any, inputs: Any) -> Any:
            return per_token_loss.mean()

    assert registered_through("register_loss_types", Mean, "tiny_mean").kind == "loss_type"


def test_hook_register_importance_sampling_levels() -> None:
    class Zero:
        def log_weights(self, log_ratio: Any, mask: Any) -> Any:
            return log_ratio * 0

    assert registered_through("register_importance_sampling_levels", Zero, "zero").kind == "importance_sampling"


def test_hook_register_reward_scalings() -> None:
    class Raw:
        def advantages(self, rewards: Any, num_generations: int) -> Any:
            return rewards

    assert registered_through("register_reward_scalings", Raw, "raw").kind == "reward_scaling"


def test_hook_register_rollout_corrections() -> None:
    class Ones:
        def weights(self, old: Any, sampling: Any, mask: Any, cap: float) -> Any:
            return mask

    assert registered_through("register_rollout_corrections", Ones, "ones").kind == "rollout_correction"


def test_hook_register_generators() -> None:
    from grpo_plugins.kinds import Generator

    class Silent(Generator):
        """Generates nothing."""

    assert registered_through("register_generators", Silent, "silent").kind == "generator"


def test_hook_register_environments() -> None:
    class Quiet(Environment):
        """Never runs."""

    assert registered_through("register_environments", Quiet, "quiet").kind == "environment"


def test_hook_register_tools() -> None:
    def double(x: int) -> int:
        """Double a number.

        Args:
            x: The number.
        """
        return 2 * x

    component = registered_through("register_tools", double, "double")
    assert component.kind == "tool" and component.build()(x=21) == 42


def test_hook_register_group_filters() -> None:
    class KeepNone(GroupFilter):
        def keep(self, rewards: Any, total: Any, names: list[str], num_generations: int) -> Any:
            return total[::num_generations] != total[::num_generations]

    assert registered_through("register_group_filters", KeepNone, "keep_none").kind == "group_filter"


def test_hook_register_tasks() -> None:
    class Empty(Task):
        default_rewards = ["format"]

    component = registered_through("register_tasks", Empty, "empty")
    assert component.kind == "task" and component.build().default_rewards == ["format"]

