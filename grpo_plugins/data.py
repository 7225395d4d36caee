"""Prompts: loading the dataset of a run and turning prompts into token ids.

A run's data comes from ``config.dataset`` (a local JSON/JSONL/CSV/parquet file, a directory
written by ``Dataset.save_to_disk``, or a hub dataset already in the local cache) or else from
its ``task`` component. Either way the result is a ``datasets.Dataset`` with a ``prompt`` column
(a string, or a list of chat messages) plus any columns the rewards read.
"""

from __future__ import annotations

import glob
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

from grpo_plugins.config import DatasetSpec, GRPOConfig, component_ref
from grpo_plugins.prompt_encoding import DataError, PromptTooLongError, encode_prompts  # re-exported

if TYPE_CHECKING:
    import datasets
    from torch import Tensor

    from grpo_plugins.registry import Registry

#: File extensions read with the builder of the same name (``path: train.jsonl`` works too).
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


# -- loading --------------------------------------------------------------------------------------


def _data_file_list(data_files: str | list[str] | dict[str, Any]) -> list[str]:
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, Mapping):
        return [f for v in data_files.values() for f in _data_file_list(v)]
    return [str(f) for f in data_files]


def _check_data_files(data_files: str | list[str] | dict[str, Any]) -> None:
    for pattern in _data_file_list(data_files):
        if "://" in pattern:
            continue
        if glob.has_magic(pattern):
            if not glob.glob(str(Path(pattern).expanduser()), recursive=True):
                raise DataError(f"dataset.data_files: no file matches '{pattern}'")
        elif not Path(pattern).expanduser().is_file():
            raise DataError(f"dataset.data_files: file '{pattern}' does not exist")


def _pick_split(loaded: Any, split: str, where: str) -> datasets.Dataset:
    import datasets

    if isinstance(loaded, (datasets.DatasetDict, dict)):
        if split not in loaded:
            raise DataError(
                f"dataset '{where}' has no split '{split}' (splits: {', '.join(loaded)}); "
                "set dataset.split"
            )
        return loaded[split]
    return loaded


def load_dataset_spec(spec: DatasetSpec) -> datasets.Dataset:
    """Load the dataset ``spec`` names (see :class:`~grpo_plugins.config.DatasetSpec`); never
    downloads."""
    import datasets

    path = Path(spec.path).expanduser()
    builder = spec.path
    data_files = spec.data_files
    if data_files is not None:
        _check_data_files(data_files)
    elif path.is_file():
        if path.suffix.lower() not in FILE_BUILDERS:
            raise DataError(
                f"dataset.path '{spec.path}': unknown file type '{path.suffix}' "
                f"(use one of {', '.join(sorted(FILE_BUILDERS))}, or path: json/csv/parquet with data_files)"
            )
        builder, data_files = FILE_BUILDERS[path.suffix.lower()], str(path)
    elif path.is_dir() and (
        (path / "dataset_info.json").is_file()
        or (path / "state.json").is_file()
        or (path / "dataset_dict.json").is_file()
    ):
        try:
            return _pick_split(datasets.load_from_disk(str(path)), spec.split, spec.path)
        except Exception as exc:  # noqa: BLE001 - any failure to read is the same problem for the user
            raise DataError(
                f"dataset.path '{spec.path}': cannot read the saved dataset ({type(exc).__name__}: {exc})"
            ) from exc
    elif builder in set(FILE_BUILDERS.values()):
        raise DataError(f"dataset.path '{builder}' needs dataset.data_files (the file(s) to read)")
    elif not path.exists() and (spec.path.startswith((".", "/", "~")) or spec.path.count("/") > 1):
        raise DataError(f"dataset.path '{spec.path}' does not exist")

    local = data_files is not None or path.exists()
    # Offline for hub names: a dataset not in the local cache fails at once instead of
    # attempting a download.
    with mock.patch.object(datasets.config, "HF_HUB_OFFLINE", True):
        try:
            loaded = datasets.load_dataset(builder, spec.name, data_files=data_files, split=spec.split)
        except StopIteration as exc:  # what datasets raises for an empty JSON file
            raise DataError(f"dataset '{spec.path}' is empty: it has no rows to train on") from exc
        except (FileNotFoundError, ConnectionError, OSError, ValueError) as exc:
            if local:
                raise DataError(f"cannot read dataset '{spec.path}': {exc}") from exc
            raise DataError(
                f"dataset '{spec.path}' is not a local file or directory and not in the datasets "
                "cache; grpo-plugins cannot download it (no hub access): save it locally and set "
                "dataset.path to the file or directory"
            ) from exc
    return _pick_split(loaded, spec.split, spec.path)


def _check_prompts(dataset: datasets.Dataset, where: str) -> None:
    if len(dataset) == 0:
        raise DataError(f"{where} is empty: it has no prompts")
    for index in range(min(len(dataset), 8)):
        prompt = dataset[index]["prompt"]
        if isinstance(prompt, str):
            continue
        if isinstance(prompt, list) and all(
            isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt
        ):
            continue
        raise DataError(
            f"{where}: prompt {index} is a {type(prompt).__name__}; a prompt must be a string or a "
            "list of chat messages ({'role': ..., 'content': ...})"
        )


def load_prompts(config: GRPOConfig, registry: Registry) -> tuple[datasets.Dataset, Any | None]:
    """The prompts of a run and its task.

    Returns:
        The dataset, with the prompt column renamed to ``prompt``, and the built task component
        (or None without a task). ``config.dataset`` takes precedence over the task's data; the
        task still supplies the default rewards.
    """
    ref = component_ref(config.task)
    task = registry.build("task", ref.name, ref.params) if ref is not None else None
    if config.dataset is not None:
        spec = config.dataset
        dataset = load_dataset_spec(spec)
        column, where = spec.prompt_column, f"dataset '{spec.path}'"
    elif task is not None:
        assert ref is not None
        dataset = task.load(config.seed)
        column, where = "prompt", f"task '{ref.name}'"
    else:
        raise DataError("the config names neither a dataset nor a task; set one of them")

    hint = "dataset.prompt_column" if config.dataset is not None else None
    return _with_prompt_column(dataset, column, where, hint), task


def _with_prompt_column(dataset: datasets.Dataset, column: str, where: str, setting: str | None) -> datasets.Dataset:
    """``dataset`` with its prompt ``column`` renamed to ``prompt``, checked (``setting``: the
    config key that names the column, for the messages)."""
    if column not in dataset.column_names:
        hint = f" (set {setting})" if setting else ""
        raise DataError(
            f"{where} has no column '{column}'{hint}; its columns: {', '.join(dataset.column_names)}"
        )
    if column != "prompt":
        if "prompt" in dataset.column_names:
            raise DataError(f"{where} has both '{column}' ({setting}) and 'prompt'; rename or drop one")
        dataset = dataset.rename_column(column, "prompt")
    _check_prompts(dataset, where)
    return dataset


def load_eval_prompts(
    config: GRPOConfig,
    registry: Registry,
    tokenizer: Any,
    dataset: Any = None,
    task: Any = None,
    *,
    trains_on_task: bool = True,
) -> datasets.Dataset:
    """The prompts to evaluate on, with a ``prompt`` column, checked against max_prompt_length.

    ``dataset`` (a ``datasets.Dataset``, a list of row dicts or a mapping of columns) comes first,
    then ``config.eval_dataset``, then the held-out split of the task (``task`` built, or built
    from ``config.task``: its ``load_eval(config.seed)``) -- only when training uses the task's
    own data (no ``dataset:``, and ``trains_on_task``), since only then is it held out.

    Raises:
        DataError: there are no eval prompts, or they cannot be read.
    """
    import datasets

    if dataset is not None:
        if isinstance(dataset, list):
            dataset = datasets.Dataset.from_list(dataset)
        elif isinstance(dataset, Mapping):
            dataset = datasets.Dataset.from_dict(dict(dataset))
        dataset = _with_prompt_column(dataset, "prompt", "the eval dataset", None)
    elif config.eval_dataset is not None:
        spec = config.eval_dataset
        dataset = _with_prompt_column(
            load_dataset_spec(spec), spec.prompt_column, f"eval_dataset '{spec.path}'", "eval_dataset.prompt_column"
        )
    elif config.dataset is not None or not trains_on_task:
        raise DataError(
            "no prompts to evaluate on: training uses its own dataset, so the task's held-out split does "
            "not apply; set eval_dataset (e.g. {path: eval.jsonl})"
        )
    else:
        ref = component_ref(config.task)
        if task is None and ref is not None:
            task = registry.build("task", ref.name, ref.params)
        load_eval = getattr(task, "load_eval", None)
        dataset = load_eval(config.seed) if load_eval is not None else None
        if dataset is None:
            which = f"the task '{ref.name}' has no held-out split" if ref is not None else "the config names no task"
            raise DataError(f"no prompts to evaluate on: {which}; set eval_dataset (e.g. {{path: eval.jsonl}})")
        assert ref is not None
        dataset = _with_prompt_column(dataset, "prompt", f"the held-out split of task '{ref.name}'", None)
    check_prompt_lengths(
        tokenizer, dataset["prompt"], max_prompt_length=config.max_prompt_length, truncation=config.prompt_truncation
    )
    return dataset


#: Prompts checked up front by :func:`check_prompt_lengths`; larger datasets are checked as
#: their prompts are reached.
PROMPT_CHECK_LIMIT = 50_000


def prepare_dataset(
    config: GRPOConfig, registry: Registry, tokenizer: Any, dataset: Any = None,
    encode: Callable[[list[Any]], list[list[int]]] | None = None, check_lengths: bool = True,
) -> tuple[datasets.Dataset, Any | None, str]:
    """The prompts a run trains on, checked: (dataset, built task or None, prompt column).

    ``dataset`` (a ``datasets.Dataset``, a list of row dicts or a mapping of columns) replaces
    the config's data. The prompts must encode within ``max_prompt_length`` (with
    ``prompt_truncation: error``; not checked here without ``check_lengths``).
    """
    from grpo_plugins.errors import TrainingError

    task = None
    column = config.dataset.prompt_column if config.dataset is not None else "prompt"
    if dataset is not None:
        import datasets

        if isinstance(dataset, list):
            dataset = datasets.Dataset.from_list(dataset)
        elif isinstance(dataset, Mapping):
            dataset = datasets.Dataset.from_dict(dict(dataset))
    else:
        dataset, task = load_prompts(config, registry)
        if column not in dataset.column_names and "prompt" in dataset.column_names:
            column = "prompt"
    if column not in dataset.column_names:
        raise TrainingError(
            f"the dataset has no '{column}' column (columns: {', '.join(dataset.column_names)}); "
            "name the prompt column with dataset.prompt_column"
        )
    if len(dataset) == 0:
        raise TrainingError("the dataset is empty")
    if not check_lengths:
        return dataset, task, column
    check_prompt_lengths(
        tokenizer, dataset[column], max_prompt_length=config.max_prompt_length, truncation=config.prompt_truncation,
        chat_template_kwargs=config.chat_template_kwargs, encode=encode,
    )
    return dataset, task, column


def check_prompt_lengths(
    tokenizer: Any,
    prompts: Sequence[Any],
    *,
    max_prompt_length: int | None,
    truncation: str,
    limit: int = PROMPT_CHECK_LIMIT,
    chat_template_kwargs: dict[str, Any] | None = None,
    encode: Callable[[list[Any]], list[list[int]]] | None = None,
) -> None:
    """Raise :class:`~grpo_plugins.data.PromptTooLongError` listing every prompt (of the first
    ``limit``) over ``max_prompt_length`` tokens, when ``truncation`` is ``error``. ``encode``
    turns prompts into ids (default: :func:`encode_prompts`; a run passes its environment's)."""
    if max_prompt_length is None or truncation != "error":
        return
    n = min(len(prompts), limit)
    too_long: list[tuple[int, int]] = []  # (row, tokens)
    chunk = 256
    for start in range(0, n, chunk):
        batch = list(prompts[start : min(n, start + chunk)])  # one slice: fast on a datasets Column
        try:
            if encode is not None:
                encoded = encode(batch)
            else:
                encoded = encode_prompts(
                    tokenizer, batch, max_prompt_length=None, truncation="error", chat_template_kwargs=chat_template_kwargs
                )
        except DataError:
            _raise_with_row(tokenizer, batch, start)
            raise
        too_long += [(start + i, len(ids)) for i, ids in enumerate(encoded) if len(ids) > max_prompt_length]
    if too_long:
        shown = ", ".join(f"{i} ({t} tokens)" for i, t in too_long[:5])
        more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
        longest = max(t for _, t in too_long)
        raise PromptTooLongError(
            f"{len(too_long)} prompt(s) of the data are longer than max_prompt_length={max_prompt_length}: "
            f"rows {shown}{more}. Raise max_prompt_length to {longest}, set prompt_truncation: left "
            "(keeps the last tokens), or drop those rows"
        )


def _raise_with_row(tokenizer: Any, batch: list[Any], start: int) -> None:
    """Re-raise the DataError of the prompt in ``batch`` that cannot be encoded, with its row."""
    for i, prompt in enumerate(batch):
        try:
            encode_prompts(tokenizer, [prompt], max_prompt_length=None, truncation="error")
        except DataError as exc:
            raise type(exc)(str(exc).replace("prompt 0 ", f"prompt {start + i} ", 1)) from None


# -- encoding -------------------------------------------------------------------------------------


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int, device: Any = None) -> tuple[Tensor, Tensor]:
    """Left-pad token id lists into ``(ids (B, L), attention_mask (B, L))`` long tensors."""
    import torch

    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)  # (B, L)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)  # (B, L)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    if device is not None:
        ids, mask = ids.to(device), mask.to(device)
    return ids, mask
