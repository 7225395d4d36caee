"""The run configuration, loaded from YAML (or a mapping) and overridable with ``--set``.

The model itself, :class:`GRPOConfig`, lives in :mod:`grpo_plugins.config_model` and its
sections in :mod:`grpo_plugins.config_specs`; they are all importable from here.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from grpo_plugins.config_errors import ConfigError, FieldError, validation_errors
from grpo_plugins.config_model import COMPONENT_FIELDS, CONFIG_SECTIONS, GRPOConfig
from grpo_plugins.config_specs import (
    ComponentRef,
    DatasetSpec,
    DType,
    FSDPSettings,
    LoraSettings,
    ModelSpec,
    RewardSpec,
    component_ref,
)
from grpo_plugins.trl_keys import TRL_KEYS

__all__ = [
    "CONFIG_ALIASES",
    "CONFIG_SECTIONS",
    "SEED_ALIASES",
    "ComponentRef",
    "ConfigError",
    "DType",
    "DatasetSpec",
    "FSDPSettings",
    "GRPOConfig",
    "LoraSettings",
    "ModelSpec",
    "RewardSpec",
    "component_param_hint",
    "component_ref",
    "config_data",
    "load_config",
    "load_config_leniently",
    "parse_override",
]


# -- loading: YAML, --set overrides, readable errors -------------------------------------------

#: Short aliases of two batch fields (see ``GRPOConfig._aliases``).
SEED_ALIASES = ("train_batch_size", "gradient_accumulation")


def _accepted_aliases() -> tuple[str, ...]:
    return (*SEED_ALIASES, *(k for k in TRL_KEYS if k not in GRPOConfig.model_fields))


#: Top-level keys accepted besides the field names (see ``GRPOConfig._aliases``): two seed
#: aliases and TRL's GRPOConfig keys (grpo_plugins.trl_compat).
CONFIG_ALIASES = _accepted_aliases()


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | GRPOConfig | None = None,
    overrides: Iterable[str] = (),
) -> GRPOConfig:
    """Load a run config from a YAML file (or a mapping) and apply ``key=value`` overrides.

    Args:
        source: a YAML file, a mapping of config keys, an existing config, or None (defaults).
        overrides: ``key=value`` strings as given to ``--set``; the value is parsed as YAML
            (``3`` is an int, ``[a, b]`` a list, ``null`` None) and the key may be dotted
            (``model.name_or_path``, ``rewards.0.weight``, ``loss_type.params.tau``).

    Raises:
        ConfigError: listing every problem with its dotted path; unknown keys come with a
            "did you mean" suggestion.
    """
    data, where = config_data(source, overrides)
    try:
        return GRPOConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_readable(exc, data), where) from None


def config_data(
    source: str | os.PathLike[str] | Mapping[str, Any] | GRPOConfig | None, overrides: Iterable[str] = ()
) -> tuple[dict[str, Any], str | None]:
    """The raw mapping of a config (read, YAML parsed, ``--set`` overrides applied) and the file
    it came from (None for a mapping).

    Raises:
        ConfigError: an unreadable file, invalid YAML, not a mapping, or a malformed override.
    """
    import yaml

    where: str | None = None
    if source is None:
        data: Any = {}
    elif isinstance(source, GRPOConfig):
        data = source.model_dump(exclude_unset=True)
    elif isinstance(source, Mapping):
        data = copy.deepcopy(dict(source))
    else:
        where = os.fspath(source)
        try:
            text = Path(where).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError([("", f"cannot read the config file: {exc.strerror or exc}")], where) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError([("", f"not valid YAML: {at}{problem}")], where) from None
        if data is None:
            data = {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"the config must be a mapping of keys to values, got {type(data).__name__}")], where)
    problems: list[tuple[str, str]] = []
    for item in overrides:
        try:
            _apply_override(data, item)
        except FieldError as exc:
            problems.append((exc.field, str(exc)))
    if problems:
        raise ConfigError(problems, where)
    return data, where


def load_config_leniently(data: Mapping[str, Any]) -> tuple[GRPOConfig | None, list[tuple[str, str]], set[str]]:
    """Load as much of a config mapping as is valid, to check the rest in the same pass.

    Each top-level key with a problem (an unknown key, a bad value, a TRL key that cannot apply)
    is left out and the rest loaded again, until it loads; a check that stops at its first
    problem (a TRL refusal) thus does not hide the others.

    Returns:
        The config with those keys at their defaults (None when a problem concerns no single
        key), every problem found, and the keys left out.
    """
    data = dict(data)
    problems: list[tuple[str, str]] = []
    dropped: set[str] = set()
    while True:
        try:
            return GRPOConfig.model_validate(data), problems, dropped
        except ValidationError as exc:
            found = [p for p in _readable(exc, data) if p not in problems]
        problems.extend(found)
        roots = {path.split(".")[0] for path, _ in found} & set(data)
        if not roots:  # nothing new, or a problem that no single key causes
            return None, problems, dropped
        for root in roots:
            data.pop(root)
        dropped |= roots


def _readable(exc: ValidationError, data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The problems of a failed validation, each ``(dotted path, message)``."""
    problems = validation_errors(exc, GRPOConfig, data, extra_keys=CONFIG_ALIASES)
    return [(path, (msg.startswith("unknown key") and component_param_hint(path)) or msg) for path, msg in problems]


def component_param_hint(key: str) -> str | None:
    """For an unknown top-level ``key`` that is a param of a registered component (a generator's
    ``release_cache``, say): where to write it. None when no component has such a param."""
    if "." in key:
        return None
    from grpo_plugins.registry import get_registry

    try:
        components = get_registry().components()
    except Exception:  # the hint must never hide the error it adds to
        return None
    owners = [
        c for c in components
        if c.kind in COMPONENT_FIELDS.values() and c.params_model is not None and key in c.params_model.model_fields
    ]
    if not owners:
        return None
    first = owners[0]
    field = next(f for f, kind in COMPONENT_FIELDS.items() if kind == first.kind)
    which = ", ".join(f"{c.kind} '{c.name}'" for c in owners)
    return (
        f"unknown key '{key}'; it is a param of the {which}: write it under that component's params, "
        f"e.g. {field}: {{name: {first.name}, params: {{{key}: ...}}}}"
    )


def parse_override(item: str) -> tuple[str, Any]:
    """``"a.b=value"`` -> ``("a.b", parsed value)``, the value parsed as YAML."""
    import yaml

    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise FieldError(key or item, f"--set expects key=value, got {item!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: take the text as it is
    return key, value


def _apply_override(data: dict[str, Any], item: str) -> None:
    key, value = parse_override(item)
    parts = key.split(".")
    node: Any = data
    for depth, part in enumerate(parts[:-1]):
        child = _child(node, part, key)
        if child is _MISSING:
            fields = GRPOConfig.model_fields
            child = fields[part].get_default(call_default_factory=True) if depth == 0 and part in fields else None
            child = copy.deepcopy(child.model_dump() if isinstance(child, BaseModel) else child)
        if child is None:
            child = {}
        elif isinstance(child, str):  # a bare name gets a sub-key: expand to its mapping form
            child = {"name_or_path" if (depth == 0 and part == "model") else "name": child}
        elif not isinstance(child, (dict, list)):
            raise FieldError(key, f"cannot set {key}: {'.'.join(parts[: depth + 1])} is {child!r}, not a mapping")
        _put(node, part, child, key)
        node = child
    _put(node, parts[-1], value, key)


_MISSING = object()


def _child(node: Any, part: str, key: str) -> Any:
    if isinstance(node, list):
        index = _index(node, part, key)
        return node[index] if index < len(node) else _MISSING
    return node.get(part, _MISSING)


def _put(node: Any, part: str, value: Any, key: str) -> None:
    if isinstance(node, list):
        index = _index(node, part, key)
        if index == len(node):
            node.append(value)
        else:
            node[index] = value
    else:
        node[part] = value


def _index(node: list[Any], part: str, key: str) -> int:
    try:
        index = int(part)
    except ValueError:
        raise FieldError(key, f"cannot set {key}: '{part}' must be a list index (0 to {len(node)})") from None
    if not 0 <= index <= len(node):
        raise FieldError(key, f"cannot set {key}: index {index} is out of range (the list has {len(node)} items)")
    return index
