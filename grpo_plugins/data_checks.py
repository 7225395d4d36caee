"""What a config's data says before anything is loaded: a dataset's columns read cheaply from
its files, blank or missing files, the arguments a reward needs from those columns, and whether
there are prompts to evaluate on. Used by :mod:`grpo_plugins.validation`."""

from __future__ import annotations

import csv
import inspect
import json
from pathlib import Path
from typing import Any

from grpo_plugins.config import DatasetSpec, GRPOConfig, component_ref
from grpo_plugins.data import FILE_BUILDERS
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.registry import Registry, registry_for


def describe_dataset(spec: DatasetSpec) -> str:
    """``dataset 'json' (train.jsonl)``."""
    files = spec.data_files
    shown = files if isinstance(files, str) else ", ".join(files) if isinstance(files, list) else None
    return f"dataset '{spec.path}'" + (f" ({shown})" if shown else "")


def eval_prompts_problem(config: GRPOConfig, registry: Registry | None = None) -> tuple[str, str] | None:
    """Why ``config`` has no prompts to evaluate on, as ``(field, message)``, or None: it has an
    ``eval_dataset``, or trains on a task whose held-out split (``load_eval``) exists."""
    from grpo_plugins.kinds import Task

    if config.eval_dataset is not None:
        return None
    hint = "set eval_dataset (e.g. {path: eval.jsonl})"
    if config.dataset is not None:
        return ("eval_dataset", f"training uses dataset:, so no task's held-out split applies; {hint}")
    ref = component_ref(config.task)
    if ref is None:
        return ("eval_dataset", f"the config has no task with a held-out split; {hint}")
    registry = registry if registry is not None else registry_for(config.disable_plugins)
    try:
        obj = registry.get("task", ref.name).obj
    except GRPOPluginsError:
        return None  # reported where the task is resolved
    method = getattr(obj, "load_eval", None)
    if method is None or method is Task.load_eval:
        return ("eval_dataset", f"task '{ref.name}' has no held-out split (load_eval); {hint}")
    return None


#: Arguments the engine always passes to a reward; any other required argument is a column.
PROVIDED_ARGUMENTS = frozenset({"prompts", "completions", "completion_ids", "trainer_state"})


def required_arguments(reward: Any) -> list[str]:
    """The arguments a reward callable (a function, or a class whose instances are called)
    cannot do without: named parameters without a default, in signature order."""
    fn = reward.__call__ if inspect.isclass(reward) else reward
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some C callables: nothing to learn
        return []
    if inspect.isclass(reward) and params:
        params = params[1:]  # self
    return [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
    ]


def dataset_columns(spec: DatasetSpec) -> list[str] | None:
    """The columns of a local dataset, read cheaply (the first JSON line, the CSV header, the
    Parquet schema, a saved dataset's metadata); None when they cannot be known without
    loading it (hub datasets, globs, other formats)."""
    files = spec.data_files
    if isinstance(files, dict):
        files = files.get(spec.split)
    first = files if isinstance(files, str) else files[0] if isinstance(files, list) and files else None
    builder = spec.path
    try:
        if first is None:
            path = Path(spec.path).expanduser()
            if not path.is_file():
                return _saved_dataset_columns(path, spec.split)
            # dataset.path names the file itself (train.jsonl): read as its suffix says.
            first, builder = str(path), FILE_BUILDERS.get(path.suffix.lower(), "")
        path = Path(first).expanduser()
        if any(c in first for c in "*?[") or not path.is_file():
            return None
        if builder == "json":
            return _json_columns(path)
        if builder == "csv":
            with path.open(newline="", encoding="utf-8") as fh:
                return next(csv.reader(fh), None)
        if builder == "parquet":
            import pyarrow.parquet

            return list(pyarrow.parquet.read_schema(path).names)
    except (OSError, ValueError, ImportError):
        return None
    return None


def _json_columns(path: Path) -> list[str] | None:
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    break  # not JSON lines: a JSON document over several lines
                if isinstance(row, dict):
                    return list(row)
                break
    if path.stat().st_size > 16 * 2**20:  # a big JSON document: too slow to parse for a check
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, list) and data and isinstance(data[0], dict):
        return list(data[0])
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        return list(data)
    return None


def _saved_dataset_columns(path: Path, split: str) -> list[str] | None:
    if (path / "dataset_dict.json").is_file():
        path = path / split
    info = path / "dataset_info.json"
    if not info.is_file():
        return None
    features = json.loads(info.read_text(encoding="utf-8")).get("features")
    return list(features) if isinstance(features, dict) else None


def is_blank_file(name: str) -> bool:
    """A data file with nothing but white space (the loaders fail on it with no clear message)."""
    try:
        with open(name, "rb") as fh:
            return not fh.read(1 << 16).strip() and not fh.read(1)
    except OSError:
        return False


def is_local_path(name: str) -> bool:
    """Looks like a file system path rather than a hub id or URL."""
    return "://" not in name and (
        name.startswith(("/", "./", "../", "~")) or name.endswith((".gguf", ".json", ".jsonl", ".csv", ".parquet"))
    )
