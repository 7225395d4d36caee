"""The run config: loading, --set overrides, readable errors, and the complete validation."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from pydantic import BaseModel

from grpo_plugins.batching import BatchPlanWarning
from grpo_plugins.config import ConfigError, GRPOConfig, RewardSpec, load_config
from grpo_plugins.registry import Registry
from grpo_plugins.validation import ConfigWarning, check_config, validate_config

ROOT = Path(__file__).resolve().parents[1]

MINIMAL = """\
model: builtin:smollm2-135m-instruct   # or a mapping: name_or_path, dtype, lora, ...
task: arithmetic                       # or dataset: {path: json, data_files: train.jsonl, ...}
rewards:
  - correct_answer                     # a bare name, weight 1.0
  - {name: format, weight: 0.5}        # or name + weight + params
loss_type: dapo
num_generations: 8
per_device_train_batch_size: 8
"""


class LenParams(BaseModel):
    max_len: int = 100


class LenReward:
    """Scores completions no longer than max_len."""

    Params = LenParams

    def __init__(self, params: LenParams):
        self.params = params

    def __call__(self, prompts, completions, **kwargs):
        return [float(len(c) <= self.params.max_len) for c in completions]


def _plain_reward(prompts, completions, **kwargs):
    return [1.0] * len(completions)


class _StandInTask:
    """Stand-in for the built-in arithmetic task."""

    default_rewards = ["correct_answer", {"name": "format", "weight": 0.5}]


class _NoDefaultsTask:
    """A task without default rewards."""


class _Anything:
    """A stand-in component."""


@pytest.fixture(scope="module")
def registry() -> Registry:
    """The installed plugins, plus stand-ins for any built-in the minimal config names that is
    not installed (yet), plus two test components."""
    reg = Registry(strict=False)
    stand_ins = [
        ("task", "arithmetic", _StandInTask),
        ("reward", "correct_answer", _plain_reward),
        ("reward", "format", _plain_reward),
        ("loss_type", "dapo", _Anything),
        ("importance_sampling", "token", _Anything),
        ("reward_scaling", "group", _Anything),
        ("rollout_correction", "token_truncate", _Anything),
        ("generator", "transformers", _Anything),
    ]
    for kind, name, obj in stand_ins:
        if name not in reg.names(kind):
            reg.register(kind, name, obj)
    reg.register("reward", "len_reward", LenReward)
    reg.register("task", "no_defaults", _NoDefaultsTask)
    return reg


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    return path


# -- loading -----------------------------------------------------------------------------------


def test_the_minimal_config_of_the_spec_validates_as_it_stands(tmp_path: Path, registry: Registry):
    config = validate_config(write(tmp_path, MINIMAL), registry)
    assert config.task == "arithmetic" and config.loss_type == "dapo"
    assert config.rewards == ["correct_answer", RewardSpec(name="format", weight=0.5)]
    check = check_config(config, registry)
    assert [(spec.name, spec.weight) for spec, _ in check.rewards] == [("correct_answer", 1.0), ("format", 0.5)]
    assert check.plan is not None and check.plan.unique_prompts == 1


def test_seed_parameters_have_the_seed_defaults():
    c = GRPOConfig()
    assert (c.beta, c.num_iterations, c.epsilon, c.epsilon_high, c.delta) == (0.0, 1, 0.2, None, None)
    assert (c.importance_sampling_level, c.reward_weights, c.scale_rewards, c.loss_type) == ("token", None, "group", "dapo")
    assert (c.mask_truncated_completions, c.vllm_importance_sampling_correction, c.vllm_importance_sampling_cap) == (False, "auto", 2.0)
    assert (c.temperature, c.top_p, c.top_k, c.min_p, c.repetition_penalty) == (1.0, 1.0, None, None, 1.0)
    assert (c.steps_per_generation, c.generation_batch_size, c.fast_inference, c.dtype) == (None, None, False, "auto")
    assert c.resolved_epsilon_high == 0.2


def test_seed_aliases_and_boolean_scale_rewards():
    c = load_config({"train_batch_size": 3, "gradient_accumulation": 2, "scale_rewards": False})
    assert (c.per_device_train_batch_size, c.gradient_accumulation_steps, c.scale_rewards) == (3, 2, "none")
    assert load_config({"scale_rewards": True}).scale_rewards == "group"


def test_overrides_parse_yaml_values_and_dotted_keys():
    c = load_config(
        {"rewards": ["correct_answer", "format"], "model": "some/model"},
        [
            "num_generations=4",
            "top_k=null",
            "report_to=[jsonl]",
            "rewards.0.weight=0.25",
            "rewards.2=len_reward",
            "rewards.2.params.max_len=12",
            "loss_type.params.tau=2",
            "model.dtype=bfloat16",
            "lora.r=4",
        ],
    )
    assert c.num_generations == 4 and c.top_k is None and c.report_to == ["jsonl"]
    assert c.rewards[0] == RewardSpec(name="correct_answer", weight=0.25)
    assert c.rewards[1] == "format"
    assert c.rewards[2] == RewardSpec(name="len_reward", params={"max_len": 12})
    assert (c.loss_type.name, c.loss_type.params) == ("dapo", {"tau": 2})  # the default name kept
    assert c.model.name_or_path == "some/model" and c.dtype == "bfloat16"
    assert c.lora is not None and c.lora.r == 4


@pytest.mark.parametrize(
    ("override", "path", "says"),
    [
        ("top_p", "top_p", "expects key=value"),
        ("rewards.x.weight=1", "rewards.x.weight", "must be a list index"),
        ("rewards.5=a", "rewards.5", "out of range"),
        ("num_generations.x=1", "num_generations.x", "not a mapping"),
    ],
)
def test_bad_overrides_are_errors(override: str, path: str, says: str):
    with pytest.raises(ConfigError) as info:
        load_config({"rewards": []}, [override])
    assert info.value.errors[0][0] == path and says in info.value.errors[0][1]


def test_to_yaml_round_trips(tmp_path: Path):
    config = load_config({"rewards": [{"name": "format", "params": {"a": 1}}], "lora": {"r": 8}, "top_k": 5})
    again = load_config(write(tmp_path, config.to_yaml()))
    assert again == config


def test_yaml_errors_name_the_line(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"not valid YAML: line 2"):
        load_config(write(tmp_path, "beta: 0.1\nrewards: a: b\n"))
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "missing.yaml")
    assert load_config(write(tmp_path, "")) == GRPOConfig()


# -- malformed configs: each rejected with a message naming the field -------------------------

BASE = {"task": "arithmetic", "rewards": ["correct_answer", {"name": "len_reward"}], "num_generations": 4,
        "per_device_train_batch_size": 4}

MALFORMED = [
    # (changes to BASE, path of the error, words the message must contain)
    ({"learning_rte": 1e-5}, "learning_rte", "did you mean 'learning_rate'"),
    ({"num_generations": "eight"}, "num_generations", "valid integer"),
    ({"num_generations": 1}, "num_generations", "at least 2"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"min_p": 2}, "min_p", "less than or equal to 1"),
    ({"temperature": 0}, "temperature", "greater than 0"),
    ({"steps_per_generation": 2, "generation_batch_size": 12}, "generation_batch_size", "mutually exclusive"),
    ({"loss_type": "dapoo"}, "loss_type", "did you mean 'dapo'"),
    ({"scale_rewards": "grop"}, "scale_rewards", "did you mean 'group'"),
    ({"rewards": ["corect_answer"]}, "rewards.0", "did you mean 'correct_answer'"),
    ({"rewards": ["correct_answer", {"name": "len_reward", "params": {"max_len": "long"}}]},
     "rewards.1.params.max_len", "valid integer"),
    ({"rewards": ["correct_answer", {"name": "len_reward", "params": {"maxlen": 3}}]},
     "rewards.1.params.maxlen", "did you mean 'max_len'"),
    ({"rewards": ["correct_answer", {"name": "len_reward", "wieght": 2}]}, "rewards.1.wieght", "did you mean 'weight'"),
    ({"rewards": ["correct_answer", 5]}, "rewards.1", "expected a string or a mapping (RewardSpec)"),
    ({"reward_weights": [1.0, 2.0, 3.0]}, "reward_weights", "has 3 values but the run has 2 rewards"),
    ({"num_generations": 3}, "num_generations", "not divisible by num_generations (3)"),
    ({"gradient_accumulation_steps": 3, "steps_per_generation": 4}, "gradient_accumulation_steps", "must divide"),
    ({"generation_batch_size": 6}, "generation_batch_size", "multiple of num_processes * per_device_train_batch_size"),
    ({"dtype": "fp16"}, "dtype", "'bfloat16'"),
    ({"lora": {"alpha": 16}}, "lora.alpha", "did you mean 'lora_alpha'"),
    ({"model": {"name_or_path": "x", "config": {"hidden_size": 8}}}, "model", "exactly one of"),
    ({"loss_type": {"name": "dapo", "paramz": {}}}, "loss_type.paramz", "did you mean 'params'"),
    ({"task": "no_defaults", "rewards": []}, "rewards", "has no default rewards"),
    ({"task": None, "dataset": None}, "task", "no data"),
    ({"vllm_importance_sampling_correction": "sometimes"}, "vllm_importance_sampling_correction", "'auto'"),
    ({"train_batch_size": 2}, "train_batch_size", "alias of per_device_train_batch_size"),
    ({"model": "builtin:nope"}, "model", "unknown built-in model 'builtin:nope'"),
    ({"model": "./no/such/model.gguf"}, "model", "no such file or directory"),
    ({"model": {"config": {"model_type": "llama"}, "tokenizer": "/no/such/tokenizer"}}, "model.tokenizer", "no such file"),
    ({"dataset": {"path": "json", "data_files": "./no/such/train.jsonl"}}, "dataset.data_files", "no such file"),
    ({"report_to": ["jsonl", "wandb"]}, "report_to", "'wandb' is not available here"),
    ({"off_policy_mask_threshold": -0.1}, "off_policy_mask_threshold", "greater than or equal to 0"),
]


@pytest.mark.parametrize(("changes", "path", "says"), MALFORMED, ids=[m[1] + "-" + str(i) for i, m in enumerate(MALFORMED)])
def test_malformed_config_is_rejected_naming_the_field(changes: dict, path: str, says: str, registry: Registry):
    with pytest.raises(ConfigError) as info:
        validate_config({**BASE, **changes}, registry)
    matching = [message for p, message in info.value.errors if p == path]
    assert matching, f"no error at {path!r}: {info.value.errors}"
    assert any(says in message for message in matching), matching
    assert f"{path}: " in str(info.value)


def test_all_problems_are_reported_at_once(registry: Registry):
    with pytest.raises(ConfigError) as info:
        validate_config({**BASE, "loss_type": "nope", "scale_rewards": "nope", "num_generations": 3}, registry)
    assert [p for p, _ in info.value.errors] == ["loss_type", "scale_rewards", "num_generations"]
    assert "3 problems" in str(info.value)


def test_params_of_single_components_are_validated(registry: Registry):
    registry.register("loss_type", "tunable_loss", LenReward)
    try:
        with pytest.raises(ConfigError, match=r"loss_type.params.max_len: .*valid integer"):
            validate_config({**BASE, "loss_type": {"name": "tunable_loss", "params": {"max_len": "x"}}}, registry)
        assert validate_config({**BASE, "loss_type": {"name": "tunable_loss", "params": {"max_len": 3}}}, registry)
    finally:
        registry.unregister("loss_type", "tunable_loss")


def test_task_default_rewards_are_used_and_counted(registry: Registry):
    check = check_config({**BASE, "rewards": []}, registry)
    assert check.ok and check.rewards_from_task
    assert [spec.name for spec, _ in check.rewards] == ["correct_answer", "format"]
    with pytest.raises(ConfigError, match="reward_weights: has 1 values but the run has 2 rewards"):
        validate_config({**BASE, "rewards": [], "reward_weights": [1.0]}, registry)


def test_rollout_correction_is_checked_only_when_used_or_chosen(registry: Registry):
    off = check_config({**BASE, "vllm_importance_sampling_correction": False}, registry)
    assert off.ok and "rollout_correction" not in off.components
    assert check_config(BASE, registry).components["rollout_correction"].name == "token_truncate"
    # chosen explicitly: checked even when the correction is off
    with pytest.raises(ConfigError, match="rollout_correction: unknown rollout_correction 'nope'"):
        validate_config({**BASE, "rollout_correction": "nope", "vllm_importance_sampling_correction": False}, registry)


def test_batch_check_uses_world_size(registry: Registry, monkeypatch: pytest.MonkeyPatch):
    config = {**BASE, "num_generations": 8, "per_device_train_batch_size": 4}
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="not divisible by num_generations"):
        validate_config(config, registry)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert validate_config(config, registry).num_generations == 8
    assert check_config(config, registry, num_processes=4).plan.unique_prompts == 2


def test_disable_plugins_builds_a_registry_without_them():
    check = check_config({"disable_plugins": ["grpo-plugins"], "loss_type": "dapo", "rewards": ["x"]})
    assert "grpo-plugins" in check.registry.disabled
    assert all(c.distribution != "grpo-plugins" for c in check.registry.components())
    assert any(p == "loss_type" and "unknown loss_type 'dapo'" in m for p, m in check.problems)


def test_questionable_settings_warn(registry: Registry):
    with pytest.warns(ConfigWarning, match="delta"):
        validate_config({**BASE, "delta": 1.1}, registry)
    with pytest.warns(BatchPlanWarning, match="num_generations is 2"):
        validate_config({**BASE, "num_generations": 2}, registry)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_config({**BASE, "delta": 1.5}, registry)


def test_config_reference_is_up_to_date():
    from grpo_plugins.cli import render_config_reference

    committed = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == render_config_reference(), "run: grpo-plugins config-reference --output docs/config.md"
    for name in GRPOConfig.model_fields:
        assert f"| `{name}` |" in committed



# -- validate fails where train fails ----------------------------------------------------------


def test_validate_fails_for_fast_inference_without_vllm(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    import grpo_plugins.generators as generators

    monkeypatch.setattr(generators, "vllm_available", lambda: False)
    with pytest.raises(ConfigError, match=r"fast_inference: .*vLLM is not installed"):
        validate_config({**BASE, "fast_inference": True}, registry)


def test_validate_fails_for_a_hub_id_that_is_not_in_the_local_cache(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError, match=r"model: 'acme/tiny-model' is neither a local directory nor a model in the Hugging Face cache"):
        validate_config({**BASE, "model": "acme/tiny-model"}, registry)
    snapshot = tmp_path / "hub" / "models--acme--tiny-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--acme--tiny-model" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-model" / "refs" / "main").write_text("abc123")
    validate_config({**BASE, "model": "acme/tiny-model"}, registry)  # cached: fine


def test_an_unknown_top_level_key_that_is_a_components_param_says_where_it_goes() -> None:
    """release_cache and merge_weights are the static generator's params; written at the top
    level they used to get "did you mean 'master_weights'"."""
    with pytest.raises(ConfigError) as info:
        load_config({"task": None, "merge_weights": False, "temperature_pos": 1.0, "learnin_rate": 1e-5})
    text = str(info.value)
    assert "unknown key 'merge_weights'; it is a param of the generator 'static'" in text
    assert "generator: {name: static, params: {merge_weights: ...}}" in text
    assert "loss_type: {name: sapo, params: {temperature_pos: ...}}" in text
    assert "master_weights" not in text
    assert "unknown key 'learnin_rate'; did you mean 'learning_rate'?" in text  # a typo stays a typo


def test_an_off_policy_mask_threshold_of_0_is_accepted_and_reaches_the_loss():
    from grpo_plugins.objective import Objective

    config = load_config({"off_policy_mask_threshold": 0.0})
    assert config.off_policy_mask_threshold == 0.0
    assert Objective.from_config(config).off_policy_mask_threshold == 0.0  # 0.0, not "off"
