"""The package as grpo-plugins sees it: registration, contracts, names, disabling."""

from __future__ import annotations

import importlib.metadata

import pytest

import grpo_plugins_example.environment
import grpo_plugins_example.importance_sampling
import grpo_plugins_example.loss_type
import grpo_plugins_example.rewards
from grpo_plugins.registry import Registry
from grpo_plugins.testing import check_plugin, isolated_registry

DIST = "grpo-plugins-example"
COMPONENTS = {
    ("reward", "keyword_coverage"),
    ("loss_type", "seq_mean_token_sum"),
    ("importance_sampling", "gspo_token"),
    ("environment", "second_chance"),
}
MODULES = [
    grpo_plugins_example.rewards,
    grpo_plugins_example.loss_type,
    grpo_plugins_example.importance_sampling,
    grpo_plugins_example.environment,
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_each_plugin_module_satisfies_the_interfaces(module: object) -> None:
    check_plugin(module, params={"keyword_coverage": {"keywords": ["4"]}})


def test_the_installed_distribution_registers_its_components_with_name_and_version() -> None:
    registry = Registry()
    mine = {(c.kind, c.name): c for c in registry.components() if c.distribution == DIST}
    assert set(mine) == COMPONENTS
    version = importlib.metadata.version(DIST)
    assert {c.version for c in mine.values()} == {version}
    assert not [b for b in registry.broken if b.distribution == DIST]


def test_components_can_be_named_with_the_distribution() -> None:
    component = Registry().get("loss_type", f"{DIST}:seq_mean_token_sum")
    assert component.obj is grpo_plugins_example.loss_type.SeqMeanTokenSum


def test_disabling_the_distribution_removes_its_components() -> None:
    registry = Registry(disabled=[DIST])
    assert not [c for c in registry.components() if c.distribution == DIST]
    assert "seq_mean_token_sum" not in registry.names("loss_type")


def test_the_rewards_work_without_installing_in_an_isolated_registry() -> None:
    with isolated_registry(grpo_plugins_example.rewards) as registry:
        reward = registry.build("reward", "keyword_coverage", {"keywords": ["x"]})
        assert reward(prompts=["q"], completions=["x"]) == [1.0]
        assert registry.names("loss_type") == []
