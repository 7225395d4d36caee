"""Readable config errors: pydantic's ValidationError as one ``(dotted path, message)`` per problem.

pydantic reports a value that fits no member of a union once per member, with the members' tags
(``str``, ``function-after[...]``, a model name) inside the error location. :func:`validation_errors`
drops those tags from the path, folds the alternatives into one "expected a string or a mapping
(RewardSpec), got 5", and gives unknown keys a "did you mean" suggestion.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from grpo_plugins.errors import GRPOPluginsError

_MISSING = object()


class FieldError(ValueError):
    """Raised inside validators to attach a message to a specific field's path."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class ConfigError(GRPOPluginsError, ValueError):
    """An invalid run config: every problem found, each as (dotted path, message).

    Args:
        errors: ``(path, message)`` pairs; the path is like ``rewards.1.params.max_len``
            ("" for the config as a whole).
        source: the config file, when there is one.
    """

    def __init__(self, errors: list[tuple[str, str]], source: str | None = None):
        self.errors = list(errors)
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        where = f" ({self.source})" if self.source else ""
        lines = [f"{p}: {m}" if p else m for p, m in self.errors]
        if len(lines) == 1:
            return f"invalid config{where}: {lines[0]}"
        return f"invalid config{where}, {len(lines)} problems:\n" + "\n".join(f"  {line}" for line in lines)


# A union member tag in a pydantic error location: 'str', 'list[str]', "literal['a']",
# 'function-after[check(), ModelSpec]', or a model class name.
_TAG = re.compile(r"^(str|int|float|bool|none|bytes|[a-z-]+\[.*\])$")
_TYPE_ERRORS = {
    "string_type", "bool_type", "bool_parsing", "int_type", "int_parsing", "int_from_float",
    "float_type", "float_parsing", "model_type", "model_attributes_type", "dict_type",
    "list_type", "literal_error", "none_required", "is_instance_of",
}


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and (bool(_TAG.match(part)) or part[:1].isupper())


def _tag_model(tag: str) -> str | None:
    """The model class a union tag names ('ModelSpec', 'function-after[f(), ModelSpec]')."""
    match = re.search(r"([A-Z]\w*)\]?$", tag)
    return match.group(1) if match and (tag[:1].isupper() or tag.startswith("function-")) else None


def _describe_tag(tag: str, msg: str) -> str:
    simple = {"str": "a string", "int": "a whole number", "float": "a number", "bool": "true or false", "none": "null"}
    if tag in simple:
        return simple[tag]
    if tag.startswith("literal["):
        return msg.removeprefix("Input should be ")
    if tag.startswith("list["):
        return "a list"
    if tag.startswith("dict["):
        return "a mapping"
    model = _tag_model(tag)
    return f"a mapping ({model})" if model else tag


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out.extend(_models_in(arg))
    return out


def _model_at(root: type[BaseModel], path: list[Any], tag: str | None) -> type[BaseModel] | None:
    """The pydantic model that validates the mapping at ``path`` (None if unknown)."""
    candidates: list[type[BaseModel]] = [root]
    for part in path:
        if isinstance(part, int):
            continue
        fields = {n: f for c in candidates for n, f in c.model_fields.items()}
        if part not in fields:
            return None
        candidates = _models_in(fields[part].annotation)
    if tag is not None:
        named = [c for c in candidates if c.__name__ == _tag_model(tag)]
        candidates = named or candidates
    return candidates[0] if len(candidates) == 1 else None


def accepted_keys(model: type[BaseModel]) -> dict[str, str]:
    """The keys a mapping for ``model`` may contain -> the field each one sets (a field with an
    alias is written as its alias, and also by its name when the model allows it)."""
    by_name = bool(model.model_config.get("populate_by_name") or model.model_config.get("validate_by_name"))
    keys: dict[str, str] = {}
    for name, info in model.model_fields.items():
        keys[info.alias or name] = name
        if info.alias is None or by_name:
            keys[name] = name
    return keys


def model_key_message(key: str, model: type[BaseModel]) -> str:
    """The message for ``key`` not accepted by ``model`` (a field written by its name although
    it must be written as its alias gets that alias)."""
    keys = accepted_keys(model)
    aliases = {name: alias for alias, name in keys.items() if alias != name}
    if key in aliases and key not in keys:
        return f"unknown key '{key}'; write it as '{aliases[key]}'"
    return unknown_key_message(key, keys)


def unknown_key_message(key: str, allowed: Iterable[str]) -> str:
    """``unknown key 'x'; did you mean 'y'?`` (listing the allowed keys when they are few)."""
    allowed = sorted(allowed)
    msg = f"unknown key '{key}'"
    close = difflib.get_close_matches(key, allowed, n=3, cutoff=0.6)
    if close:
        return msg + f"; did you mean {' or '.join(repr(c) for c in close)}?"
    if len(allowed) <= 12:
        return msg + f"; allowed keys: {', '.join(allowed)}"
    return msg + " (see docs/config.md for the accepted keys)"


def validation_errors(
    exc: ValidationError, model: type[BaseModel], data: Any, *, extra_keys: Sequence[str] = ()
) -> list[tuple[str, str]]:
    """Turn a pydantic ValidationError into one ``(dotted path, message)`` per real problem.

    ``extra_keys`` are keys ``model`` accepts besides its fields (aliases handled before
    validation), offered in "did you mean" suggestions for unknown top-level keys.

    Union members are folded (``rewards.1: expected a string or a mapping (RewardSpec), got 5``
    rather than one error per member), union tags are dropped from the path, and unknown keys get
    a "did you mean" suggestion.
    """
    entries = []  # (path, tag, at_tag, error)
    for err in exc.errors():
        path: list[Any] = []
        node: Any = data
        tag: str | None = None
        tag_depth: int | None = None
        loc = list(err["loc"])
        for i, part in enumerate(loc):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                node = node[part]
            elif _is_tag(part) and i < len(loc) - 1 + (err["type"] != "missing"):
                if tag is None:
                    tag, tag_depth = part, len(path)
                continue
            else:
                node = _MISSING
            path.append(part)
        at_tag = tag is not None and tag_depth == len(path)
        entries.append((path, tag, tag_depth, at_tag, err))

    # Fold the alternatives of each union into the member the input was meant for.
    out: list[tuple[str, str]] = []
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for entry in entries:
        path, tag, tag_depth, _, _ = entry
        key = tuple(path[:tag_depth]) if tag is not None else ("<no-union>", id(entry))
        groups.setdefault(key, []).append(entry)
    for key, group in groups.items():
        if group[0][1] is None:
            out.extend(_one_error(model, e[0], None, e[4], extra_keys) for e in group)
            continue
        matched = [e for e in group if not e[3] or e[4]["type"] not in _TYPE_ERRORS]
        if matched:
            out.extend(_one_error(model, e[0], e[1], e[4], extra_keys) for e in matched)
        else:
            wanted = []
            for e in group:
                text = _describe_tag(e[1], e[4]["msg"])
                if text not in wanted:
                    wanted.append(text)
            got = repr(group[0][4].get("input"))
            got = got if len(got) <= 80 else got[:77] + "..."
            out.append((_dotted(list(key)), f"expected {' or '.join(wanted)}, got {got}"))
    unique: list[tuple[str, str]] = []
    for item in out:
        if item not in unique:
            unique.append(item)
    return unique


def _one_error(
    root: type[BaseModel], path: list[Any], tag: str | None, err: Any, extra_keys: Sequence[str]
) -> tuple[str, str]:
    msg: str = err["msg"]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return cause.field, str(cause)
    if err["type"] == "extra_forbidden":
        owner = _model_at(root, path[:-1], tag)
        key = str(path[-1])
        if owner is root and extra_keys:
            return _dotted(path), unknown_key_message(key, [*owner.model_fields, *extra_keys])
        return _dotted(path), model_key_message(key, owner) if owner is not None else f"unknown key '{key}'"
    if err["type"] == "missing":
        msg = "required but missing"
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    if err["type"] not in {"missing", "value_error", "assertion_error"} and "input" in err:
        got = err["input"]
        if not isinstance(got, (dict, list)) or len(repr(got)) <= 60:
            msg += f" (got {got!r})"
    return _dotted(path), msg


def _dotted(path: list[Any]) -> str:
    return ".".join(str(p) for p in path)


def validate_params(model: type[BaseModel], params: dict[str, Any]) -> tuple[BaseModel | None, list[tuple[str, str]]]:
    """A component's ``params`` validated by its params ``model``: ``(validated, [])``, or
    ``(None, problems)`` with one ``(dotted path, message)`` per problem. Unknown keys are
    reported as typos whatever the model's ``extra`` setting (unless it is ``"allow"``)."""
    errors: list[tuple[str, str]] = []
    if model.model_config.get("extra") != "allow":
        allowed = accepted_keys(model)
        errors += [(str(k), model_key_message(str(k), model)) for k in params if k not in allowed]
    try:
        validated = model.model_validate(params)
    except ValidationError as exc:
        reported = {path for path, _ in errors}
        errors += [e for e in validation_errors(exc, model, params) if e[0] not in reported]
    except Exception as exc:  # noqa: BLE001 - a params validator that raises something else
        errors.append(("", f"its params model raised {type(exc).__name__}: {exc}"))
    return (None, errors) if errors else (validated, [])
