"""Misbehaving plugins: each failure is reported with the distribution it comes from, and
everything that does not use the failing plugin keeps working (issue 8).

Plugins are throwaway distributions on a path entry (see plugin_dists.py): one that raises at
import, one whose ``register`` call is rejected, one whose hook raises, two that register the
same name, one whose params model rejects the config, one whose constructor raises and one
whose loss type raises in the middle of training.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, Field

from grpo_plugins.registry import ComponentBuildError, ComponentParamsError, Registry
from plugin_dists import make_distribution, reward_plugin

ROOT = Path(__file__).resolve().parents[1]

REGISTER_BOOM = """
from grpo_plugins import hookimpl

def score(prompts, completions, **kwargs):
    return [0.0] * len(completions)

@hookimpl
def register_rewards(register):
    register(score, name="needs:no_colon")
"""

HOOK_BOOM = """
from grpo_plugins import hookimpl

@hookimpl
def register_loss_types(register):
    raise RuntimeError("hook exploded")
"""

STRICT_PARAMS = """
from pydantic import BaseModel, Field, field_validator
from grpo_plugins import hookimpl

class Params(BaseModel):
    max_len: int = Field(10, ge=1)
    mode: str = "chars"

    @field_validator("mode")
    @classmethod
    def _mode(cls, value):
        if value == "explode":
            raise RuntimeError("validator bug")
        return value

class Strict:
    Params = Params
    def __init__(self, params):
        self.params = params
    def __call__(self, prompts, completions, **kwargs):
        return [0.0] * len(completions)

class Fragile:
    def __init__(self):
        raise OSError("model file missing")
    def __call__(self, prompts, completions, **kwargs):
        return [0.0] * len(completions)

@hookimpl
def register_rewards(register):
    register(Strict, name="strict_reward")
    register(Fragile, name="fragile_reward")
"""

RUNTIME_BOOM = """
from grpo_plugins import hookimpl
from grpo_plugins.kinds import LossType

class BoomLoss(LossType):
    def reduce(self, per_token_loss, inputs):
        raise ZeroDivisionError("bad normaliser")

@hookimpl
def register_loss_types(register):
    register(BoomLoss, name="boom_loss")
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("site")
    make_distribution(root, "good-plugin", "1.0", {"rel_good": reward_plugin("good_reward")})
    make_distribution(root, "import-boom", "0.1", {"rel_import_boom": "raise ImportError('needs libfoo')\n"})
    make_distribution(root, "register-boom", "0.2", {"rel_register_boom": REGISTER_BOOM})
    make_distribution(root, "hook-boom", "0.3", {"rel_hook_boom": HOOK_BOOM})
    make_distribution(root, "dup-a", "1.0", {"rel_dup_a": reward_plugin("shared_reward")})
    make_distribution(root, "dup-b", "2.0", {"rel_dup_b": reward_plugin("shared_reward")})
    make_distribution(root, "strict-params", "1.5", {"rel_strict": STRICT_PARAMS})
    make_distribution(root, "runtime-boom", "0.9", {"rel_runtime_boom": RUNTIME_BOOM})
    return root


@pytest.fixture
def registry(site: Path, monkeypatch: pytest.MonkeyPatch) -> Registry:
    monkeypatch.syspath_prepend(str(site))
    for var in ("GRPO_PLUGINS_STRICT", "GRPO_PLUGINS_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    for name in list(sys.modules):
        if name.startswith("rel_"):
            monkeypatch.delitem(sys.modules, name)
    return Registry()


def test_load_failures_are_recorded_with_their_distribution(registry: Registry) -> None:
    broken = {b.distribution: (b.version, b.error) for b in registry.broken}
    assert broken["import-boom"] == ("0.1", "ImportError: needs libfoo")
    assert broken["register-boom"][1] == "ValueError: reward name 'needs:no_colon' must not contain ':'"
    assert broken["hook-boom"][1] == "RuntimeError: hook exploded"
    assert {"good-plugin", "dup-a", "dup-b", "strict-params", "runtime-boom"}.isdisjoint(broken)


def test_the_rest_keeps_working(registry: Registry) -> None:
    assert registry.build("reward", "good_reward")(["p"], ["c"]) == [1.0]
    assert registry.get("loss_type", "dapo").distribution == "grpo-plugins"  # the built-ins too
    assert registry.get("reward", "dup-b:shared_reward").version == "2.0"


def test_using_a_name_of_a_broken_plugin_names_every_broken_distribution(registry: Registry) -> None:
    with pytest.raises(Exception) as info:
        registry.get("reward", "libfoo_reward")
    message = str(info.value)
    assert "import-boom 0.1 failed to load (ImportError: needs libfoo)" in message
    assert "register-boom 0.2 failed to load" in message


def test_a_params_model_that_rejects_the_config_names_the_distribution(registry: Registry) -> None:
    component = registry.get("reward", "strict_reward")
    with pytest.raises(ComponentParamsError) as info:
        component.build({"max_len": 0})
    assert "reward 'strict_reward' from strict-params 1.5 params: max_len" in str(info.value)
    with pytest.raises(ComponentParamsError, match="from strict-params 1.5 params: .*RuntimeError: validator bug"):
        component.build({"mode": "explode"})
    assert component.build({"max_len": 3}).params.max_len == 3


class AliasParams(BaseModel):
    json_schema: dict = Field(default_factory=dict, alias="schema")


class WithAlias:
    Params = AliasParams

    def __init__(self, params: AliasParams) -> None:
        self.params = params


def test_a_field_written_by_name_instead_of_its_alias_is_told_the_alias() -> None:
    registry = Registry(entry_points=False)
    registry.register("reward", "aliased", WithAlias)
    with pytest.raises(ComponentParamsError) as info:
        registry.build("reward", "aliased", {"json_schema": {}})
    assert info.value.errors == [("json_schema", "unknown key 'json_schema'; write it as 'schema'")]
    with pytest.raises(ComponentParamsError) as info:
        registry.build("reward", "aliased", {"shema": {}})
    assert info.value.errors == [("shema", "unknown key 'shema'; did you mean 'schema'?")]  # reported once


def test_a_constructor_that_raises_names_the_distribution(registry: Registry) -> None:
    with pytest.raises(ComponentBuildError, match="building reward 'fragile_reward' from strict-params 1.5 failed: OSError: model file missing"):
        registry.build("reward", "fragile_reward")


# -- through `grpo-plugins validate`, in a fresh process -------------------------------------------


def _validate(site: Path, tmp_path: Path, **changes: Any) -> subprocess.CompletedProcess[str]:
    config = {"task": None, "dataset": {"path": "json", "data_files": "train.jsonl"}, "rewards": ["good_reward"]}
    config.update(changes)
    (tmp_path / "train.jsonl").write_text('{"prompt": "ab"}\n')
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_PLUGINS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "grpo_plugins.cli", "validate", "run.yaml"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    )


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({}, None),
        ({"rewards": ["shared_reward"]}, ["dup-a", "dup-b", "'dup-a:shared_reward'"]),
        ({"rewards": [{"name": "strict_reward", "params": {"max_len": 0}}]},
         ["rewards.0.params.max_len", "reward 'strict_reward' from strict-params 1.5"]),
        ({"loss_type": "hooked_loss"}, ["hook-boom 0.3 failed to load (RuntimeError: hook exploded)"]),
    ],
    ids=["unaffected-config-validates", "duplicate", "params-rejected", "broken-plugin-named"],
)
def test_validate_reports_plugin_failures_with_the_distribution(
    site: Path, tmp_path: Path, changes: dict, says: list[str] | None
) -> None:
    result = _validate(site, tmp_path, **changes)
    assert "Traceback" not in result.stdout + result.stderr
    if says is None:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode == 2, result.stdout
    err = " ".join(result.stderr.split())
    for text in says:
        assert text in err, (text, err)


# -- a component that raises while training --------------------------------------------------------


def test_a_loss_type_raising_during_training_names_its_distribution(
    registry: Registry, tiny_model: dict, tmp_path: Path
) -> None:
    from grpo_plugins.engine import Engine
    from grpo_plugins.guards import PluginRuntimeError

    config = {
        "model": tiny_model, "task": None, "output_dir": str(tmp_path / "out"), "max_steps": 1,
        "loss_type": "boom_loss", "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 4, "report_to": ["jsonl"],
    }
    rows = [{"prompt": "ab"}, {"prompt": "cd"}]
    engine = Engine(config, rewards=[lambda completions, **kw: [float(len(c)) for c in completions]],
                    dataset=rows, registry=registry)
    with pytest.raises(PluginRuntimeError) as info:
        engine.train()
    message = str(info.value)
    assert message.startswith("loss_type 'boom_loss' from runtime-boom 0.9 raised ZeroDivisionError: bad normaliser")
    assert "optimizer step 1" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)
