"""Any component can be named by an import path, ``package.module:Attr`` or
``package.module.Attr``, without a plugin: each kind below is a class or function of this test
module named that way in a config, found and its params validated by ``validate`` (no model is
loaded), and built by the core as a registered component is."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import BaseModel, Field

from grpo_plugins import compute_loss
from grpo_plugins.kinds import Environment, Generator, GroupFilter, LossType, Task
from grpo_plugins.registry import ComponentImportError, Registry, UnknownComponentError, resolve_component
from grpo_plugins.validation import check_config

HERE = __name__  # the module as the config names it (tests/ is on sys.path)


def brevity(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """Minus the length of each completion."""
    return [-float(len(c)) for c in completions]


class HalfMean(LossType):
    """``scale`` times the masked token mean."""

    class Params(BaseModel):
        scale: float = Field(0.5, gt=0)

    def __init__(self, params: Params) -> None:
        self.scale = params.scale

    def reduce(self, per_token_loss: torch.Tensor, inputs: Any) -> torch.Tensor:
        return self.scale * (per_token_loss * inputs.mask).sum() / inputs.mask.sum().clamp(min=1.0)


class ZeroLevel:
    def log_weights(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return log_ratio * 0


class RawScaling:
    def advantages(self, rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
        return rewards


class OnesCorrection:
    def weights(self, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.ones_like(mask)


class Silent(Generator):
    """A generator that is only named, never run."""


class Quiet(Environment):
    """An environment that is only named, never run."""


class KeepEvery(GroupFilter):
    drops_groups = False

    def keep(self, rewards: torch.Tensor, total: torch.Tensor, names: list[str], num_generations: int) -> torch.Tensor:
        return torch.ones(total.shape[0] // num_generations, dtype=torch.bool)


class Tiny(Task):
    default_rewards = [f"{HERE}:brevity"]

    def load(self, seed: int) -> Any:
        import datasets

        return datasets.Dataset.from_list([{"prompt": "2+2="}])


def double(x: int) -> int:
    """Double a number.

    Args:
        x: The number.
    """
    return 2 * x


#: (config field, kind, attribute of this module)
SINGLE = [
    ("loss_type", "loss_type", "HalfMean"),
    ("importance_sampling_level", "importance_sampling", "ZeroLevel"),
    ("scale_rewards", "reward_scaling", "RawScaling"),
    ("rollout_correction", "rollout_correction", "OnesCorrection"),
    ("generator", "generator", "Silent"),
    ("environment", "environment", "Quiet"),
    ("group_filter", "group_filter", "KeepEvery"),
    ("task", "task", "Tiny"),
]


def _path(attr: str, form: str) -> str:
    return f"{HERE}:{attr}" if form == "colon" else f"{HERE}.{attr}"


@pytest.mark.parametrize("form", ["colon", "dotted"])
@pytest.mark.parametrize(("field", "kind", "attr"), SINGLE, ids=[k for _, k, _ in SINGLE])
def test_each_kind_by_import_path_validates_without_a_model(field: str, kind: str, attr: str, form: str) -> None:
    check = check_config({field: _path(attr, form), "rewards": [f"{HERE}:brevity"]}, Registry())
    assert check.problems == []
    component = check.components[field]
    assert component.kind == kind
    assert component.obj is globals()[attr]
    assert component.distribution == "<import>"


@pytest.mark.parametrize("form", ["colon", "dotted"])
def test_a_reward_by_import_path_validates_without_a_model(form: str) -> None:
    check = check_config({"rewards": [_path("brevity", form)]}, Registry())
    assert check.problems == []
    assert [component.obj for _, component in check.rewards] == [brevity]


def test_a_tool_by_import_path_validates_without_a_model() -> None:
    check = check_config({"environment": {"name": "tool_calling", "params": {"tools": [f"{HERE}:double"]}}}, Registry())
    assert check.problems == []
    assert Registry().build("tool", f"{HERE}.double")(x=21) == 42


def test_the_params_of_a_component_by_import_path_are_validated_before_a_model_loads() -> None:
    check = check_config({"loss_type": {"name": f"{HERE}:HalfMean", "params": {"scale": -1, "scael": 2}}}, Registry())
    problems = dict(check.problems)
    assert "greater than 0" in problems["loss_type.params.scale"]
    assert "did you mean 'scale'" in problems["loss_type.params.scael"]
    assert f"(loss_type '{HERE}:HalfMean')" in problems["loss_type.params.scale"]


def test_a_loss_type_by_import_path_is_built_and_used_by_the_core() -> None:
    built = resolve_component("loss_type", {"name": f"{HERE}.HalfMean", "params": {"scale": 0.25}}, Registry())
    assert isinstance(built, HalfMean) and built.scale == 0.25
    # On-policy, the per-token policy term is -A = -2 on both tokens; a quarter of their mean.
    loss, _ = compute_loss(
        torch.zeros(1, 2), None, torch.tensor([2.0]), torch.ones(1, 2),
        loss_type={"name": f"{HERE}:HalfMean", "params": {"scale": 0.25}},
    )
    assert loss.item() == pytest.approx(-0.5)


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("no_such_module_xyz:Loss", "loss_type 'no_such_module_xyz:Loss': cannot import module 'no_such_module_xyz'"),
        (f"{HERE}:Nothing", f"loss_type '{HERE}:Nothing': module '{HERE}' has no attribute 'Nothing'"),
        (f"{HERE}.HERE", f"loss_type '{HERE}.HERE': loss_type 'HERE' must be a class or a callable, got str"),
        ("dapoo.x", "cannot import module 'dapoo'"),
    ],
)
def test_an_import_path_that_names_nothing_says_why(name: str, says: str) -> None:
    with pytest.raises(ComponentImportError) as info:
        Registry().get("loss_type", name)
    assert says in str(info.value)
    check = check_config({"loss_type": name}, Registry())
    assert [path for path, _ in check.problems] == ["loss_type"]


def test_a_known_distribution_is_never_imported() -> None:
    registry = Registry(entry_points=False)
    registry.register("loss_type", "HalfMean", LossType, distribution="json")
    assert registry.get("loss_type", "json:HalfMean").obj is LossType  # not the module json
    assert registry.get("loss_type", f"{HERE}:HalfMean").obj is HalfMean
    with pytest.raises(UnknownComponentError, match=r"to import from a module of that name, write 'json\.dumps'"):
        registry.get("loss_type", "json:dumps")
