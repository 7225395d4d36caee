"""How TRL's keys are rewritten into this project's form: the translations and value checks
that the rows of :data:`grpo_plugins.trl_keys.TRL_KEYS` name.

A translation takes ``(value, data)`` (the key's value and the whole config mapping, read-only)
and returns the keys to set (dotted paths into the config mapping) and the INFO line to log.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlparse

from grpo_plugins.config_errors import FieldError

#: What a translation returns: the keys to set (dotted paths into the config mapping) and the
#: INFO line to log (None: nothing to say, the value changes nothing).
Translation = tuple[dict[str, Any], "str | None"]


def is_any(*values: Any) -> Callable[[Any], bool]:
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


def component_param(field: str, component: str, param: str, default: Any) -> Callable[[Any, Mapping[str, Any]], Translation]:
    """A TRL key that is a param of one component (sapo's temperatures, vespo's k and λ): set
    there when ``field`` names that component, else it has no effect (as in TRL)."""

    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        if _component_name(data.get(field, FIELD_DEFAULTS.get(field))) != component:
            note = None if value == default else f"has no effect unless {field} is '{component}' (as in TRL)"
            return {}, note
        return {f"{field}.params.{param}": value}, f"{field}.params.{param}: {value!r}"

    return translate


FIELD_DEFAULTS = {"loss_type": "dapo", "rollout_correction": "token_truncate"}


def vllm_param(param: str, default: Any, *, server_only: bool = False) -> Callable[[Any, Mapping[str, Any]], Translation]:
    """A ``vllm_*`` key: a param of the ``vllm`` generator when it is used, else no effect."""

    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        mode = data.get("vllm_mode", "colocate")
        if not _uses_vllm(data) or (server_only and mode != "server"):
            need = "vllm_mode: server" if server_only else "use_vllm (generator: vllm)"
            return {}, (None if value == default else f"has no effect without {need} (as in TRL)")
        return {f"generator.params.{param}": value}, f"generator.params.{param}: {value!r}"

    return translate


def use_vllm(value: Any, data: Mapping[str, Any]) -> Translation:
    if not value:
        return {}, None
    return {"fast_inference": True}, "fast_inference: true (the vllm generator)"


def server_url(value: Any, data: Mapping[str, Any]) -> Translation:
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


def model_impl(value: Any, data: Mapping[str, Any]) -> Translation:
    if value == "vllm" or not _uses_vllm(data):
        return {}, None if value == "vllm" else "has no effect without use_vllm (as in TRL)"
    return {"generator.params.engine_kwargs.model_impl": value}, f"generator.params.engine_kwargs.model_impl: {value!r}"


def is_correction(value: Any, data: Mapping[str, Any]) -> Translation:
    """TRL corrects only when it generates with vLLM; this project's ``true`` corrects with any
    generator. A config that picks its generator TRL's way (``use_vllm``, which every TRL dump
    has) means TRL's: ``true`` without vLLM becomes ``false``."""
    if value is True and "use_vllm" in data and not _uses_vllm(data):
        return {"vllm_importance_sampling_correction": False}, "false (TRL corrects only when generating with vLLM, and use_vllm is false)"
    return {"vllm_importance_sampling_correction": value}, None


def is_mode(value: Any, data: Mapping[str, Any]) -> Translation:
    if "rollout_correction" in data and _component_name(data["rollout_correction"]) != value:
        raise FieldError(
            "vllm_importance_sampling_mode",
            f"vllm_importance_sampling_mode ({value!r}) and rollout_correction "
            f"({_component_name(data['rollout_correction'])!r}) disagree; give only one of them",
        )
    return {"rollout_correction.name": value}, f"rollout_correction: {value}"


def is_clip_max(value: Any, data: Mapping[str, Any]) -> Translation:
    legacy = data.get("vllm_importance_sampling_cap")
    if legacy is not None and legacy != value:
        # TRL: the deprecated cap, when set, replaces clip_max.
        return {}, "vllm_importance_sampling_cap is set and wins over it (as in TRL)"
    return {"vllm_importance_sampling_cap": value}, f"vllm_importance_sampling_cap: {value!r}"


def is_clip_min(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    return {"rollout_correction.params.clip_min": value}, f"rollout_correction.params.clip_min: {value!r}"


def is_cap(value: Any, data: Mapping[str, Any]) -> Translation:
    # TRL's deprecated name of clip_max; null there means "use clip_max".
    if value is None:
        return {}, None  # dropped: clip_max (or this project's default) decides
    return {"vllm_importance_sampling_cap": value}, None


#: generation_kwargs that are top-level keys here: moved there (TRL: they override those keys),
#: so the recorded sampling log-probs and the loss know the distribution that was sampled.
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_tokens": "max_completion_length",
                  "max_new_tokens": "max_completion_length"}


def generation_kwargs(value: Any, data: Mapping[str, Any]) -> Translation:
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


def top_k(value: Any, data: Mapping[str, Any]) -> Translation:
    if value == 0:
        return {"top_k": None}, None  # TRL's 0 means off, as null does here
    return {"top_k": value}, None


def pad_multiple(value: Any, data: Mapping[str, Any]) -> Translation:
    if value == "auto":  # TRL: 128 on Neuron (AWS Trainium), nothing elsewhere
        return {"pad_to_multiple_of": None}, None
    if isinstance(value, str) and value.lower() in ("none", "null"):
        return {"pad_to_multiple_of": None}, None
    return {"pad_to_multiple_of": value}, None


def _model_path(data: Mapping[str, Any], key: str) -> str:
    return f"model.{key}"


def model_init_kwargs(value: Any, data: Mapping[str, Any]) -> Translation:
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


def precision(flag: str, dtype: str) -> Callable[[Any, Mapping[str, Any]], Translation]:
    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        if not value:
            return {}, None
        if "dtype" in data and data["dtype"] not in ("auto", dtype):
            raise FieldError(flag, f"{flag}: true and dtype: {data['dtype']} disagree; give only dtype")
        return {"dtype": dtype}, f"dtype: {dtype}"

    return translate


def max_steps(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None or value == -1:  # transformers' -1: train for num_train_epochs
        return {"max_steps": None}, None
    return {"max_steps": value}, None


def report_to(value: Any, data: Mapping[str, Any]) -> Translation:
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


def eval_strategy(value: Any, data: Mapping[str, Any]) -> Translation:
    value = getattr(value, "value", value)  # transformers' IntervalStrategy enum
    if value is None:
        value = "no"
    if value == "epoch":
        raise FieldError(
            "eval_strategy", "'epoch' is not supported here; use eval_strategy: steps with eval_steps (optimizer steps)"
        )
    return {"eval_strategy": value}, None


def save_steps(value: Any, data: Mapping[str, Any]) -> Translation:
    if isinstance(value, float) and not value.is_integer():
        raise FieldError("save_steps", "a fraction of the run is not supported here; give a number of optimizer steps")
    return {"save_steps": int(value) if value is not None else None}, None


def save_strategy(value: Any) -> bool:
    return value in ("steps", None) or getattr(value, "value", None) == "steps"


def optim(value: Any) -> bool:
    return value in ("adamw_torch", "adamw_torch_fused", None) or getattr(value, "value", None) in ("adamw_torch", "adamw_torch_fused")


def logging_dir(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    return {}, "ignored: TensorBoard events go to output_dir/tensorboard"


# -- TRL's command line: ModelConfig and ScriptArguments (`trl grpo --model_name_or_path ...`) -----

#: TRL ModelConfig's LoRA defaults (r and lora_alpha are this project's defaults too).
_TRL_LORA = {"lora_r": ("r", 16), "lora_alpha": ("lora_alpha", 32), "lora_dropout": ("lora_dropout", 0.05)}


def _uses_lora(data: Mapping[str, Any]) -> bool:
    return data.get("lora") is not None or bool(data.get("use_peft"))


def use_peft(value: Any, data: Mapping[str, Any]) -> Translation:
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


def lora_key(name: str, field: str, default: Any) -> Callable[[Any, Mapping[str, Any]], Translation]:
    """A ``lora_*`` key of TRL's ModelConfig: a field of ``lora:`` when LoRA is on, else no effect."""

    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        if value is None:
            return {}, None
        if not _uses_lora(data):
            return {}, None if value == default else "has no effect without use_peft: true or lora: (as in TRL)"
        return {f"lora.{field}": value}, f"lora.{field}: {value!r}"

    return translate


def torch_dtype(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    name = _DTYPES.get(str(value).removeprefix("torch."))
    if name is None:
        raise FieldError("torch_dtype", f"unknown dtype {value!r}; write dtype: auto, bfloat16, float16 or float32")
    if "dtype" in data and data["dtype"] != name:
        raise FieldError("torch_dtype", f"torch_dtype ({value}) and dtype ({data['dtype']}) disagree; give only dtype")
    return {"dtype": name}, f"dtype: {name}"


def model_key(field: str, noop: Any = None) -> Callable[[Any, Mapping[str, Any]], Translation]:
    """A ModelConfig key that is a field of ``model:`` (``model_name_or_path`` -> ``model.name_or_path``)."""

    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        if value is None or value == noop:
            return {}, None
        return {f"model.{field}": value}, f"model.{field}: {value!r}"

    return translate


def dataset_name(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    return {"dataset.path": value}, f"dataset.path: {value!r} (read with datasets.load_dataset, as in TRL)"


def dataset_key(field: str, default: Any) -> Callable[[Any, Mapping[str, Any]], Translation]:
    """``dataset_config`` / ``dataset_train_split``: fields of ``dataset:`` when there is one."""

    def translate(value: Any, data: Mapping[str, Any]) -> Translation:
        if value is None or (value == default and data.get("dataset") is None and data.get("dataset_name") is None):
            return {}, None
        if data.get("dataset") is None and data.get("dataset_name") is None:
            return {}, "has no effect without dataset_name or dataset: (as in TRL)"
        return {f"dataset.{field}": value}, f"dataset.{field}: {value!r}"

    return translate


def dataset_test_split(value: Any, data: Mapping[str, Any]) -> Translation:
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


def tools(value: Any, data: Mapping[str, Any]) -> Translation:
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


def max_tool_calling_iterations(value: Any, data: Mapping[str, Any]) -> Translation:
    if value is None:
        return {}, None
    if _component_name(data.get("environment")) != "tool_calling" and not data.get("tools"):
        return {}, "has no effect without tools (as in TRL)"
    return {"environment.params.max_tool_calling_iterations": value}, f"environment.params.max_tool_calling_iterations: {value!r}"
