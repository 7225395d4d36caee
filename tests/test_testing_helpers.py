"""The plugin-author helpers of grpo_plugins.testing: temporary registration and contract checks."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from grpo_plugins import compute_loss, get_registry, hookimpl
from grpo_plugins.kinds import KINDS, LossType
from grpo_plugins.registry import DuplicateComponentError, PluginLoadError, Registry, UnknownComponentError
from grpo_plugins.testing import (
    INTERFACES,
    ComponentContractError,
    check_component,
    check_plugin,
    interface_signatures,
    isolated_registry,
    registered_component,
    registered_plugin,
)


class HalfLoss(LossType):
    """Half of the masked token mean (a toy loss type)."""

    def reduce(self, per_token_loss: torch.Tensor, inputs: Any) -> torch.Tensor:
        return 0.5 * (per_token_loss * inputs.mask).sum() / inputs.mask.sum().clamp(min=1.0)


def make_plugin(**hooks: Any) -> types.ModuleType:
    module = types.ModuleType("throwaway_plugin")
    for name, fn in hooks.items():
        setattr(module, name, fn)
    return module


def loss_plugin() -> types.ModuleType:
    @hookimpl
    def register_loss_types(register: Any) -> None:
        register(HalfLoss, name="half_loss")

    return make_plugin(register_loss_types=register_loss_types)


# -- registering for one test -------------------------------------------------------------------


def test_registered_plugin_is_visible_inside_and_gone_after() -> None:
    plugin = loss_plugin()
    with registered_plugin(plugin, distribution="my-dist", version="1.2") as registry:
        assert registry is get_registry()
        component = registry.get("loss_type", "my-dist:half_loss")
        assert (component.distribution, component.version) == ("my-dist", "1.2")
        loss, _ = compute_loss(
            torch.zeros(1, 2), None, torch.tensor([2.0]), torch.ones(1, 2), loss_type="half_loss"
        )
        assert loss.item() == pytest.approx(-1.0)  # on-policy per_token = -A = -2, halved
    assert "half_loss" not in get_registry().names("loss_type")
    with registered_plugin(plugin):  # the same module again: pluggy was restored too
        assert "half_loss" in get_registry().names("loss_type")


def test_registered_plugin_restores_the_registry_after_a_duplicate_name() -> None:
    registry = Registry(entry_points=False)
    registry.register("loss_type", "half_loss", HalfLoss, distribution="<test>")
    before = registry.get("loss_type", "half_loss")
    with registered_plugin(loss_plugin(), registry=registry):
        # Another module of the same distribution registering the name is a duplicate.
        with pytest.raises(DuplicateComponentError, match="registered by 2 plugins of <test>"):
            registry.get("loss_type", "half_loss")
    assert registry.get("loss_type", "half_loss") is before


def test_registered_plugin_raises_the_hook_error_and_leaves_nothing_broken() -> None:
    @hookimpl
    def register_rewards(register: Any) -> None:
        raise RuntimeError("bug in my plugin")

    registry = Registry(entry_points=False)
    with pytest.raises(PluginLoadError, match="bug in my plugin"):
        with registered_plugin(make_plugin(register_rewards=register_rewards), registry=registry):
            pass
    assert registry.broken == []


def test_registered_plugin_refuses_an_already_registered_plugin() -> None:
    plugin = loss_plugin()
    registry = Registry(entry_points=False)
    registry.add_plugin(plugin)
    with pytest.raises(PluginLoadError, match="already registered.*isolated_registry"):
        with registered_plugin(plugin, registry=registry):
            pass


def test_registered_component_is_temporary() -> None:
    def shouting(prompts: list, completions: list, **kwargs: Any) -> list[float]:
        return [float(c.isupper()) for c in completions]

    with registered_component("reward", shouting) as component:
        assert get_registry().get("reward", "shouting") is component
    with pytest.raises(UnknownComponentError):
        get_registry().get("reward", "shouting")


def test_isolated_registry_holds_only_the_plugin_and_puts_the_old_one_back() -> None:
    outer = get_registry()
    with isolated_registry(loss_plugin()) as registry:
        assert get_registry() is registry is not outer
        assert registry.names("loss_type") == ["half_loss"]
    assert get_registry() is outer


# -- the interface table ------------------------------------------------------------------------


def test_every_kind_has_an_interface_with_signatures() -> None:
    assert set(INTERFACES) == set(KINDS)
    assert interface_signatures("importance_sampling") == [
        "log_weights(self, log_ratio: Tensor, mask: Tensor) -> Tensor"
    ]


# -- contract checks: good components pass --------------------------------------------------------

REWARD_SAMPLE = {"completions": ["<answer>4</answer>", "4", "x"], "answer": ["4", "4", "5"]}
REWARD_PARAMS = {"json_schema": {"schema": {"type": "object"}}}
NOT_CHECKED = {  # need more than a sample: a model file, a sandbox per test case
    ("reward", "reward_model"),
    ("reward", "code_execution"),
}


@pytest.mark.parametrize(
    "component",
    [c for c in get_registry().components() if (c.kind, c.name) not in NOT_CHECKED],
    ids=lambda c: f"{c.kind}:{c.name}",
)
def test_every_installed_component_passes_its_contract(component: Any) -> None:
    check_component(
        component.kind,
        component.obj,
        name=component.name,
        params=REWARD_PARAMS.get(component.name) if component.kind == "reward" else None,
        sample=REWARD_SAMPLE,
    )


def test_a_reward_needing_a_column_passes_with_a_sample_of_it() -> None:
    def matches(completions: list[str], answer: list[str]) -> list[float]:
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    with pytest.raises(ComponentContractError, match="answer.*sample="):
        check_component("reward", matches)
    check_component("reward", matches, sample={"completions": ["4", "5"], "answer": ["4", "4"]})


def test_an_async_reward_passes() -> None:
    async def positive(prompts: list, completions: list, **kwargs: Any) -> list[float]:
        return [1.0] * len(completions)

    assert check_component("reward", positive) is positive


def test_check_component_returns_the_built_component_with_params() -> None:
    class Scaled:
        """Constant reward."""

        class Params(BaseModel):
            value: float

        def __init__(self, params: Params) -> None:
            self.value = params.value

        def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
            return [self.value] * len(completions)

    with pytest.raises(ComponentContractError, match="pass params="):
        check_component("reward", Scaled)
    assert check_component("reward", Scaled, params={"value": 2.0}).value == 2.0


# -- contract checks: each violation is named ------------------------------------------------------


def problems_of(kind: str, obj: Any, **kwargs: Any) -> list[str]:
    with pytest.raises(ComponentContractError) as info:
        check_component(kind, obj, **kwargs)
    return info.value.problems


def test_a_loss_type_without_reduce_is_not_implemented() -> None:
    class NoReduce(LossType):
        pass

    assert problems_of("loss_type", NoReduce) == [
        "reduce is not implemented (it is inherited from LossType, which raises NotImplementedError)"
    ]


def test_a_loss_type_that_counts_masked_tokens_is_caught() -> None:
    class Unmasked(LossType):
        def reduce(self, per_token_loss: torch.Tensor, inputs: Any) -> torch.Tensor:
            return per_token_loss.mean()

    problems = problems_of("loss_type", Unmasked)
    assert "masked positions: multiply the per-token loss by inputs.mask" in problems[0]
    assert "with every token masked" in problems[1]


def test_a_loss_type_with_an_unclamped_denominator_is_caught() -> None:
    class Unclamped(LossType):
        def reduce(self, per_token_loss: torch.Tensor, inputs: Any) -> torch.Tensor:
            return (per_token_loss * inputs.mask).sum() / inputs.mask.sum()

    (problem,) = problems_of("loss_type", Unclamped)
    assert "exactly 0" in problem and "nan" in problem


def test_a_loss_type_returning_a_vector_is_caught() -> None:
    class PerRow(LossType):
        def reduce(self, per_token_loss: torch.Tensor, inputs: Any) -> torch.Tensor:
            return (per_token_loss * inputs.mask).sum(-1)

    assert problems_of("loss_type", PerRow) == ["reduce returned shape (3,); expected ()"]


def test_wrong_method_signatures_are_listed_together() -> None:
    class Confused:
        def per_token_loss(self) -> None: ...

        def reduce(self, loss: torch.Tensor, inputs: Any) -> torch.Tensor: ...  # names are free

    assert problems_of("loss_type", Confused) == [
        "per_token_loss() -> None cannot be called as per_token_loss(self, inputs: LossInputs) -> Tensor"
        " (too many positional arguments)",
        "missing method: metrics(self, inputs: LossInputs) -> dict[str, Tensor | RowExtremum]",
    ]


def test_an_importance_sampling_level_that_detaches_is_caught() -> None:
    class Detached:
        def log_weights(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return log_ratio.detach()

    (problem,) = problems_of("importance_sampling", Detached)
    assert "no gradient" in problem


def test_an_importance_sampling_level_off_one_on_policy_is_caught() -> None:
    class Shifted:
        def log_weights(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return log_ratio + 0.1

    (problem,) = problems_of("importance_sampling", Shifted)
    assert "on-policy" in problem


def test_a_reward_scaling_that_divides_by_a_zero_std_is_caught() -> None:
    class Unsafe:
        def advantages(self, rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
            groups = rewards.view(-1, num_generations)
            return ((groups - groups.nanmean(1, keepdim=True)) / groups.std(1, keepdim=True)).view(-1)

    (problem,) = problems_of("reward_scaling", Unsafe)
    assert "not finite" in problem


def test_a_rollout_correction_above_the_cap_is_caught() -> None:
    class Untruncated:
        def weights(self, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
            return torch.exp(old - sampling)

    (problem,) = problems_of("rollout_correction", Untruncated)
    assert problem.startswith("weights must lie in [0, cap=2.0]")


def test_a_reward_returning_the_wrong_length_or_type_is_caught() -> None:
    def short(prompts: list, completions: list, **kwargs: Any) -> list[float]:
        return [1.0]

    def words(prompts: list, completions: list, **kwargs: Any) -> list[str]:
        return ["good"] * len(completions)

    def positional(prompts, completions, /):  # type: ignore[no-untyped-def]
        return [0.0] * len(completions)

    assert problems_of("reward", short) == ["it returned 1 values for 3 completions"]
    assert "each value must be a float, or None" in problems_of("reward", words)[0]
    assert "keyword arguments only" in problems_of("reward", positional)[0]


def test_params_that_are_not_pydantic_cannot_register() -> None:
    class BadParams:
        Params = dict

        def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
            return [0.0] * len(completions)

    (problem,) = problems_of("reward", BadParams)
    assert "Params must be a pydantic BaseModel" in problem


def test_a_task_without_a_prompt_column_is_caught() -> None:
    import datasets

    class NoPrompt:
        default_rewards = ["format", {"weight": 2.0}]

        def load(self, seed: int) -> Any:
            return datasets.Dataset.from_list([{"question": "1+1"}])

    problems = problems_of("task", NoPrompt)
    assert problems == [
        "default_rewards[1] must be a reward name or a mapping with 'name', got {'weight': 2.0}",
        "the dataset from load has no 'prompt' column (columns: ['question'])",
    ]


# -- check_plugin --------------------------------------------------------------------------------


def test_check_plugin_returns_the_components_of_a_good_plugin() -> None:
    (component,) = check_plugin(loss_plugin())
    assert (component.kind, component.name) == ("loss_type", "half_loss")


def test_check_plugin_finds_a_misspelt_hook_and_a_missing_hookimpl() -> None:
    @hookimpl
    def register_loss_type(register: Any) -> None:
        register(HalfLoss)

    def register_rewards(register: Any) -> None:
        register(lambda prompts, completions, **kw: [0.0] * len(completions), name="zero")

    plugin = make_plugin(register_loss_type=register_loss_type, register_rewards=register_rewards)
    with pytest.raises(ComponentContractError) as info:
        check_plugin(plugin)
    assert info.value.problems == [
        "'register_loss_type' is marked @hookimpl but is not a grpo-plugins hook; did you mean 'register_loss_types'?",
        "'register_rewards' is not decorated with @grpo_plugins.hookimpl, so it is never called",
    ]


def test_check_plugin_names_the_broken_component() -> None:
    class NoReduce(LossType):
        pass

    @hookimpl
    def register_loss_types(register: Any) -> None:
        register(HalfLoss, name="good")
        register(NoReduce, name="bad")

    with pytest.raises(ComponentContractError) as info:
        check_plugin(make_plugin(register_loss_types=register_loss_types))
    assert [p.split(":")[0] for p in info.value.problems] == ["loss_type 'bad'"]
