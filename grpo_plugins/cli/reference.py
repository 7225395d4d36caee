"""``grpo-plugins config-reference`` and ``trl-reference``: docs/config.md and docs/trl.md,
generated from the code."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_plugins.cli.components import _constraints, _default_label, type_label
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.files import as_ordinary

if TYPE_CHECKING:
    from pydantic import BaseModel


def render_config_reference() -> str:
    """docs/config.md: every config key with its type, default and description, from the models."""
    from grpo_plugins.config import (
        CONFIG_SECTIONS,
        SEED_ALIASES,
        ComponentRef,
        DatasetSpec,
        FSDPSettings,
        GRPOConfig,
        LoraSettings,
        ModelSpec,
        RewardSpec,
    )

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    def table(model: type[BaseModel], names: list[str]) -> list[str]:
        out = ["| key | type | default | description |", "|---|---|---|---|"]
        for name in names:
            f = model.model_fields[name]
            kind = " ".join(filter(None, [type_label(f.annotation), _constraints(f)]))
            out.append(
                f"| `{name}` | {cell(kind)} | `{cell(_default_label(f))}` | {cell(f.description or '')} |"
            )
        return out

    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the pydantic models in grpo_plugins/config_model.py and config_specs.py by",
        "     `grpo-plugins config-reference --output docs/config.md`; do not edit by hand. -->",
        "",
        "A run is configured by one YAML file of flat keys (as in TRL's `GRPOConfig`), overridable on",
        "the command line with `--set key=value` (the value is parsed as YAML; nested keys are dotted:",
        "`--set model.dtype=bfloat16`, `--set rewards.0.weight=0.5`). Unknown keys are errors with a",
        "suggestion. `grpo-plugins validate CONFIG` checks a file completely without loading a model.",
        "",
        f"Aliases: {', '.join(f'`{a}`' for a in SEED_ALIASES)} (for `per_device_train_batch_size` and",
        "`gradient_accumulation_steps`). `scale_rewards: true` means `group`, `false` means `none`.",
        "Every key of TRL 1.16's `GRPOConfig` is accepted too: [trl.md](trl.md) says what each one does here.",
        "A component key (`loss_type`, `importance_sampling_level`, `scale_rewards`,",
        "`rollout_correction`, `generator`, `task`) takes a registered name, `distribution:name`, or a",
        "mapping `{name: ..., params: {...}}` whose params the component's own model validates",
        "(`grpo-plugins show NAME` lists them).",
        "",
    ]
    fields = list(GRPOConfig.model_fields)
    starts = [fields.index(first) for first in CONFIG_SECTIONS] + [len(fields)]
    if starts[0] != 0:
        raise RuntimeError("CONFIG_SECTIONS must start with the first field of GRPOConfig")
    for (heading, start), end in zip(zip(CONFIG_SECTIONS.values(), starts), starts[1:]):
        lines += [f"## {heading}", "", *table(GRPOConfig, fields[start:end]), ""]
    for model in (ModelSpec, LoraSettings, FSDPSettings, DatasetSpec, ComponentRef, RewardSpec):
        doc = " ".join((inspect.getdoc(model) or "").split())
        lines += [f"## {model.__name__}", "", doc, "", *table(model, list(model.model_fields)), ""]
    return "\n".join(lines)


def cmd_config_reference(args: argparse.Namespace) -> int:
    return _write_reference(render_config_reference(), args, "config-reference")


def cmd_trl_reference(args: argparse.Namespace) -> int:
    from grpo_plugins.trl_compat import trl_table_markdown

    return _write_reference(trl_table_markdown(), args, "trl-reference")


def _write_reference(text: str, args: argparse.Namespace, command: str) -> int:
    if args.check:
        current = Path(args.output).read_text(encoding="utf-8") if Path(args.output).exists() else ""
        if current != text:
            raise GRPOPluginsError(f"{args.output} is out of date; run grpo-plugins {command} --output {args.output}")
        return 0
    if args.output in (None, "-"):
        sys.stdout.write(text)
        return 0
    target = Path(args.output)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=target.parent or ".", delete=False, suffix=".tmp") as fh:
        fh.write(text)
    as_ordinary(fh.name)
    os.replace(fh.name, target)
    return 0
