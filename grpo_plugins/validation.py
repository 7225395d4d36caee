"""The complete check of a run config, without loading a model (``grpo-plugins validate``).

Every component name is resolved in the registry, every component's params are validated by
its own params model, the rewards (or the task's default rewards) and their weights are checked,
and the batch plan is computed. All problems are collected and raised together as one
:class:`~grpo_plugins.config.ConfigError`, each with its dotted path
(``rewards.1.params.max_len: ...``). Nothing here imports torch.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from grpo_plugins.batching import BatchPlan, BatchPlanError, plan_from_config
from grpo_plugins.config import (
    ComponentRef,
    ConfigError,
    DatasetSpec,
    GRPOConfig,
    RewardSpec,
    component_ref,
    config_data,
    load_config_leniently,
)
from grpo_plugins.config_errors import validation_errors
from grpo_plugins.config_model import COMPONENT_FIELDS
from grpo_plugins.data_checks import (
    PROVIDED_ARGUMENTS,
    dataset_columns,
    describe_dataset,
    eval_prompts_problem,
    is_blank_file,
    is_local_path,
    required_arguments,
)
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.registry import Component, ComponentParamsError, Registry, registry_for

__all__ = [
    "COMPONENT_FIELDS",
    "ConfigCheck",
    "ConfigWarning",
    "check_config",
    "dataset_columns",
    "describe_dataset",
    "eval_prompts_problem",
    "required_arguments",
    "validate_config",
]


class ConfigWarning(UserWarning):
    """A config that is valid but probably not what was meant."""


@dataclass
class ConfigCheck:
    """What checking a config found: the resolved components, the batch plan and the problems."""

    config: GRPOConfig
    registry: Registry
    components: dict[str, Component] = field(default_factory=dict)  # config field -> component
    rewards: list[tuple[RewardSpec, Component]] = field(default_factory=list)
    rewards_from_task: bool = False
    plan: BatchPlan | None = None
    problems: list[tuple[str, str]] = field(default_factory=list)
    source: str | None = None  # the config file, when there is one

    @property
    def ok(self) -> bool:
        return not self.problems


def validate_config(
    config: GRPOConfig | Mapping[str, Any] | str | os.PathLike[str],
    registry: Registry | None = None,
    *,
    num_processes: int | None = None,
    overrides: Sequence[str] = (),
) -> GRPOConfig:
    """Check a config completely and return it (loaded, when given as a mapping or a path).

    Args:
        config: the config, a mapping or a YAML file.
        registry: where components are looked up; default: the process-wide registry, or a
            fresh one without ``config.disable_plugins`` when that is set.
        num_processes: for the batch plan; default ``config.num_processes``, then the
            ``WORLD_SIZE`` environment variable, then 1.
        overrides: ``key=value`` strings as given to ``--set``.

    Raises:
        ConfigError: listing every problem with its dotted path. Questionable settings emit
            :class:`ConfigWarning` (and the batch planner's warnings).
    """
    check = check_config(config, registry, num_processes=num_processes, overrides=overrides)
    if check.problems:
        raise ConfigError(check.problems, check.source)
    return check.config


#: Keys whose value the batch plan depends on: when one of them is invalid (left at its
#: default to check the rest), the plan's verdict would be about the default, so it is skipped.
BATCH_KEYS = frozenset({
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
    "num_generations", "num_processes", "num_iterations", "group_filter", "max_refill_rounds",
    "train_batch_size", "gradient_accumulation",
})


def check_config(
    config: GRPOConfig | Mapping[str, Any] | str | os.PathLike[str],
    registry: Registry | None = None,
    *,
    num_processes: int | None = None,
    overrides: Sequence[str] = (),
) -> ConfigCheck:
    """Like :func:`validate_config`, but return what was found instead of raising on problems.

    Every independent problem is found in one pass: a key with a problem (unknown, a bad value,
    a TRL key that cannot apply) is reported and left at its default while the components,
    params, data and batch arithmetic are checked; problems that would only follow from that
    default are not reported. A config that cannot be read (bad YAML) still raises
    :class:`ConfigError`.
    """
    load_problems: list[tuple[str, str]] = []
    dropped: set[str] = set()
    source = None
    if not isinstance(config, GRPOConfig) or overrides:
        data, source = config_data(config, overrides)
        loaded, load_problems, dropped = load_config_leniently(data)
        if loaded is None:
            raise ConfigError(load_problems, source)
        config = loaded
    if registry is None:
        registry = registry_for(config.disable_plugins)
    check = ConfigCheck(config=config, registry=registry, source=source)
    for name, kind in COMPONENT_FIELDS.items():
        value = _component_value(config, name)
        if value is None:
            continue
        component = _resolve(check, name, kind, value)
        if component is not None:
            check.components[name] = component
    _check_rewards(check)
    _check_group_filter(check)
    _check_model(check)
    _check_quantization(check)
    _check_generator(check)
    _check_data(check)
    _check_eval(check)
    _check_reward_columns(check)
    _check_vision(check)
    if not dropped & BATCH_KEYS:
        try:
            check.plan = plan_from_config(config, num_processes, registry)
        except BatchPlanError as exc:
            if (exc.field, str(exc)) not in check.problems:  # an unknown group_filter is reported once
                check.problems.append((exc.field, str(exc)))
    check.problems = load_problems + [p for p in check.problems if p[0].split(".")[0] not in dropped]
    _warn_questionable(config)
    return check


def _component_value(config: GRPOConfig, name: str) -> str | ComponentRef | None:
    if name == "generator":
        return config.resolved_generator
    if name == "rollout_correction" and config.vllm_importance_sampling_correction is False:
        # Not used by this run; still checked when the user chose one explicitly.
        return config.rollout_correction if "rollout_correction" in config.model_fields_set else None
    value = getattr(config, name)
    return value if value is None or isinstance(value, ComponentRef) else str(value)


def _resolve(check: ConfigCheck, path: str, kind: str, value: str | ComponentRef) -> Component | None:
    ref = value if isinstance(value, ComponentRef) else ComponentRef(name=value)
    try:
        component = check.registry.get(kind, ref.name)
    except GRPOPluginsError as exc:
        check.problems.append((path, str(exc)))
        return None
    _check_params(check, component, ref.params, f"{path}.params")
    return component


def _check_params(check: ConfigCheck, component: Component, params: dict[str, Any], path: str) -> None:
    try:
        component.validate_params(params)
    except ComponentParamsError as exc:
        for sub, msg in exc.errors:
            check.problems.append((f"{path}.{sub}" if sub else path, f"{msg} ({component.origin})"))


def _resolve_reward(name: str, registry: Registry) -> Component:
    try:
        from grpo_plugins.rewards import resolve_reward
    except ImportError:  # the rewards module is optional for this check
        return registry.get("reward", name)
    return resolve_reward(name, registry)


def _check_rewards(check: ConfigCheck) -> None:
    config = check.config
    entries: list[Any] = list(config.rewards)
    prefix = "rewards"
    task = check.components.get("task")
    if not entries and task is not None:
        entries = list(getattr(task.obj, "default_rewards", None) or [])
        prefix = "task.default_rewards"
        check.rewards_from_task = True
        if not entries:
            check.problems.append(
                ("rewards", f"task '{task.name}' has no default rewards; list the run's rewards under 'rewards:'")
            )
            return
    if not entries:
        if config.task is None:
            check.problems.append(
                ("rewards", "the run has no rewards: list some under 'rewards:' or choose a 'task:' with default rewards")
            )
        return  # an unknown task was reported already
    for i, entry in enumerate(entries):
        path = f"{prefix}.{i}"
        try:
            spec = entry if isinstance(entry, RewardSpec) else (
                RewardSpec(name=entry) if isinstance(entry, str) else RewardSpec.model_validate(entry)
            )
        except ValidationError as exc:  # a task plugin's malformed default
            detail = validation_errors(exc, RewardSpec, entry)
            check.problems.extend((f"{path}.{p}" if p else path, m) for p, m in detail)
            continue
        try:
            component = _resolve_reward(spec.name, check.registry)
        except GRPOPluginsError as exc:
            check.problems.append((path, str(exc)))
            continue
        _check_params(check, component, spec.params, f"{path}.params")
        check.rewards.append((spec, component))
    from grpo_plugins.rewards.resolution import reward_weights_mismatch

    problem = reward_weights_mismatch(config.reward_weights, [_entry_name(e) for e in entries])
    if problem is not None:
        check.problems.append(("reward_weights", problem))


def _check_group_filter(check: ConfigCheck) -> None:
    """Let the group filter check the run's reward names (e.g. accuracy_band's ``reward``)."""
    component = check.components.get("group_filter")
    if component is None or not check.rewards:
        return
    ref = component_ref(check.config.group_filter)
    assert ref is not None
    try:
        built = component.build(ref.params)
    except GRPOPluginsError:
        return  # its params were reported already
    names: list[str] = []
    for _, reward in check.rewards:  # as the reward runner names them: x, x_2, ...
        name, n = reward.name, 2
        while name in names:
            name, n = f"{reward.name}_{n}", n + 1
        names.append(name)
    try:
        getattr(built, "check_rewards", lambda names: None)(names)
    except ValueError as exc:
        check.problems.append(("group_filter.params", str(exc)))


def _entry_name(entry: Any) -> str:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, RewardSpec):
        return entry.name
    return str(entry.get("name", "?")) if isinstance(entry, Mapping) else repr(entry)


def _check_data(check: ConfigCheck) -> None:
    config = check.config
    if config.task is None and config.dataset is None:
        check.problems.append(("task", "the run has no data: set 'task:' to a task name or give a 'dataset:'"))
    if config.dataset is not None:
        files = config.dataset.data_files
        listed = [files] if isinstance(files, str) else list(files) if isinstance(files, list) else []
        for i, name in enumerate(listed):
            if not is_local_path(name) or any(c in name for c in "*?["):
                continue
            where = "dataset.data_files" + (f".{i}" if isinstance(files, list) else "")
            if not os.path.exists(name):
                check.problems.append((where, f"no such file: {name}"))
            elif is_blank_file(name):
                check.problems.append((where, f"the file is empty, so the run would have no prompts: {name}"))
        _check_prompt_column(check, config.dataset, "dataset")


def _check_prompt_column(check: ConfigCheck, spec: DatasetSpec, key: str) -> None:
    """A local dataset whose columns can be read has the prompt column (``train`` would find
    out only after loading the model)."""
    columns = dataset_columns(spec)
    if columns is None:
        return
    column = spec.prompt_column
    if column not in columns:
        close = [c for c in columns if c.lower() in ("prompt", "question", "query", "input", "instruction", "messages")]
        hint = f"set {key}.prompt_column: {close[0]}" if close else f"set {key}.prompt_column to the column that holds the prompts"
        check.problems.append(
            (f"{key}.prompt_column", f"{describe_dataset(spec)} has no column '{column}' (its columns: {', '.join(columns)}); {hint}")
        )
    elif column != "prompt" and "prompt" in columns:
        check.problems.append(
            (f"{key}.prompt_column", f"{describe_dataset(spec)} has both '{column}' and 'prompt'; rename or drop one")
        )


def _check_eval(check: ConfigCheck) -> None:
    config = check.config
    if config.eval_strategy == "steps":
        problem = eval_prompts_problem(config, check.registry)
        if problem is not None:
            check.problems.append((problem[0], f"eval_strategy: steps needs prompts to evaluate on: {problem[1]}"))
    spec = config.eval_dataset
    files = spec.data_files if spec is not None else None
    listed = [files] if isinstance(files, str) else list(files) if isinstance(files, list) else []
    for i, name in enumerate(listed):
        where = "eval_dataset.data_files" + (f".{i}" if isinstance(files, list) else "")
        if is_local_path(name) and not any(c in name for c in "*?[") and not os.path.exists(name):
            check.problems.append((where, f"no such file: {name}"))
    if spec is not None:
        _check_prompt_column(check, spec, "eval_dataset")


def _check_reward_columns(check: ConfigCheck) -> None:
    """A reward argument without a default must be a dataset column (when the columns are known)."""
    dataset = check.config.dataset
    if dataset is None or not check.rewards:
        return
    columns = dataset_columns(dataset)
    if columns is None:
        return
    # The prompt column reaches rewards as ``prompts``, not under its own name.
    available = (set(columns) - {dataset.prompt_column}) | PROVIDED_ARGUMENTS
    prefix = "task.default_rewards" if check.rewards_from_task else "rewards"
    for i, (spec, component) in enumerate(check.rewards):
        missing = [a for a in required_arguments(component.obj) if a not in available]
        if missing:
            names = ", ".join(repr(m) for m in missing)
            check.problems.append(
                (
                    f"{prefix}.{i}",
                    f"{component.origin} needs the argument(s) {names}, but dataset '{dataset.path}' "
                    f"has no such column (its columns: {', '.join(columns)}); add the column, "
                    "rename it with the reward's argument name, or choose another reward",
                )
            )


def _check_vision(check: ConfigCheck) -> None:
    """Images need a vision-language model, and it needs what supports them (vision_checks)."""
    from grpo_plugins.vision_checks import vision_problems

    dataset = check.config.dataset
    columns = dataset_columns(dataset) if dataset is not None else None
    check.problems.extend(vision_problems(check.config, columns, check.components))


def _check_model(check: ConfigCheck) -> None:
    """The model (and a local tokenizer) can be loaded as train loads them: a path that exists, a
    built-in whose file is installed, or a hub id that is in the local Hugging Face cache."""
    from grpo_plugins.models import model_source_problem

    model = check.config.model
    if isinstance(model, str):
        name, path, revision = model, "model", None
    else:
        name, path, revision = model.name_or_path, "model.name_or_path", model.revision
        if model.tokenizer is not None and is_local_path(model.tokenizer) and not os.path.exists(os.path.expanduser(model.tokenizer)):
            check.problems.append(("model.tokenizer", f"no such file or directory: {model.tokenizer}"))
    if name is not None:
        problem = model_source_problem(name, revision)
        if problem is not None:
            check.problems.append((path, problem))


def _check_quantization(check: ConfigCheck) -> None:
    """``load_in_4bit`` / ``load_in_8bit`` need bitsandbytes installed."""
    from grpo_plugins.quantization import bitsandbytes_problem

    bits = check.config.quantization_bits
    if bits is not None:
        problem = bitsandbytes_problem(bits)
        if problem is not None:
            check.problems.append((f"load_in_{bits}bit", problem))


def _check_generator(check: ConfigCheck) -> None:
    """The generator a run would use is available here (fast_inference needs vLLM installed)."""
    from grpo_plugins.generators import GeneratorUnavailableError, generator_ref

    try:
        generator_ref(check.config)
    except GeneratorUnavailableError as exc:
        check.problems.append(("fast_inference", str(exc)))


def _warn_questionable(config: GRPOConfig) -> None:
    if config.eval_strategy == "no" and (config.eval_steps is not None or config.eval_on_start):
        warnings.warn(
            "eval_steps/eval_on_start have no effect while eval_strategy is 'no' (as in TRL); set "
            "eval_strategy: steps to evaluate during training",
            ConfigWarning,
            stacklevel=3,
        )
    if config.delta is not None and config.delta <= 1 + config.epsilon:
        warnings.warn(
            f"delta ({config.delta}) is not above 1 + epsilon ({1 + config.epsilon}); two-sided "
            "GRPO is meant to cap only ratios beyond the clip range (INTELLECT-2 recommends > 1 + epsilon)",
            ConfigWarning,
            stacklevel=3,
        )
