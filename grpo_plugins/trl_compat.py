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
from collections.abc import Mapping
from typing import Any

from grpo_plugins.config_errors import FieldError
from grpo_plugins.trl_keys import TRL_KEYS, UNSET, Status, TrlKey
from grpo_plugins.trl_translations import FIELD_DEFAULTS, Translation

__all__ = ["TRL_KEYS", "Status", "Translation", "TrlKey", "log_notes", "translate_trl_keys", "trl_table_markdown"]

logger = logging.getLogger("grpo_plugins.config")


def translate_trl_keys(data: Mapping[str, Any], fields: set[str]) -> tuple[dict[str, Any], list[str]]:
    """Apply :data:`TRL_KEYS` to a config mapping: the mapping with TRL keys rewritten into this
    project's form, and the INFO lines to log (``"key -> what"``). ``fields`` are the config's own
    field names: a TRL key that is also one is kept (its value still rewritten where TRL spells it
    differently).

    Raises:
        FieldError: a TRL key with a value that cannot apply here (the message says what to use
            instead), or two keys that disagree.
    """
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
            if depth == 0 and part in FIELD_DEFAULTS:
                child = {"name": FIELD_DEFAULTS[part]}
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
        return "" if value is UNSET else f"`{json.dumps(value)}`"

    lines = [
        "# TRL GRPOConfig keys",
        "",
        "<!-- Generated from the table in grpo_plugins/trl_keys.py by",
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
