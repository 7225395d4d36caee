"""The example third-party distribution (plugins_example/, installed by scripts/setup.sh) seen from
the outside: `grpo-plugins list` and `validate` show and accept its components, and a tiny model
trains with its reward, loss type and importance-sampling strategy."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

DIST = "grpo-plugins-example"
EXAMPLE = {
    ("reward", "keyword_coverage"),
    ("loss_type", "seq_mean_token_sum"),
    ("importance_sampling", "gspo_token"),
    ("environment", "second_chance"),
}

try:
    VERSION = importlib.metadata.version(DIST)
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - setup.sh installs it
    pytest.skip(
        f"{DIST} is not installed: run scripts/setup.sh (or pip install -e ./plugins_example)",
        allow_module_level=True,
    )


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "GRPO_PLUGINS_STRICT": "1"}
    return subprocess.run(
        [sys.executable, "-m", "grpo_plugins.cli", *args], capture_output=True, text=True, env=env, timeout=60
    )


def example_config(tmp_path: Path, model: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    rows = [{"prompt": f"Name a {w}.", "must_mention": [w[:2]]} for w in ("fruit", "colour", "animal", "tree")]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "model": model,
        "task": None,
        "dataset": {"path": "json", "data_files": str(data)},
        "rewards": [
            {"name": "keyword_coverage", "params": {"keywords": ["a", "e"], "column": "must_mention"}}
        ],
        "loss_type": "seq_mean_token_sum",
        "importance_sampling_level": "gspo_token",
        "num_generations": 4,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 2,  # the second micro-step of each cycle is off-policy
        "max_completion_length": 8,
        "max_prompt_length": 32,
        "max_steps": 3,
        "learning_rate": 1e-2,
        "seed": 0,
        "output_dir": str(tmp_path / "out"),
        "report_to": ["jsonl"],
    }
    config.update(overrides)
    return config


def test_list_shows_the_example_components_with_distribution_and_version() -> None:
    result = cli("list", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    mine = {(c["kind"], c["name"]): c for c in listed["components"] if c["distribution"] == DIST}
    assert set(mine) == EXAMPLE
    assert {c["version"] for c in mine.values()} == {VERSION}
    assert mine["reward", "keyword_coverage"]["params_schema"]["properties"]["keywords"]["type"] == "array"


def test_list_table_shows_each_example_component_on_a_row_with_its_distribution() -> None:
    result = cli("list")
    assert result.returncode == 0, result.stderr
    for _, name in EXAMPLE:
        (row,) = [line for line in result.stdout.splitlines() if f" {name} " in line]
        assert DIST in row and VERSION in row


def test_validate_accepts_a_config_naming_the_example_components(tmp_path: Path, tiny_model: dict) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(example_config(tmp_path, tiny_model)))
    result = cli("validate", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_validate_reports_a_bad_example_param_with_its_path(tmp_path: Path, tiny_model: dict) -> None:
    config = example_config(tmp_path, tiny_model)
    config["rewards"][0]["params"]["keyword"] = ["typo"]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = cli("validate", str(path))
    assert result.returncode != 0
    assert "rewards.0.params.keyword" in result.stdout + result.stderr


@pytest.mark.slow
def test_a_tiny_model_trains_with_the_example_reward_loss_type_and_is_strategy(
    tmp_path: Path, tiny_model: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo_plugins import Engine
    from grpo_plugins_example.importance_sampling import GSPOToken
    from grpo_plugins_example.loss_type import SeqMeanTokenSum
    from grpo_plugins_example.rewards import KeywordCoverage

    calls: dict[str, int] = {}

    def counting(cls: type, method: str) -> None:
        original = getattr(cls, method)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls[f"{cls.__name__}.{method}"] = calls.get(f"{cls.__name__}.{method}", 0) + 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, wrapper)

    counting(KeywordCoverage, "__call__")
    counting(SeqMeanTokenSum, "reduce")
    counting(GSPOToken, "log_weights")

    # The loss type by its qualified name, as a user would to pick it over a same-named one.
    config = example_config(tmp_path, tiny_model, loss_type=f"{DIST}:seq_mean_token_sum")
    result = Engine(config).train()

    assert result.global_step == 3
    # 3 optimizer steps of 1 micro-step each, over 2 generation cycles (2 micro-steps per cycle).
    assert calls["KeywordCoverage.__call__"] == 2  # once per generation cycle
    assert calls["SeqMeanTokenSum.reduce"] == 3  # once per micro-step
    assert calls["GSPOToken.log_weights"] >= 3
    records = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    assert all(0.0 <= r["rewards/keyword_coverage/mean"] <= 1.0 for r in steps)
    saved = yaml.safe_load((result.output_dir / "config.yaml").read_text())
    assert (saved["loss_type"], saved["importance_sampling_level"]) == (f"{DIST}:seq_mean_token_sum", "gspo_token")


@pytest.mark.slow
def test_the_example_packages_own_test_command_passes() -> None:
    folder = Path(__file__).resolve().parents[1] / "plugins_example"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
