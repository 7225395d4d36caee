"""TRL 1.16 ``GRPOConfig`` keys in a grpo-plugins config: one table, key -> what happens to it.

A TRL user brings their ``GRPOConfig`` (every key TRL 1.16 adds to transformers'
``TrainingArguments``, plus the ``TrainingArguments`` keys a GRPO user sets), and the keys of TRL's
command line (``ModelConfig``: ``model_name_or_path``, ``use_peft``, ``lora_r``, ...;
``ScriptArguments``: ``dataset_name``, ...). Each key is one
:class:`TrlKey` in :data:`TRL_KEYS`, with one of four statuses:

* ``same`` -- a field of :class:`~grpo_plugins.config.GRPOConfig` with TRL's meaning (a few TRL
  spellings of a value are rewritten, e.g. ``top_k: 0`` -> ``null``);
* ``translated`` -- rewritten into this project's form (a component's params, another field);
  the config loader logs one INFO line per key that changes something;
* ``not_applicable`` -- cannot apply here (the hub, DeepSpeed, wandb): accepted where its value
  has no effect (TRL's default), otherwise rejected with a message naming what to use instead;
* ``not_yet`` -- not supported in this version; accepted at its no-effect values, otherwise
  rejected with "not supported yet in this version: <what to use>".

:func:`translate_trl_keys` applies the table to a config mapping before validation (it runs
inside ``GRPOConfig``'s validation, so YAML, ``--set`` and Python all get it), and
:func:`trl_table_markdown` writes docs/trl.md from it (``grpo-plugins trl-reference``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlparse

from grpo_plugins.config_errors import FieldError

logger = logging.getLogger("grpo_plugins.config")

Status = Literal["same", "translated", "not_applicable", "not_yet"]
_UNSET = object()

#: What a translation returns: the keys to set (dotted paths into the config mapping) and the
#: INFO line to log (None: nothing to say, the value changes nothing).
Translation = tuple[dict[str, Any], "str | None"]


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
        default: TRL 1.16's default (documentation; ``_UNSET`` for none).
        translate: for ``translated`` (and value rewrites of ``same``): ``(value, data) ->
            (updates, note)``; ``data`` is the whole config mapping (read-only).
        noop: for ``not_applicable`` / ``not_yet``: whether a value has no effect here (accepted).
    """

    name: str
    source: Literal["GRPOConfig", "TrainingArguments", "GRPOTrainer", "ModelConfig", "ScriptArguments"]
    status: Status
    here: str
    default: Any = _UNSET
    translate: Callable[[Any, Mapping[str, Any]], Translation] | None = None
    noop: Callable[[Any], bool] | None = None


# -- helpers for the table -------------------------------------------------------------------


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v == x and type(v) is type(x) or (v is None and x is None) for x in values)


def _component_name(value: Any) -> str | None:
    if isinstance(value, str):
        return value.split(":")[-1]
    if isinstance(value, Mapping):
        name = value.get("name")
        return str(name).split(":")[-1] if name is not None else None
    return None


def _uses_vllm(data: Mapping[str, Any]) -> bool:
    generator = data.get("generator")
    if generator is not None:
        return _component_name(generator) == "vllm"
    return bool(data.get("fast_inference")) or bool(data.get("use_vllm"))


def _component_param(field: str, component: str, param: str, default: Any) -> Callable[[Any, Mapping[str, Any]], Translation]:
    """A TRL key that is a param of one component (sapo's temperatures, vespo's k and λ): set
    there when ``field`` names that component, else it has no effect (as in TRL)."""

    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        if _component_name(data.get(field, _FIELD_DEFAULTS.get(field))) != component:
            note = None if value == default else f"has no effect unless {field} is '{component}' (as in TRL)"
            return {}, note
        return {f"{field}.params.{param}": value}, f"{field}.params.{param}: {value!r}"

    return translate


_FIELD_DEFAULTS = {"loss_type": "dapo", "rollout_correction": "token_truncate"}


def _vllm_param(param: str, default: Any, *, server_only: bool = False) -> Callable[[Any, Mapping[str, Any]], Translation]:
    """A ``vllm_*`` key: a param of the ``vllm`` generator when it is used, else no effect."""

    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        mode = data.get("vllm_mode", "colocate")
        if not _uses_vllm(data) or (server_only and mode != "server"):
            need = "vllm_mode: server" if server_only else "use_vllm (generator: vllm)"
            return {}, (None if value == default else f"has no effect without {need} (as in TRL)")
        return {f"generator.params.{param}": value}, f"generator.params.{param}: {value!r}"

    return translate


def _use_vllm(value: Any, data: Mapping[str, Any]) -> Translation:
    if not value:
        return {}, None
    return {"fast_inference": True}, "fast_inference: true (the vllm generator)"


def _server_url(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    if not _uses_vllm(data):
        return {}, "has no effect without use_vllm (as in TRL)"
    url = urlparse(str(value))
    if not url.hostname:
        raise FieldError("vllm_server_base_url", f"cannot read a host from {value!r}; write it as http://HOST:PORT")
    updates: dict[str, Any] = {"generator.params.server_host": url.hostname}
    if url.port:
        updates["generator.params.server_port"] = url.port
    return updates, ", ".join(f"{k}: {v!r}" for k, v in updates.items())


def _model_impl(value: Any, data: Mapping[str, Any]) -> Translation:
    if value == "vllm" or not _uses_vllm(data):
        return {}, None if value == "vllm" else "has no effect without use_vllm (as in TRL)"
    return {"generator.params.engine_kwargs.model_impl": value}, f"generator.params.engine_kwargs.model_impl: {value!r}"


def _is_correction(value: Any, data: Mapping[str, Any]) -> Translation:
    """TRL corrects only when it generates with vLLM; this project's ``true`` corrects with any
    generator. A config that picks its generator TRL's way (``use_vllm``, which every TRL dump
    has) means TRL's: ``true`` without vLLM becomes ``false``."""
    if value is True and "use_vllm" in data and not _uses_vllm(data):
        return {"vllm_importance_sampling_correction": False}, "false (TRL corrects only when generating with vLLM, and use_vllm is false)"
    return {"vllm_importance_sampling_correction": value}, None


def _is_mode(value: Any, data: Mapping[str, Any]) -> Translation:
    if "rollout_correction" in data and _component_name(data["rollout_correction"]) != value:
        raise FieldError(
            "vllm_importance_sampling_mode",
            f"vllm_importance_sampling_mode ({value!r}) and rollout_correction "
            f"({_component_name(data['rollout_correction'])!r}) disagree; give only one of them",
        )
    return {"rollout_correction.name": value}, f"rollout_correction: {value}"


def _is_clip_max(value: Any, data: Mapping[str, Any]) -> Translation:
    legacy = data.get("vllm_importance_sampling_cap")
    if legacy is not None and legacy != value:
        # TRL: the deprecated cap, when set, replaces clip_max.
        return {}, "vllm_importance_sampling_cap is set and wins over it (as in TRL)"
    return {"vllm_importance_sampling_cap": value}, f"vllm_importance_sampling_cap: {value!r}"


def _is_clip_min(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    return {"rollout_correction.params.clip_min": value}, f"rollout_correction.params.clip_min: {value!r}"


def _is_cap(value: Any, data: Mapping[str, Any]) -> Translation:
    # TRL's deprecated name of clip_max; null there means "use clip_max".
    if value is None:
        return {}, None  # dropped: clip_max (or this project's default) decides
    return {"vllm_importance_sampling_cap": value}, None


#: generation_kwargs that are top-level keys here: moved there (TRL: they override those keys),
#: so the recorded sampling log-probs and the loss know the distribution that was sampled.
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_tokens": "max_completion_length",
                  "max_new_tokens": "max_completion_length"}


def _generation_kwargs(value: Any, data: Mapping[str, Any]) -> Translation:
    if not value:
        return {"generation_kwargs": None}, None
    if isinstance(value, str):
        value = json.loads(value)
    kwargs = dict(value)
    updates: dict[str, Any] = {}
    for key, field in _SAMPLING_KEYS.items():
        if key in kwargs:
            updates[field] = kwargs.pop(key)
            if field == "top_k" and updates[field] in (0, -1):
                updates[field] = None
    updates["generation_kwargs"] = kwargs or None
    moved = {k: v for k, v in updates.items() if k != "generation_kwargs"}
    return updates, (", ".join(f"{k}: {v!r}" for k, v in moved.items()) + " (moved out of generation_kwargs)") if moved else None


def _top_k(value: Any, data: Mapping[str, Any]) -> Translation:
    if value == 0:
        return {"top_k": None}, None  # TRL's 0 means off, as null does here
    return {"top_k": value}, None


def _pad_multiple(value: Any, data: Mapping[str, Any]) -> Translation:
    if value == "auto":  # TRL: 128 on Neuron (AWS Trainium), nothing elsewhere
        return {"pad_to_multiple_of": None}, None
    if isinstance(value, str) and value.lower() in ("none", "null"):
        return {"pad_to_multiple_of": None}, None
    return {"pad_to_multiple_of": value}, None


def _model_path(data: Mapping[str, Any], key: str) -> str:
    return f"model.{key}"


def _model_init_kwargs(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise FieldError("model_init_kwargs", "must be a mapping (or a JSON object as a string)") from None
    if not isinstance(value, Mapping):
        raise FieldError("model_init_kwargs", f"must be a mapping, got {value!r}")
    kwargs = dict(value)
    updates: dict[str, Any] = {}
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    if dtype is not None:
        dtype = str(dtype).removeprefix("torch.")
        names = {"auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16",
                 "fp16": "float16", "float32": "float32", "float": "float32", "fp32": "float32"}
        if dtype not in names:
            raise FieldError("model_init_kwargs.dtype", f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32")
        updates["dtype"] = names[dtype]
    for key in ("attn_implementation", "revision", "trust_remote_code"):
        if key in kwargs:
            updates[_model_path(data, key)] = kwargs.pop(key)
    if kwargs:
        updates["model.init_kwargs"] = kwargs
    return updates, ", ".join(f"{k}: {v!r}" for k, v in updates.items()) if updates else None


def _precision(flag: str, dtype: str) -> Callable[[Any, Mapping[str, Any]], Translation]:
    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        if not value:
            return {}, None
        if "dtype" in data and data["dtype"] not in ("auto", dtype):
            raise FieldError(flag, f"{flag}: true and dtype: {data['dtype']} disagree; give only dtype")
        return {"dtype": dtype}, f"dtype: {dtype}"

    return translate


def _max_steps(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None or value == -1:  # transformers' -1: train for num_train_epochs
        return {"max_steps": None}, None
    return {"max_steps": value}, None


def _report_to(value: Any, data: Mapping[str, Any]) -> Translation:
    items = [value] if isinstance(value, str) else list(value or [])
    if items in (["none"], []):
        return {"report_to": []}, None
    if items == ["all"]:
        return {"report_to": ["jsonl", "tensorboard"]}, None
    unknown = [i for i in items if i not in ("jsonl", "tensorboard")]
    if unknown:
        raise FieldError(
            "report_to",
            f"{', '.join(map(repr, unknown))} is not available here; metrics go to the console and "
            "report_to: [jsonl, tensorboard] (metrics.jsonl, TensorBoard events in output_dir)",
        )
    return {"report_to": items}, None


def _eval_strategy(value: Any, data: Mapping[str, Any]) -> Translation:
    value = getattr(value, "value", value)  # transformers' IntervalStrategy enum
    if value is None:
        value = "no"
    if value == "epoch":
        raise FieldError(
            "eval_strategy", "'epoch' is not supported here; use eval_strategy: steps with eval_steps (optimizer steps)"
        )
    return {"eval_strategy": value}, None


def _save_steps(value: Any, data: Mapping[str, Any]) -> Translation:
    if isinstance(value, float) and not value.is_integer():
        raise FieldError("save_steps", "a fraction of the run is not supported here; give a number of optimizer steps")
    return {"save_steps": int(value) if value is not None else None}, None


def _save_strategy(value: Any) -> bool:
    return value in ("steps", None) or getattr(value, "value", None) == "steps"


def _optim(value: Any) -> bool:
    return value in ("adamw_torch", "adamw_torch_fused", None) or getattr(value, "value", None) in ("adamw_torch", "adamw_torch_fused")


def _logging_dir(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    return {}, "ignored: TensorBoard events go to output_dir/tensorboard"


# -- TRL's command line: ModelConfig and ScriptArguments (`trl grpo --model_name_or_path ...`) -----

#: TRL ModelConfig's LoRA defaults (r and lora_alpha are this project's defaults too).
_TRL_LORA = {"lora_r": ("r", 16), "lora_alpha": ("lora_alpha", 32), "lora_dropout": ("lora_dropout", 0.05)}


def _uses_lora(data: Mapping[str, Any]) -> bool:
    return data.get("lora") is not None or bool(data.get("use_peft"))


def _use_peft(value: Any, data: Mapping[str, Any]) -> Translation:
    if not value:
        if data.get("lora") is not None:
            raise FieldError("use_peft", "use_peft: false, but the config sets lora:; give only lora: (null trains all weights)")
        return {}, None
    if data.get("lora") is not None:
        return {}, None  # lora: already says how; the lora_* keys fill it in
    # TRL's values for the keys not given (its lora_dropout is 0.05, this project's 0.0).
    updates: dict[str, Any] = {f"lora.{field}": data.get(key, default) for key, (field, default) in _TRL_LORA.items()}
    modules = data.get("lora_target_modules")
    updates["lora.target_modules"] = modules if modules is not None else "all-linear"
    shown = ", ".join(f"{k.removeprefix('lora.')}: {v}" for k, v in updates.items())
    note = f"lora: {{{shown}}}"
    if modules is None:
        note += " (without lora_target_modules, TRL leaves the choice to peft's per-model default; here all-linear)"
    return updates, note


def _lora_key(name: str, field: str, default: Any) -> Callable[[Any, Mapping[str, Any]], Translation]:
    """A ``lora_*`` key of TRL's ModelConfig: a field of ``lora:`` when LoRA is on, else no effect."""

    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        if value is None:
            return {}, None
        if not _uses_lora(data):
            return {}, None if value == default else "has no effect without use_peft: true or lora: (as in TRL)"
        return {f"lora.{field}": value}, f"lora.{field}: {value!r}"

    return translate


def _torch_dtype(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    name = _DTYPES.get(str(value).removeprefix("torch."))
    if name is None:
        raise FieldError("torch_dtype", f"unknown dtype {value!r}; write dtype: auto, bfloat16, float16 or float32")
    if "dtype" in data and data["dtype"] != name:
        raise FieldError("torch_dtype", f"torch_dtype ({value}) and dtype ({data['dtype']}) disagree; give only dtype")
    return {"dtype": name}, f"dtype: {name}"


def _model_key(field: str, noop: Any = None) -> Callable[[Any, Mapping[str, Any]], Translation]:
    """A ModelConfig key that is a field of ``model:`` (``model_name_or_path`` -> ``model.name_or_path``)."""

    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        if value is None or value == noop:
            return {}, None
        return {f"model.{field}": value}, f"model.{field}: {value!r}"

    return translate


def _dataset_name(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    return {"dataset.path": value}, f"dataset.path: {value!r} (read with datasets.load_dataset, as in TRL)"


def _dataset_key(field: str, default: Any) -> Callable[[Any, Mapping[str, Any]], Translation]:
    """``dataset_config`` / ``dataset_train_split``: fields of ``dataset:`` when there is one."""

    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        if value is None or (value == default and data.get("dataset") is None and data.get("dataset_name") is None):
            return {}, None
        if data.get("dataset") is None and data.get("dataset_name") is None:
            return {}, "has no effect without dataset_name or dataset: (as in TRL)"
        return {f"dataset.{field}": value}, f"dataset.{field}: {value!r}"

    return translate


def _dataset_test_split(value: Any, data: Mapping[str, Any]) -> Translation:
    """TRL evaluates on ``dataset_name``'s ``dataset_test_split`` when ``eval_strategy`` is not "no"."""
    name = data.get("dataset_name")
    if value is None or name is None or data.get("eval_strategy", "no") in ("no", None):
        return {}, None
    spec = {"path": name, "split": value}
    if data.get("dataset_config") is not None:
        spec["name"] = data["dataset_config"]
    return {"eval_dataset": spec}, f"eval_dataset: {spec}"


_DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16",
           "fp16": "float16", "float32": "float32", "float": "float32", "fp32": "float32"}


# -- the table ---------------------------------------------------------------------------------

_G, _T, _TR, _M, _S = "GRPOConfig", "TrainingArguments", "GRPOTrainer", "ModelConfig", "ScriptArguments"
def _tools(value: Any, data: Mapping[str, Any]) -> Translation:
    """TRL's ``tools`` (the trainer's argument): here tools are named (registered ``tool``
    components), and the ``tool_calling`` environment runs them."""
    if not value:
        return {}, None
    env = _component_name(data.get("environment"))
    if env not in (None, "tool_calling"):
        raise FieldError("tools", f"TRL's tools need environment 'tool_calling', but the config names environment {env!r}")
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise FieldError(
            "tools",
            "in a config, tools are names of registered tools (calculator, python, or a plugin's); "
            "from Python, pass functions: Engine(environment=ToolCalling(functions=[...]))",
        )
    return (
        {"environment.name": "tool_calling", "environment.params.tools": list(value)},
        f"environment: {{name: tool_calling, params: {{tools: {list(value)}}}}}",
    )


def _max_tool_calling_iterations(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    if _component_name(data.get("environment")) != "tool_calling" and not data.get("tools"):
        return {}, "has no effect without tools (as in TRL)"
    return {"environment.params.max_tool_calling_iterations": value}, f"environment.params.max_tool_calling_iterations: {value!r}"


_HUB = "there is no model hub here: checkpoints and completions stay in output_dir"


def _key(name: str, source: str, status: Status, here: str, default: Any = _UNSET, **kw: Any) -> TrlKey:
    return TrlKey(name, source, status, here, default, **kw)  # type: ignore[arg-type]


TRL_KEYS: dict[str, TrlKey] = {
    k.name: k
    for k in (
        # ---- GRPOConfig: model -------------------------------------------------------------
        _key("model_init_kwargs", _G, "translated", "dtype -> `dtype`; attn_implementation, revision, trust_remote_code -> `model.*`; the rest -> `model.init_kwargs` (from_pretrained)", None, translate=_model_init_kwargs),
        _key("trust_remote_code", _G, "translated", "`model.trust_remote_code`", False, translate=lambda v, d: ({"model.trust_remote_code": v}, f"model.trust_remote_code: {v!r}") if v else ({}, None)),
        _key("router_aux_loss_coef", _G, "not_applicable", "MoE load-balancing loss is not added here (the log-prob pass computes no router logits); leave it unset", None, noop=_is(None, 0.0, 0)),
        _key("disable_dropout", _G, "same", "`disable_dropout`", False),
        _key("cast_lm_head_to_fp32", _G, "same", "`cast_lm_head_to_fp32`", False),
        # ---- data ----------------------------------------------------------------------------
        _key("num_generations", _G, "same", "`num_generations`", 8),
        _key("num_generations_eval", _G, "same", "`num_generations_eval` (samples per eval prompt, n of pass@k)", None),
        _key("max_completion_length", _G, "same", "`max_completion_length` (here 256 by default)", 512),
        _key("ds3_gather_for_generation", _G, "not_applicable", "DeepSpeed ZeRO-3 generation without gathering is not supported; leave it true (the default)", True, noop=_is(True)),
        _key("shuffle_dataset", _G, "same", "`shuffle_dataset`", True),
        _key("pad_to_multiple_of", _G, "same", "`pad_to_multiple_of` (prompt + completion padded together; \"auto\" = null: no Neuron here)", "auto", translate=_pad_multiple),
        # ---- generation ----------------------------------------------------------------------
        _key("generation_batch_size", _G, "same", "`generation_batch_size`", None),
        _key("steps_per_generation", _G, "same", "`steps_per_generation`", None),
        _key("temperature", _G, "same", "`temperature`", 1.0),
        _key("top_p", _G, "same", "`top_p`", 1.0),
        _key("top_k", _G, "same", "`top_k` (TRL's 0 = off = null here)", 0, translate=_top_k),
        _key("min_p", _G, "same", "`min_p`", None),
        _key("generation_kwargs", _G, "same", "`generation_kwargs` (transformers and vllm generators; temperature, top_p, top_k, min_p, repetition_penalty, max_tokens move to their own keys)", None, translate=_generation_kwargs),
        _key("chat_template_kwargs", _G, "same", "`chat_template_kwargs`", None),
        _key("repetition_penalty", _G, "same", "`repetition_penalty`", 1.0),
        _key("cache_implementation", _G, "not_applicable", "use `generator: static` (a static KV cache in a CUDA graph, the default on CUDA)", None, noop=_is(None)),
        # ---- vLLM ----------------------------------------------------------------------------
        _key("use_vllm", _G, "translated", "`fast_inference: true` (the `vllm` generator)", False, translate=_use_vllm),
        _key("vllm_mode", _G, "translated", "`generator.params.mode` (colocate, server)", "colocate", translate=_vllm_param("mode", "colocate")),
        _key("vllm_model_impl", _G, "translated", "`generator.params.engine_kwargs.model_impl`", "vllm", translate=_model_impl),
        _key("vllm_enable_sleep_mode", _G, "translated", "`generator.params.enable_sleep_mode`", False, translate=_vllm_param("enable_sleep_mode", False)),
        _key("vllm_structured_outputs_regex", _G, "not_applicable", "structured outputs are not wired to the vllm generator; reward the format instead (`regex_match` reward)", None, noop=_is(None)),
        _key("vllm_server_base_url", _G, "translated", "`generator.params.server_host` / `server_port`", None, translate=_server_url),
        _key("vllm_server_host", _G, "translated", "`generator.params.server_host` (with vllm_mode: server)", "0.0.0.0", translate=_vllm_param("server_host", "0.0.0.0", server_only=True)),
        _key("vllm_server_port", _G, "translated", "`generator.params.server_port` (with vllm_mode: server)", 8000, translate=_vllm_param("server_port", 8000, server_only=True)),
        _key("vllm_server_timeout", _G, "translated", "`generator.params.server_timeout` (with vllm_mode: server)", 240.0, translate=_vllm_param("server_timeout", 240.0, server_only=True)),
        _key("vllm_group_port", _G, "translated", "`generator.params.server_group_port` (with vllm_mode: server)", 51216, translate=_vllm_param("server_group_port", 51216, server_only=True)),
        _key("vllm_gpu_memory_utilization", _G, "translated", "`generator.params.gpu_memory_utilization`", 0.3, translate=_vllm_param("gpu_memory_utilization", 0.3)),
        _key("vllm_max_model_length", _G, "translated", "`generator.params.max_model_len`", None, translate=_vllm_param("max_model_len", None)),
        _key("vllm_tensor_parallel_size", _G, "not_applicable", "one colocated vLLM engine per process here; use data parallelism (accelerate launch)", 1, noop=_is(1)),
        # ---- objective -----------------------------------------------------------------------
        _key("beta", _G, "same", "`beta`", 0.0),
        _key("num_iterations", _G, "same", "`num_iterations`", 1),
        _key("epsilon", _G, "same", "`epsilon`", 0.2),
        _key("delta", _G, "same", "`delta`", None),
        _key("epsilon_high", _G, "same", "`epsilon_high`", None),
        _key("sapo_temperature_neg", _G, "translated", "`loss_type: {name: sapo, params: {temperature_neg}}`", 1.05, translate=_component_param("loss_type", "sapo", "temperature_neg", 1.05)),
        _key("sapo_temperature_pos", _G, "translated", "`loss_type: {name: sapo, params: {temperature_pos}}`", 1.0, translate=_component_param("loss_type", "sapo", "temperature_pos", 1.0)),
        _key("vespo_k_pos", _G, "translated", "`loss_type: {name: vespo, params: {k_pos}}`", 2.0, translate=_component_param("loss_type", "vespo", "k_pos", 2.0)),
        _key("vespo_lambda_pos", _G, "translated", "`loss_type: {name: vespo, params: {lambda_pos}}`", 3.0, translate=_component_param("loss_type", "vespo", "lambda_pos", 3.0)),
        _key("vespo_k_neg", _G, "translated", "`loss_type: {name: vespo, params: {k_neg}}`", 3.0, translate=_component_param("loss_type", "vespo", "k_neg", 3.0)),
        _key("vespo_lambda_neg", _G, "translated", "`loss_type: {name: vespo, params: {lambda_neg}}`", 2.0, translate=_component_param("loss_type", "vespo", "lambda_neg", 2.0)),
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
        _key("max_tool_calling_iterations", _G, "translated", "`environment: {name: tool_calling, params: {max_tool_calling_iterations}}`", None, translate=_max_tool_calling_iterations),
        _key("tools", _TR, "translated", "`environment: {name: tool_calling, params: {tools: [names]}}` (registered tools: calculator, python, plugins'; functions from Python: `Engine(environment=ToolCalling(functions=[...]))`)", None, translate=_tools),
        _key("vllm_importance_sampling_correction", _G, "same", "`vllm_importance_sampling_correction`. TRL corrects only with vLLM; in a config that has `use_vllm` (every TRL dump) `true` keeps that meaning (`false` unless `use_vllm` / the vllm generator is on); otherwise `true` here corrects with any generator, and `auto` (this project's default) is TRL's behaviour", True, translate=_is_correction),
        _key("vllm_importance_sampling_mode", _G, "translated", "`rollout_correction` (same four names)", "sequence_mask", translate=_is_mode),
        _key("vllm_importance_sampling_clip_max", _G, "translated", "`vllm_importance_sampling_cap`", 3.0, translate=_is_clip_max),
        _key("vllm_importance_sampling_clip_min", _G, "translated", "`rollout_correction.params.clip_min`", None, translate=_is_clip_min),
        _key("off_policy_mask_threshold", _G, "same", "`off_policy_mask_threshold`", None),
        _key("use_bias_correction_kl", _G, "same", "`use_bias_correction_kl` (default false here, true in TRL)", True),
        # ---- logging -------------------------------------------------------------------------
        _key("log_completions", _G, "same", "`log_completions` (writes completions.jsonl)", False),
        _key("log_multimodal", _G, "not_applicable", "no multimodal inputs here; any value is accepted and changes nothing", True, noop=lambda v: True),
        _key("num_completions_to_print", _G, "same", "`num_completions_to_print` (null prints none here; TRL prints all)", None),
        _key("log_unique_prompts", _G, "same", "`log_unique_prompts`", False),
        _key("log_completions_hub_repo", _G, "not_applicable", f"{_HUB}; `log_completions: true` writes output_dir/completions.jsonl", None, noop=_is(None)),
        _key("use_transformers_continuous_batching", _G, "not_applicable", "use `generator: static` (CUDA) or `vllm`", False, noop=_is(False)),
        _key("transformers_continuous_batching_config", _G, "not_applicable", "use `generator: static` (CUDA) or `vllm`", None, noop=_is(None)),
        _key("use_transformers_paged", _G, "not_applicable", "use `generator: static` (CUDA) or `vllm`", False, noop=_is(False)),
        _key("vllm_importance_sampling_cap", _G, "same", "`vllm_importance_sampling_cap` (TRL's deprecated name of clip_max; null: use clip_max)", None, translate=_is_cap),
        # ---- TrainingArguments a GRPO user sets ----------------------------------------------
        _key("output_dir", _T, "same", "`output_dir`"),
        _key("learning_rate", _T, "same", "`learning_rate`", 1e-6),
        _key("per_device_train_batch_size", _T, "same", "`per_device_train_batch_size`", 8),
        _key("gradient_accumulation_steps", _T, "same", "`gradient_accumulation_steps`", 1),
        _key("max_steps", _T, "same", "`max_steps` (-1 = null: num_train_epochs)", -1, translate=_max_steps),
        _key("num_train_epochs", _T, "same", "`num_train_epochs`", 3.0),
        _key("logging_steps", _T, "same", "`logging_steps`", 10),
        _key("save_steps", _T, "same", "`save_steps` (whole steps)", 500, translate=_save_steps),
        _key("save_strategy", _T, "not_applicable", "checkpoints every `save_steps` optimizer steps and at the end", "steps", noop=_save_strategy),
        _key("save_total_limit", _T, "same", "`save_total_limit`", None),
        _key("seed", _T, "same", "`seed`", 42),
        _key("bf16", _T, "translated", "`dtype: bfloat16`", None, translate=_precision("bf16", "bfloat16")),
        _key("fp16", _T, "translated", "`dtype: float16` (with loss scaling)", False, translate=_precision("fp16", "float16")),
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
        _key("optim", _T, "not_applicable", "AdamW (torch; fused on CUDA) is the optimizer here", "adamw_torch", noop=_optim),
        _key("max_grad_norm", _T, "same", "`max_grad_norm`", 1.0),
        _key("report_to", _T, "same", "`report_to` (jsonl, tensorboard; none = [], all = both)", "none", translate=_report_to),
        _key("logging_dir", _T, "translated", "ignored: TensorBoard events go to output_dir/tensorboard", None, translate=_logging_dir),
        _key("run_name", _T, "not_applicable", "runs are named by output_dir", None, noop=lambda v: True),
        _key("eval_strategy", _T, "same", "`eval_strategy` (no, steps; not epoch)", "no", translate=_eval_strategy),
        _key("eval_steps", _T, "same", "`eval_steps` (a fraction below 1 of the run's steps, too)", None),
        _key("eval_on_start", _T, "same", "`eval_on_start`", False),
        _key("per_device_eval_batch_size", _T, "same", "`per_device_eval_batch_size` (completions per generate call when evaluating)", 8),
        _key("do_eval", _T, "not_applicable", "`eval_strategy: steps` decides (TRL's trainer does not read do_eval either)", False, noop=lambda v: True),
        _key("remove_unused_columns", _T, "not_applicable", "every dataset column reaches the rewards (TRL's GRPO default, false)", False, noop=_is(False)),
        _key("resume_from_checkpoint", _T, "not_applicable", "use `grpo-plugins train CONFIG --resume [DIR]`", None, noop=_is(None)),
        _key("push_to_hub", _T, "not_applicable", _HUB, False, noop=_is(False)),
        _key("hub_model_id", _T, "not_applicable", _HUB, None, noop=_is(None)),
        _key("torch_compile", _T, "translated", "`compile_layers` (compiled decoder layers)", False, translate=lambda v, d: ({"compile_layers": True}, "compile_layers: true") if v else ({}, None)),
        _key("use_liger_kernel", _T, "not_applicable", "the chunked log-softmax here already avoids full-vocabulary logits", False, noop=_is(False)),
        _key("dataloader_num_workers", _T, "not_applicable", "prompts are read in-process", 0, noop=lambda v: True),
        _key("ddp_find_unused_parameters", _T, "not_applicable", "accelerate's DDP settings apply (accelerate config)", None, noop=lambda v: True),
        _key("deepspeed", _T, "not_applicable", "DeepSpeed is not used; for sharded training set `fsdp:` (FSDP2 through accelerate, docs/engine.md \"Several GPUs\"), for data parallel launch with accelerate or torchrun", None, noop=_is(None)),
        _key("fsdp_config", _T, "not_applicable", "set `fsdp:` here instead (its own settings, docs/engine.md \"Several GPUs\")", None, noop=_is(None, {})),
        # ---- TRL's command line: ModelConfig ------------------------------------------------
        _key("model_name_or_path", _M, "translated", "`model` (`model.name_or_path`: a local folder, a cached hub id, a .gguf file or builtin:NAME)", None, translate=_model_key("name_or_path")),
        _key("model_revision", _M, "translated", "`model.revision`", "main", translate=_model_key("revision", noop="main")),
        _key("torch_dtype", _M, "translated", "`dtype`", None, translate=_torch_dtype),
        _key("attn_implementation", _M, "translated", "`model.attn_implementation`", None, translate=_model_key("attn_implementation")),
        _key("use_peft", _M, "translated", "`lora:` (with TRL's LoRA defaults for the lora_* keys not given: r 16, lora_alpha 32, lora_dropout 0.05; target_modules all-linear)", False, translate=_use_peft),
        _key("lora_r", _M, "translated", "`lora.r` (with use_peft or lora:)", 16, translate=_lora_key("lora_r", "r", 16)),
        _key("lora_alpha", _M, "translated", "`lora.lora_alpha` (with use_peft or lora:)", 32, translate=_lora_key("lora_alpha", "lora_alpha", 32)),
        _key("lora_dropout", _M, "translated", "`lora.lora_dropout` (with use_peft or lora:)", 0.05, translate=_lora_key("lora_dropout", "lora_dropout", 0.05)),
        _key("lora_target_modules", _M, "translated", "`lora.target_modules` (with use_peft or lora:)", None, translate=_lora_key("lora_target_modules", "target_modules", None)),
        _key("lora_modules_to_save", _M, "not_yet", "training whole modules beside the adapter is not supported yet; leave it unset", None, noop=_is(None)),
        _key("lora_task_type", _M, "not_applicable", "always a causal LM here", "CAUSAL_LM", noop=_is("CAUSAL_LM")),
        _key("use_rslora", _M, "not_yet", "rank-stabilised LoRA is not supported yet; the scale is lora_alpha / r", False, noop=_is(False)),
        _key("use_dora", _M, "not_yet", "DoRA is not supported yet; use lora:", False, noop=_is(False)),
        _key("bnb_4bit_quant_type", _M, "not_applicable", "load_in_4bit always quantises to NF4", "nf4", noop=_is("nf4")),
        _key("use_bnb_nested_quant", _M, "not_yet", "nested (double) quantisation is not supported yet", False, noop=_is(False)),
        # ---- TRL's command line: ScriptArguments ---------------------------------------------
        _key("dataset_name", _S, "translated", "`dataset.path` (`dataset: {path: NAME}`; local files: `{path: json, data_files: FILE}`)", None, translate=_dataset_name),
        _key("dataset_config", _S, "translated", "`dataset.name`", None, translate=_dataset_key("name", None)),
        _key("dataset_train_split", _S, "translated", "`dataset.split`", "train", translate=_dataset_key("split", "train")),
        _key("dataset_test_split", _S, "translated", "`eval_dataset: {path: dataset_name, split: ...}` (with eval_strategy: steps)", "test", translate=_dataset_test_split),
        _key("dataset_streaming", _S, "not_applicable", "prompts are read into memory", False, noop=_is(False)),
        _key("reward_funcs", _S, "not_applicable", "list the rewards under `rewards:` (registered names, or module:function)", None, noop=_is(None)),
    )
}

#: TRL keys that are also fields here, so the table does not own them (their TRL values are
#: still rewritten where TRL spells them differently).
def _field_names() -> set[str]:
    from grpo_plugins.config import GRPOConfig

    return set(GRPOConfig.model_fields)


def translate_trl_keys(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Apply :data:`TRL_KEYS` to a config mapping: the mapping with TRL keys rewritten into this
    project's form, and the INFO lines to log (``"key -> what"``).

    Raises:
        FieldError: a TRL key with a value that cannot apply here (the message says what to use
            instead), or two keys that disagree.
    """
    fields = _field_names()
    out = dict(data)
    notes: list[str] = []
    updates: list[tuple[str, str, Any]] = []  # (TRL key, path, value)
    for name, value in data.items():
        entry = TRL_KEYS.get(name)
        if entry is None:
            continue
        if entry.status in ("not_applicable", "not_yet"):
            assert entry.noop is not None
            if not entry.noop(value):
                what = "cannot apply here: " if entry.status == "not_applicable" else "is "
                raise FieldError(name, f"TRL's {name}={value!r} {what}{entry.here}")
            out.pop(name)
            continue
        if entry.translate is None:
            continue  # a field here with TRL's meaning and spelling
        changes, note = entry.translate(value, data)
        if name not in fields or name not in changes:
            out.pop(name, None)
        for path, new in changes.items():
            updates.append((name, path, new))
        if note:
            notes.append(f"TRL key {name}: {note}")
    for name, path, value in updates:
        _put(out, path, value, name)
    return out, notes


def _put(data: dict[str, Any], path: str, value: Any, source: str) -> None:
    """Set a dotted path in the mapping, expanding a bare component name (``loss_type: sapo``)
    into ``{name: sapo}``; a key the user also gave directly must agree."""
    parts = path.split(".")
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            if depth == 0 and part in _FIELD_DEFAULTS:
                child = {"name": _FIELD_DEFAULTS[part]}
            elif depth == 0 and part == "generator":
                child = {"name": "vllm"}
            else:
                child = {}
        elif isinstance(child, str):
            child = {"name_or_path" if depth == 0 and part == "model" else "name": child}
        elif isinstance(child, Mapping):
            child = dict(child)
        else:
            raise FieldError(source, f"cannot set {path} from TRL's {source}: {part} is {child!r}")
        node[part] = child
        node = child
    last = parts[-1]
    # A nested key the config also gives directly must agree (top-level ones are checked by
    # their translations).
    if len(parts) > 1 and last != "name" and last in node and node[last] != value:
        raise FieldError(source, f"TRL's {source} sets {path} to {value!r}, but the config gives {node[last]!r}; give only one of them")
    node[last] = value


def log_notes(notes: list[str]) -> None:
    """One INFO line per translated TRL key."""
    for note in notes:
        logger.info("%s", note)


def trl_table_markdown() -> str:
    """docs/trl.md: every TRL key and what happens to it here (generated; a test checks it)."""
    labels = {
        "same": "same",
        "translated": "translated",
        "not_applicable": "cannot apply",
        "not_yet": "not yet",
    }

    def show(value: Any) -> str:
        return "" if value is _UNSET else f"`{json.dumps(value)}`"

    lines = [
        "# TRL GRPOConfig keys",
        "",
        "<!-- Generated from grpo_plugins/trl_compat.py by",
        "     `grpo-plugins trl-reference --output docs/trl.md`; do not edit by hand. -->",
        "",
        "A TRL 1.16 `GRPOConfig` can be used as a grpo-plugins config: write its keys flat in the YAML",
        "file (or pass them to `Engine({...})`). Every key that TRL 1.16's `GRPOConfig` adds to",
        "transformers' `TrainingArguments`, and the `TrainingArguments` keys a GRPO user sets, is",
        "handled in one of four ways; so are the keys of TRL's command line (`trl grpo`: `ModelConfig`'s",
        "`model_name_or_path`, `use_peft`, `lora_r`, ... and `ScriptArguments`' `dataset_name`, ...):",
        "",
        "- **same**: a key of this project with TRL's meaning (a few TRL spellings of a value are",
        "  rewritten, e.g. `top_k: 0` means off, as `null` does here);",
        "- **translated**: rewritten into this project's form (a component's params, another key);",
        "  loading the config logs one `TRL key ...` INFO line for each such key that changes",
        "  something (`grpo-plugins validate` prints them);",
        "- **cannot apply**: accepted at values that have no effect here (TRL's default), otherwise",
        "  an error that names what to use instead;",
        "- **not yet**: the same, with \"not supported yet in this version\".",
        "",
        "A config dumped from TRL with every key at TRL's default",
        "(`dataclasses.asdict(GRPOConfig(...))` minus `TrainingArguments`' own keys) validates",
        "(tested). Where the defaults differ, a key you leave out gets this project's default",
        "(e.g. `max_completion_length` 256, `use_bias_correction_kl` false, `logging_steps` 1); a",
        "key you write gets your value.",
        "",
        "Such a dump trains as TRL would: its rollout correction (TRL's default",
        "`vllm_importance_sampling_correction: true`, `sequence_mask` with a cap of 3) is on only",
        "when it generates with vLLM (`use_vllm: true`), as in TRL. Without vLLM the correction is",
        "off (`true` is loaded as `false`, with an INFO line), because TRL never corrects then. This",
        "reading applies to a config that chooses its generator with TRL's `use_vllm`; in a config",
        "that does not, `vllm_importance_sampling_correction: true` has this project's meaning",
        "(correct against whatever generator samples; `auto`, the default, corrects exactly when",
        "the generator is not the trained policy). With vLLM the sampler's log-probs reach the",
        "off-policy mask (`off_policy_mask_threshold`) even with the correction off, as in TRL;",
        "the `sampling/sampling_logp_difference` metrics are then logged too (TRL logs them only",
        "with the correction on).",
        "",
        "| TRL key | from | TRL default | status | here |",
        "|---|---|---|---|---|",
    ]
    for source in ("GRPOConfig", "TrainingArguments", "GRPOTrainer", "ModelConfig", "ScriptArguments"):
        for k in TRL_KEYS.values():
            if k.source == source:
                here = k.here.replace("|", "\\|")
                lines.append(f"| `{k.name}` | {source} | {show(k.default)} | {labels[k.status]} | {here} |")
    return "\n".join(lines) + "\n"
