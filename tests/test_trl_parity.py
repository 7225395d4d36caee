"""TRL 1.16 GRPOConfig keys in a grpo-plugins config (grpo_plugins/trl_keys.py and trl_compat.py, docs/trl.md)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from transformers import TrainingArguments
from trl import GRPOConfig as TrlGRPOConfig

from grpo_plugins.config import ConfigError, GRPOConfig, load_config
from grpo_plugins.trl_compat import TRL_KEYS, trl_table_markdown
from grpo_plugins.validation import validate_config

ROOT = Path(__file__).resolve().parents[1]
TRAINING_ARGUMENTS = {f.name for f in dataclasses.fields(TrainingArguments)}


def trl_defaults(**changes) -> dict:
    """A TRL 1.16 GRPOConfig dumped with dataclasses.asdict, minus TrainingArguments' own keys."""
    config = TrlGRPOConfig(output_dir="unused", use_cpu=True, **changes)
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in TRAINING_ARGUMENTS}


def test_trl_adds_77_keys_and_every_one_is_in_the_table():
    keys = set(trl_defaults())
    assert len(keys) == 77
    assert keys - set(TRL_KEYS) == set()


def test_a_trl_config_dumped_at_trls_defaults_validates_completely():
    data = trl_defaults()
    config = validate_config(data)  # plugins resolved, params validated, batch arithmetic checked
    # TRL's meaning where it decides: its rollout correction and bound, top_k 0 = off.
    assert config.rollout_correction.name == "sequence_mask"
    assert config.vllm_importance_sampling_cap == 3.0
    assert config.top_k is None
    assert (config.steps_per_generation, config.generation_batch_size) == (1, None)
    # TRL's default correction (true) does nothing without vLLM, so it is off here too.
    assert config.vllm_importance_sampling_correction is False


def test_a_trl_dumps_correction_is_on_exactly_when_it_generates_with_vllm(caplog):
    from grpo_plugins.generators.transformers_backend import TransformersGenerator
    from grpo_plugins.generators.vllm_backend import VLLMGenerator
    from grpo_plugins.rollout import corrects_rollouts

    with caplog.at_level(logging.INFO, logger="grpo_plugins.config"):
        without = load_config(trl_defaults())
    assert without.vllm_importance_sampling_correction is False
    assert not corrects_rollouts(without.vllm_importance_sampling_correction, TransformersGenerator())
    assert ("TRL key vllm_importance_sampling_correction: false (TRL corrects only when generating with vLLM, "
            "and use_vllm is false)") in [r.getMessage() for r in caplog.records]
    with_vllm = load_config(trl_defaults(use_vllm=True))
    assert with_vllm.vllm_importance_sampling_correction is True and with_vllm.generator.name == "vllm"
    assert corrects_rollouts(with_vllm.vllm_importance_sampling_correction, VLLMGenerator())
    off = load_config(trl_defaults(use_vllm=True, vllm_importance_sampling_correction=False))
    assert off.vllm_importance_sampling_correction is False


def test_correction_true_keeps_this_projects_meaning_without_trls_use_vllm():
    from grpo_plugins.generators.transformers_backend import TransformersGenerator
    from grpo_plugins.rollout import corrects_rollouts

    config = load_config({"vllm_importance_sampling_correction": True})  # the project's own key
    assert config.vllm_importance_sampling_correction is True
    assert corrects_rollouts(True, TransformersGenerator())  # corrects with any generator
    chosen_here = load_config({"vllm_importance_sampling_correction": True, "generator": "transformers"})
    assert chosen_here.vllm_importance_sampling_correction is True
    assert load_config({}).vllm_importance_sampling_correction == "auto"


def test_the_table_agrees_with_the_config_model():
    fields = set(GRPOConfig.model_fields)
    for key in TRL_KEYS.values():
        if key.status == "same":
            assert key.name in fields, key.name
        elif key.status in ("not_applicable", "not_yet"):
            assert key.noop is not None and key.name not in fields, key.name
            assert key.noop(key.default), key.name  # TRL's default has no effect here
        else:
            assert key.translate is not None, key.name


def test_docs_trl_md_is_generated_from_the_table():
    committed = (ROOT / "docs" / "trl.md").read_text(encoding="utf-8")
    assert committed == trl_table_markdown(), "run: grpo-plugins trl-reference --output docs/trl.md"
    for name in TRL_KEYS:
        assert f"| `{name}` |" in committed


def test_translated_keys_log_one_info_line_each(caplog):
    with caplog.at_level(logging.INFO, logger="grpo_plugins.config"):
        config = load_config({"loss_type": "sapo", "sapo_temperature_pos": 1.5, "sapo_temperature_neg": 1.05, "bf16": True})
    assert config.loss_type.params == {"temperature_pos": 1.5, "temperature_neg": 1.05}
    assert config.dtype == "bfloat16"
    lines = [r.getMessage() for r in caplog.records]
    assert "TRL key sapo_temperature_pos: loss_type.params.temperature_pos: 1.5" in lines
    assert "TRL key bf16: dtype: bfloat16" in lines
    assert len(lines) == 3


def test_sapo_temperatures_have_no_effect_for_another_loss_type(caplog):
    with caplog.at_level(logging.INFO, logger="grpo_plugins.config"):
        config = load_config({"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 2.0})
    assert config.loss_type == "dapo"
    assert [r.getMessage() for r in caplog.records] == [
        "TRL key sapo_temperature_neg: has no effect unless loss_type is 'sapo' (as in TRL)"
    ]


def test_vespo_params_and_the_importance_sampling_keys_translate():
    config = load_config({
        "loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_neg": 2.5,
        "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_min": 0.5,
        "vllm_importance_sampling_clip_max": 4.0,
    })
    assert config.loss_type.name == "vespo"
    assert config.loss_type.params == {"k_pos": 1.5, "lambda_neg": 2.5}
    assert config.rollout_correction.name == "token_mask"
    assert config.rollout_correction.params == {"clip_min": 0.5}
    assert config.vllm_importance_sampling_cap == 4.0


def test_trls_deprecated_cap_wins_over_clip_max_as_in_trl():
    config = load_config({"vllm_importance_sampling_cap": 1.5, "vllm_importance_sampling_clip_max": 3.0})
    assert config.vllm_importance_sampling_cap == 1.5


def test_vllm_keys_go_to_the_vllm_generator_only_when_it_is_used():
    config = load_config({
        "use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "http://10.1.2.3:8011",
        "vllm_gpu_memory_utilization": 0.5, "vllm_enable_sleep_mode": True, "vllm_model_impl": "transformers",
    })
    assert config.fast_inference is True
    assert config.generator.name == "vllm"
    assert config.generator.params == {
        "mode": "server", "server_host": "10.1.2.3", "server_port": 8011, "gpu_memory_utilization": 0.5,
        "enable_sleep_mode": True, "engine_kwargs": {"model_impl": "transformers"},
    }
    off = load_config({"use_vllm": False, "vllm_gpu_memory_utilization": 0.5})
    assert off.generator is None and off.fast_inference is False


def test_model_init_kwargs_and_trust_remote_code_go_to_the_model():
    config = load_config({
        "model": "some/model", "trust_remote_code": True,
        "model_init_kwargs": {"dtype": "bfloat16", "attn_implementation": "sdpa", "revision": "abc", "low_cpu_mem_usage": True},
    })
    assert config.dtype == "bfloat16"
    assert config.model.name_or_path == "some/model"
    assert (config.model.attn_implementation, config.model.revision, config.model.trust_remote_code) == ("sdpa", "abc", True)
    assert config.model.init_kwargs == {"low_cpu_mem_usage": True}


def test_generation_kwargs_that_are_sampling_keys_move_to_their_keys():
    config = load_config({"generation_kwargs": {"top_p": 0.9, "top_k": 0, "suppress_tokens": [5]}})
    assert (config.top_p, config.top_k, config.generation_kwargs) == (0.9, None, {"suppress_tokens": [5]})


def test_training_arguments_keys():
    config = load_config({"max_steps": -1, "report_to": "none", "save_steps": 500.0, "fp16": True,
                          "optim": "adamw_torch_fused", "eval_strategy": "no", "push_to_hub": False})
    assert (config.max_steps, config.report_to, config.save_steps, config.dtype) == (None, [], 500, "float16")


def test_trl_evaluation_keys_keep_their_meaning():
    config = load_config({"eval_strategy": "steps", "eval_steps": 0.1, "num_generations_eval": 4,
                          "per_device_eval_batch_size": 16, "eval_on_start": True, "do_eval": True})
    assert (config.eval_strategy, config.resolved_eval_steps(100), config.resolved_num_generations_eval) == ("steps", 10, 4)
    assert (config.per_device_eval_batch_size, config.eval_on_start) == (16, True)


@pytest.mark.parametrize(("data", "key", "says"), [
    ({"log_completions_hub_repo": "me/completions"}, "log_completions_hub_repo", "completions.jsonl"),
    ({"push_to_hub": True}, "push_to_hub", "no model hub"),
    ({"tools": [{"function": "search"}]}, "tools", "names of registered tools"),
    ({"tools": ["calculator"], "environment": "single_turn"}, "tools", "need environment 'tool_calling'"),
    ({"ds3_gather_for_generation": False}, "ds3_gather_for_generation", "DeepSpeed ZeRO-3"),
    ({"eval_strategy": "epoch"}, "eval_strategy", "use eval_strategy: steps with eval_steps"),
    ({"report_to": "wandb"}, "report_to", "'wandb' is not available here"),
    ({"loss_type": {"name": "sapo", "params": {"temperature_pos": 2.0}}, "sapo_temperature_pos": 1.5},
     "sapo_temperature_pos", "give only one of them"),
    ({"vllm_importance_sampling_mode": "token_mask", "rollout_correction": "sequence_mask"},
     "vllm_importance_sampling_mode", "disagree"),
    ({"fp16": True, "dtype": "bfloat16"}, "fp16", "disagree"),
])
def test_a_trl_key_that_cannot_apply_names_what_to_use_instead(data, key, says):
    with pytest.raises(ConfigError) as info:
        load_config(data)
    messages = [m for p, m in info.value.errors if p == key]
    assert messages and says in messages[0], info.value.errors


def test_trl_tools_become_the_tool_calling_environment():
    config = load_config({"tools": ["calculator"], "max_tool_calling_iterations": 3})
    env = config.environment
    assert (env.name, env.params) == ("tool_calling", {"max_tool_calling_iterations": 3, "tools": ["calculator"]})
    plain = load_config({"max_tool_calling_iterations": 3})  # no tools: no effect, as in TRL
    assert plain.environment == load_config({}).environment


def test_a_misspelt_trl_key_gets_a_suggestion():
    with pytest.raises(ConfigError) as info:
        load_config({"use_vlm": True})
    assert "did you mean 'use_vllm'" in str(info.value)


def test_sync_ref_model_is_refused_with_lora_and_without_beta():
    with pytest.raises(ConfigError, match="nothing to sync"):
        load_config({"sync_ref_model": True})
    with pytest.raises(ConfigError, match="adapter disabled"):
        load_config({"sync_ref_model": True, "beta": 0.1, "lora": {"r": 4}})


# -- TRL's command-line keys (ModelConfig, ScriptArguments) ---------------------------------------


def test_trl_command_line_keys_map_to_model_lora_and_dataset(caplog):
    with caplog.at_level(logging.INFO, logger="grpo_plugins.config"):
        config = load_config({
            "model_name_or_path": "some/model", "model_revision": "v2", "torch_dtype": "bfloat16",
            "use_peft": True, "lora_r": 8, "lora_target_modules": ["q_proj", "v_proj"],
            "dataset_name": "json", "dataset_train_split": "validation",
        })
    assert (config.model.name_or_path, config.model.revision, config.dtype) == ("some/model", "v2", "bfloat16")
    # TRL's LoRA defaults for the keys not given: lora_alpha 32, lora_dropout 0.05.
    assert (config.lora.r, config.lora.lora_alpha, config.lora.lora_dropout) == (8, 32, 0.05)
    assert config.lora.target_modules == ["q_proj", "v_proj"]
    assert (config.dataset.path, config.dataset.split) == ("json", "validation")
    assert "TRL key model_name_or_path: model.name_or_path: 'some/model'" in [r.getMessage() for r in caplog.records]


def test_lora_keys_without_use_peft_change_nothing_as_in_trl(caplog):
    with caplog.at_level(logging.INFO, logger="grpo_plugins.config"):
        config = load_config({"lora_r": 8})
    assert config.lora is None
    assert [r.getMessage() for r in caplog.records] == [
        "TRL key lora_r: has no effect without use_peft: true or lora: (as in TRL)"
    ]
    # With lora: they fill it in; a key that disagrees with lora: is refused.
    assert load_config({"lora": {"r": 4}, "lora_alpha": 16}).lora.lora_alpha == 16
    with pytest.raises(ConfigError, match="lora_r.*give only one of them"):
        load_config({"lora": {"r": 4}, "lora_r": 8})


def test_use_peft_false_with_lora_is_refused():
    with pytest.raises(ConfigError, match="use_peft: false, but the config sets lora:"):
        load_config({"use_peft": False, "lora": {"r": 4}})


def test_unsupported_trl_command_line_values_say_what_to_use():
    with pytest.raises(ConfigError, match="use_dora.*DoRA is not supported yet"):
        load_config({"use_dora": True})
    with pytest.raises(ConfigError, match="reward_funcs.*rewards:"):
        load_config({"reward_funcs": ["accuracy_reward"]})
    # At TRL's defaults they are accepted and change nothing.
    assert load_config({"use_dora": False, "lora_task_type": "CAUSAL_LM", "dataset_streaming": False}).lora is None
