"""example.yaml, the config the README uses, validates with this package's components."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_plugins.validation import ConfigError, check_config, validate_config

EXAMPLE = Path(__file__).resolve().parents[1] / "example.yaml"


def test_the_example_config_resolves_to_this_package() -> None:
    check = check_config(EXAMPLE)
    assert check.ok, check.problems
    assert check.components["loss_type"].qualified_name == "grpo-plugins-example:seq_mean_token_sum"
    assert check.components["importance_sampling_level"].qualified_name == "grpo-plugins-example:gspo_token"
    reward = {spec.name: component for spec, component in check.rewards}["keyword_coverage"]
    assert reward.distribution == "grpo-plugins-example"


def test_a_typo_in_a_param_is_reported_with_its_path() -> None:
    with pytest.raises(ConfigError, match=r"rewards\.0\.params\.keywrods.*did you mean 'keywords'"):
        validate_config({"rewards": [{"name": "keyword_coverage", "params": {"keywrods": ["x"]}}]})
