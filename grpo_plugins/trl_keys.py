"""The table of TRL 1.16 keys: one :class:`TrlKey` per key of TRL's ``GRPOConfig`` (and of the
``TrainingArguments`` and command-line keys a GRPO user sets), saying what happens to it here.
:mod:`grpo_plugins.trl_compat` applies it to a config and writes docs/trl.md from it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from grpo_plugins.trl_translations import (
    Translation,
    component_param,
    dataset_key,
    dataset_name,
    dataset_test_split,
    eval_strategy,
    generation_kwargs,
    is_any,
    is_cap,
    is_clip_max,
    is_clip_min,
    is_correction,
    is_mode,
    logging_dir,
    lora_key,
    max_steps,
    max_tool_calling_iterations,
    model_impl,
    model_init_kwargs,
    model_key,
    optim,
    pad_multiple,
    precision,
    report_to,
    save_steps,
    save_strategy,
    server_url,
    tools,
    top_k,
    torch_dtype,
    use_peft,
    use_vllm,
    vllm_param,
)

Status = Literal["same", "translated", "not_applicable", "not_yet"]
UNSET = object()  # a TrlKey without a documented default


@dataclass(frozen=True)
class TrlKey:
    """One TRL key and what grpo-plugins does with it.

    Attributes:
        name: the key as TRL spells it.
        source: ``GRPOConfig`` (TRL's own), ``TrainingArguments`` (transformers'),
            ``GRPOTrainer`` (an argument of TRL's trainer that users look for in the config), or
            ``ModelConfig`` / ``ScriptArguments`` (the other argument groups of TRL's command line).
        status: ``same``, ``translated``, ``not_applicable`` or ``not_yet``.
        here: the docs column "here": where it goes or what to use instead.
        default: TRL 1.16's default (documentation; ``UNSET`` for none).
        translate: for ``translated`` (and value rewrites of ``same``): ``(value, data) ->
            (updates, note)``; ``data`` is the whole config mapping (read-only).
        noop: for ``not_applicable`` / ``not_yet``: whether a value has no effect here (accepted).
    """

    name: str
    source: Literal["GRPOConfig", "TrainingArguments", "GRPOTrainer", "ModelConfig", "ScriptArguments"]
    status: Status
    here: str
    default: Any = UNSET
    translate: Callable[[Any, Mapping[str, Any]], Translation] | None = None
    noop: Callable[[Any], bool] | None = None


_G, _T, _TR, _M, _S = "GRPOConfig", "TrainingArguments", "GRPOTrainer", "ModelConfig", "ScriptArguments"
_HUB = "there is no model hub here: checkpoints and completions stay in output_dir"


def _key(name: str, source: str, status: Status, here: str, default: Any = UNSET, **kw: Any) -> TrlKey:
    return TrlKey(name, source, status, here, default, **kw)  # type: ignore[arg-type]


TRL_KEYS: dict[str, TrlKey] = {
    k.name: k
    for k in (
        # ---- GRPOConfig: model -------------------------------------------------------------
        _key("model_init_kwargs", _G, "translated", "dtype -> `dtype`; attn_implementation, revision, trust_remote_code -> `model.*`; the rest -> `model.init_kwargs` (from_pretrained)", None, translate=model_init_kwargs),
        _key("trust_remote_code", _G, "translated", "`model.trust_remote_code`", False, translate=lambda v, d: ({"model.trust_remote_code": v}, f"model.trust_remote_code: {v!r}") if v else ({}, None)),
        _key("router_aux_loss_coef", _G, "not_applicable", "MoE load-balancing loss is not added here (the log-prob pass computes no router logits); leave it unset", None, noop=is_any(None, 0.0, 0)),
        _key("disable_dropout", _G, "same", "`disable_dropout`", False),
        _key("cast_lm_head_to_fp32", _G, "same", "`cast_lm_head_to_fp32`", False),
        # ---- data ----------------------------------------------------------------------------
        _key("num_generations", _G, "same", "`num_generations`", 8),
        _key("num_generations_eval", _G, "same", "`num_generations_eval` (samples per eval prompt, n of pass@k)", None),
        _key("max_completion_length", _G, "same", "`max_completion_length` (here 256 by default)", 512),
        _key("ds3_gather_for_generation", _G, "not_applicable", "DeepSpeed ZeRO-3 generation without gathering is not supported; leave it true (the default)", True, noop=is_any(True)),
        _key("shuffle_dataset", _G, "same", "`shuffle_dataset`", True),
        _key("pad_to_multiple_of", _G, "same", "`pad_to_multiple_of` (prompt + completion padded together; \"auto\" = null: no Neuron here)", "auto", translate=pad_multiple),
        # ---- generation ----------------------------------------------------------------------
        _key("generation_batch_size", _G, "same", "`generation_batch_size`", None),
        _key("steps_per_generation", _G, "same", "`steps_per_generation`", None),
        _key("temperature", _G, "same", "`temperature`", 1.0),
        _key("top_p", _G, "same", "`top_p`", 1.0),
        _key("top_k", _G, "same", "`top_k` (TRL's 0 = off = null here)", 0, translate=top_k),
        _key("min_p", _G, "same", "`min_p`", None),
        _key("generation_kwargs", _G, "same", "`generation_kwargs` (transformers and vllm generators; temperature, top_p, top_k, min_p, repetition_penalty, max_tokens move to their own keys)", None, translate=generation_kwargs),
        _key("chat_template_kwargs", _G, "same", "`chat_template_kwargs`", None),
        _key("repetition_penalty", _G, "same", "`repetition_penalty`", 1.0),
        _key("cache_implementation", _G, "not_applicable", "use `generator: static` (a static KV cache in a CUDA graph, the default on CUDA)", None, noop=is_any(None)),
        # ---- vLLM ----------------------------------------------------------------------------
        _key("use_vllm", _G, "translated", "`fast_inference: true` (the `vllm` generator)", False, translate=use_vllm),
        _key("vllm_mode", _G, "translated", "`generator.params.mode` (colocate, server)", "colocate", translate=vllm_param("mode", "colocate")),
        _key("vllm_model_impl", _G, "translated", "`generator.params.engine_kwargs.model_impl`", "vllm", translate=model_impl),
        _key("vllm_enable_sleep_mode", _G, "translated", "`generator.params.enable_sleep_mode`", False, translate=vllm_param("enable_sleep_mode", False)),
        _key("vllm_structured_outputs_regex", _G, "not_applicable", "structured outputs are not wired to the vllm generator; reward the format instead (`regex_match` reward)", None, noop=is_any(None)),
        _key("vllm_server_base_url", _G, "translated", "`generator.params.server_host` / `server_port`", None, translate=server_url),
        _key("vllm_server_host", _G, "translated", "`generator.params.server_host` (with vllm_mode: server)", "0.0.0.0", translate=vllm_param("server_host", "0.0.0.0", server_only=True)),
        _key("vllm_server_port", _G, "translated", "`generator.params.server_port` (with vllm_mode: server)", 8000, translate=vllm_param("server_port", 8000, server_only=True)),
        _key("vllm_server_timeout", _G, "translated", "`generator.params.server_timeout` (with vllm_mode: server)", 240.0, translate=vllm_param("server_timeout", 240.0, server_only=True)),
        _key("vllm_group_port", _G, "translated", "`generator.params.server_group_port` (with vllm_mode: server)", 51216, translate=vllm_param("server_group_port", 51216, server_only=True)),
        _key("vllm_gpu_memory_utilization", _G, "translated", "`generator.params.gpu_memory_utilization`", 0.3, translate=vllm_param("gpu_memory_utilization", 0.3)),
        _key("vllm_max_model_length", _G, "translated", "`generator.params.max_model_len`", None, translate=vllm_param("max_model_len", None)),
        _key("vllm_tensor_parallel_size", _G, "not_applicable", "one colocated vLLM engine per process here; use data parallelism (accelerate launch)", 1, noop=is_any(1)),
        # ---- objective -----------------------------------------------------------------------
        _key("beta", _G, "same", "`beta`", 0.0),
        _key("num_iterations", _G, "same", "`num_iterations`", 1),
        _key("epsilon", _G, "same", "`epsilon`", 0.2),
        _key("delta", _G, "same", "`delta`", None),
        _key("epsilon_high", _G, "same", "`epsilon_high`", None),
        _key("sapo_temperature_neg", _G, "translated", "`loss_type: {name: sapo, params: {temperature_neg}}`", 1.05, translate=component_param("loss_type", "sapo", "temperature_neg", 1.05)),
        _key("sapo_temperature_pos", _G, "translated", "`loss_type: {name: sapo, params: {temperature_pos}}`", 1.0, translate=component_param("loss_type", "sapo", "temperature_pos", 1.0)),
        _key("vespo_k_pos", _G, "translated", "`loss_type: {name: vespo, params: {k_pos}}`", 2.0, translate=component_param("loss_type", "vespo", "k_pos", 2.0)),
        _key("vespo_lambda_pos", _G, "translated", "`loss_type: {name: vespo, params: {lambda_pos}}`", 3.0, translate=component_param("loss_type", "vespo", "lambda_pos", 3.0)),
        _key("vespo_k_neg", _G, "translated", "`loss_type: {name: vespo, params: {k_neg}}`", 3.0, translate=component_param("loss_type", "vespo", "k_neg", 3.0)),
        _key("vespo_lambda_neg", _G, "translated", "`loss_type: {name: vespo, params: {lambda_neg}}`", 2.0, translate=component_param("loss_type", "vespo", "lambda_neg", 2.0)),
        _key("importance_sampling_level", _G, "same", "`importance_sampling_level` (a component)", "token"),
        _key("reward_weights", _G, "same", "`reward_weights`", None),
        _key("multi_objective_aggregation", _G, "same", "`multi_objective_aggregation`", "sum_then_normalize"),
        _key("scale_rewards", _G, "same", "`scale_rewards` (a component)", "group"),
        _key("loss_type", _G, "same", "`loss_type` (a component)", "dapo"),
        _key("mask_truncated_completions", _G, "same", "`mask_truncated_completions`", False),
        _key("sync_ref_model", _G, "same", "`sync_ref_model` (full fine-tuning; with LoRA refused, as in TRL)", False),
        _key("ref_model_mixup_alpha", _G, "same", "`ref_model_mixup_alpha`", 0.6),
        _key("ref_model_sync_steps", _G, "same", "`ref_model_sync_steps`", 512),
        _key("top_entropy_quantile", _G, "same", "`top_entropy_quantile`", 1.0),
        _key("entropy_coef", _G, "same", "`entropy_coef`", 0.0),
        _key("use_adaptive_entropy", _G, "same", "`use_adaptive_entropy`", False),
        _key("entropy_coef_min", _G, "same", "`entropy_coef_min`", 0.0),
        _key("entropy_coef_max", _G, "same", "`entropy_coef_max`", 1.0),
        _key("entropy_coef_delta", _G, "same", "`entropy_coef_delta`", 0.005),
        _key("entropy_target", _G, "same", "`entropy_target`", 0.2),
        _key("max_tool_calling_iterations", _G, "translated", "`environment: {name: tool_calling, params: {max_tool_calling_iterations}}`", None, translate=max_tool_calling_iterations),
        _key("tools", _TR, "translated", "`environment: {name: tool_calling, params: {tools: [names]}}` (registered tools: calculator, python, plugins'; functions from Python: `Engine(environment=ToolCalling(functions=[...]))`)", None, translate=tools),
        _key("vllm_importance_sampling_correction", _G, "same", "`vllm_importance_sampling_correction`. TRL corrects only with vLLM; in a config that has `use_vllm` (every TRL dump) `true` keeps that meaning (`false` unless `use_vllm` / the vllm generator is on); otherwise `true` here corrects with any generator, and `auto` (this project's default) is TRL's behaviour", True, translate=is_correction),
        _key("vllm_importance_sampling_mode", _G, "translated", "`rollout_correction` (same four names)", "sequence_mask", translate=is_mode),
        _key("vllm_importance_sampling_clip_max", _G, "translated", "`vllm_importance_sampling_cap`", 3.0, translate=is_clip_max),
        _key("vllm_importance_sampling_clip_min", _G, "translated", "`rollout_correction.params.clip_min`", None, translate=is_clip_min),
        _key("off_policy_mask_threshold", _G, "same", "`off_policy_mask_threshold`", None),
        _key("use_bias_correction_kl", _G, "same", "`use_bias_correction_kl` (default false here, true in TRL)", True),
        # ---- logging -------------------------------------------------------------------------
        _key("log_completions", _G, "same", "`log_completions` (writes completions.jsonl)", False),
        _key("log_multimodal", _G, "not_applicable", "no multimodal inputs here; any value is accepted and changes nothing", True, noop=lambda v: True),
        _key("num_completions_to_print", _G, "same", "`num_completions_to_print` (null prints none here; TRL prints all)", None),
        _key("log_unique_prompts", _G, "same", "`log_unique_prompts`", False),
        _key("log_completions_hub_repo", _G, "not_applicable", f"{_HUB}; `log_completions: true` writes output_dir/completions.jsonl", None, noop=is_any(None)),
        _key("use_transformers_continuous_batching", _G, "not_applicable", "use `generator: static` (CUDA) or `vllm`", False, noop=is_any(False)),
        _key("transformers_continuous_batching_config", _G, "not_applicable", "use `generator: static` (CUDA) or `vllm`", None, noop=is_any(None)),
        _key("use_transformers_paged", _G, "not_applicable", "use `generator: static` (CUDA) or `vllm`", False, noop=is_any(False)),
        _key("vllm_importance_sampling_cap", _G, "same", "`vllm_importance_sampling_cap` (TRL's deprecated name of clip_max; null: use clip_max)", None, translate=is_cap),
        # ---- TrainingArguments a GRPO user sets ----------------------------------------------
        _key("output_dir", _T, "same", "`output_dir`"),
        _key("learning_rate", _T, "same", "`learning_rate`", 1e-6),
        _key("per_device_train_batch_size", _T, "same", "`per_device_train_batch_size`", 8),
        _key("gradient_accumulation_steps", _T, "same", "`gradient_accumulation_steps`", 1),
        _key("max_steps", _T, "same", "`max_steps` (-1 = null: num_train_epochs)", -1, translate=max_steps),
        _key("num_train_epochs", _T, "same", "`num_train_epochs`", 3.0),
        _key("logging_steps", _T, "same", "`logging_steps`", 10),
        _key("save_steps", _T, "same", "`save_steps` (whole steps)", 500, translate=save_steps),
        _key("save_strategy", _T, "not_applicable", "checkpoints every `save_steps` optimizer steps and at the end", "steps", noop=save_strategy),
        _key("save_total_limit", _T, "same", "`save_total_limit`", None),
        _key("seed", _T, "same", "`seed`", 42),
        _key("bf16", _T, "translated", "`dtype: bfloat16`", None, translate=precision("bf16", "bfloat16")),
        _key("fp16", _T, "translated", "`dtype: float16` (with loss scaling)", False, translate=precision("fp16", "float16")),
        _key("gradient_checkpointing", _T, "same", "`gradient_checkpointing`", True),
        _key("activation_checkpointing", _T, "translated", "`gradient_checkpointing` (transformers 5's new name)", None, translate=lambda v, d: ({"gradient_checkpointing": bool(v)}, None) if v is not None else ({}, None)),
        _key("gradient_checkpointing_kwargs", _T, "not_applicable", "non-reentrant checkpointing is always used", None, noop=lambda v: v is None or dict(v) in ({}, {"use_reentrant": False})),
        _key("warmup_ratio", _T, "same", "`warmup_ratio`", 0.0),
        _key("warmup_steps", _T, "same", "`warmup_steps`", 0),
        _key("lr_scheduler_type", _T, "same", "`lr_scheduler_type`", "linear"),
        _key("weight_decay", _T, "same", "`weight_decay`", 0.0),
        _key("adam_beta1", _T, "same", "`adam_beta1`", 0.9),
        _key("adam_beta2", _T, "same", "`adam_beta2`", 0.999),
        _key("adam_epsilon", _T, "same", "`adam_epsilon`", 1e-8),
        _key("optim", _T, "not_applicable", "AdamW (torch; fused on CUDA) is the optimizer here", "adamw_torch", noop=optim),
        _key("max_grad_norm", _T, "same", "`max_grad_norm`", 1.0),
        _key("report_to", _T, "same", "`report_to` (jsonl, tensorboard; none = [], all = both)", "none", translate=report_to),
        _key("logging_dir", _T, "translated", "ignored: TensorBoard events go to output_dir/tensorboard", None, translate=logging_dir),
        _key("run_name", _T, "not_applicable", "runs are named by output_dir", None, noop=lambda v: True),
        _key("eval_strategy", _T, "same", "`eval_strategy` (no, steps; not epoch)", "no", translate=eval_strategy),
        _key("eval_steps", _T, "same", "`eval_steps` (a fraction below 1 of the run's steps, too)", None),
        _key("eval_on_start", _T, "same", "`eval_on_start`", False),
        _key("per_device_eval_batch_size", _T, "same", "`per_device_eval_batch_size` (completions per generate call when evaluating)", 8),
        _key("do_eval", _T, "not_applicable", "`eval_strategy: steps` decides (TRL's trainer does not read do_eval either)", False, noop=lambda v: True),
        _key("remove_unused_columns", _T, "not_applicable", "every dataset column reaches the rewards (TRL's GRPO default, false)", False, noop=is_any(False)),
        _key("resume_from_checkpoint", _T, "not_applicable", "use `grpo-plugins train CONFIG --resume [DIR]`", None, noop=is_any(None)),
        _key("push_to_hub", _T, "not_applicable", _HUB, False, noop=is_any(False)),
        _key("hub_model_id", _T, "not_applicable", _HUB, None, noop=is_any(None)),
        _key("torch_compile", _T, "translated", "`compile_layers` (compiled decoder layers)", False, translate=lambda v, d: ({"compile_layers": True}, "compile_layers: true") if v else ({}, None)),
        _key("use_liger_kernel", _T, "not_applicable", "the chunked log-softmax here already avoids full-vocabulary logits", False, noop=is_any(False)),
        _key("dataloader_num_workers", _T, "not_applicable", "prompts are read in-process", 0, noop=lambda v: True),
        _key("ddp_find_unused_parameters", _T, "not_applicable", "accelerate's DDP settings apply (accelerate config)", None, noop=lambda v: True),
        _key("deepspeed", _T, "not_applicable", "DeepSpeed is not used; for sharded training set `fsdp:` (FSDP2 through accelerate, docs/engine.md \"Several GPUs\"), for data parallel launch with accelerate or torchrun", None, noop=is_any(None)),
        _key("fsdp_config", _T, "not_applicable", "set `fsdp:` here instead (its own settings, docs/engine.md \"Several GPUs\")", None, noop=is_any(None, {})),
        # ---- TRL's command line: ModelConfig ------------------------------------------------
        _key("model_name_or_path", _M, "translated", "`model` (`model.name_or_path`: a local folder, a cached hub id, a .gguf file or builtin:NAME)", None, translate=model_key("name_or_path")),
        _key("model_revision", _M, "translated", "`model.revision`", "main", translate=model_key("revision", noop="main")),
        _key("torch_dtype", _M, "translated", "`dtype`", None, translate=torch_dtype),
        _key("attn_implementation", _M, "translated", "`model.attn_implementation`", None, translate=model_key("attn_implementation")),
        _key("use_peft", _M, "translated", "`lora:` (with TRL's LoRA defaults for the lora_* keys not given: r 16, lora_alpha 32, lora_dropout 0.05; target_modules all-linear)", False, translate=use_peft),
        _key("lora_r", _M, "translated", "`lora.r` (with use_peft or lora:)", 16, translate=lora_key("lora_r", "r", 16)),
        _key("lora_alpha", _M, "translated", "`lora.lora_alpha` (with use_peft or lora:)", 32, translate=lora_key("lora_alpha", "lora_alpha", 32)),
        _key("lora_dropout", _M, "translated", "`lora.lora_dropout` (with use_peft or lora:)", 0.05, translate=lora_key("lora_dropout", "lora_dropout", 0.05)),
        _key("lora_target_modules", _M, "translated", "`lora.target_modules` (with use_peft or lora:)", None, translate=lora_key("lora_target_modules", "target_modules", None)),
        _key("lora_modules_to_save", _M, "not_yet", "training whole modules beside the adapter is not supported yet; leave it unset", None, noop=is_any(None)),
        _key("lora_task_type", _M, "not_applicable", "always a causal LM here", "CAUSAL_LM", noop=is_any("CAUSAL_LM")),
        _key("use_rslora", _M, "not_yet", "rank-stabilised LoRA is not supported yet; the scale is lora_alpha / r", False, noop=is_any(False)),
        _key("use_dora", _M, "not_yet", "DoRA is not supported yet; use lora:", False, noop=is_any(False)),
        _key("bnb_4bit_quant_type", _M, "not_applicable", "load_in_4bit always quantises to NF4", "nf4", noop=is_any("nf4")),
        _key("use_bnb_nested_quant", _M, "not_yet", "nested (double) quantisation is not supported yet", False, noop=is_any(False)),
        # ---- TRL's command line: ScriptArguments ---------------------------------------------
        _key("dataset_name", _S, "translated", "`dataset.path` (`dataset: {path: NAME}`; local files: `{path: json, data_files: FILE}`)", None, translate=dataset_name),
        _key("dataset_config", _S, "translated", "`dataset.name`", None, translate=dataset_key("name", None)),
        _key("dataset_train_split", _S, "translated", "`dataset.split`", "train", translate=dataset_key("split", "train")),
        _key("dataset_test_split", _S, "translated", "`eval_dataset: {path: dataset_name, split: ...}` (with eval_strategy: steps)", "test", translate=dataset_test_split),
        _key("dataset_streaming", _S, "not_applicable", "prompts are read into memory", False, noop=is_any(False)),
        _key("reward_funcs", _S, "not_applicable", "list the rewards under `rewards:` (registered names, or module:function)", None, noop=is_any(None)),
    )
}
