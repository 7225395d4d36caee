"""``grpo-plugins list`` and ``show``: the installed components, their documentation and params."""

from __future__ import annotations

import argparse
import inspect
import json
import types
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from grpo_plugins.cli.output import _console, _print_json

if TYPE_CHECKING:
    from pydantic import BaseModel

    from grpo_plugins.registry import Component, Registry


def type_label(annotation: Any) -> str:
    """A readable type for docs and tables: ``int | None``, ``"token" | "sequence"``, ``ModelSpec``."""
    from pydantic import BaseModel

    if annotation is type(None) or annotation is None:
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_label(a) for a in args)
    if origin in (list, Sequence):
        return f"list[{type_label(args[0])}]" if args else "list"
    if origin is dict:
        return "mapping"
    if origin is typing.Annotated:
        return type_label(args[0])
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field: Any) -> str:
    """``> 0``, ``>= 1, <= 1`` from a field's annotated-types metadata."""
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    parts = [
        f"{symbols[attr]} {getattr(m, attr)}"
        for m in field.metadata
        for attr in symbols
        if getattr(m, attr, None) is not None
    ]
    return ", ".join(parts)


def _default_label(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return "required"
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    return json.dumps(value) if not isinstance(value, str) else value


def params_rows(model: type[BaseModel] | None) -> list[tuple[str, str, str, str]]:
    """(name, type, default, description) for each field of a params model."""
    if model is None:
        return []
    return [
        (name, " ".join(filter(None, [type_label(f.annotation), _constraints(f)])), _default_label(f), f.description or "")
        for name, f in model.model_fields.items()
    ]


def _params_summary(component: Component) -> str:
    rows = params_rows(component.params_model)
    return ", ".join(f"{n}: {t} = {d}" for n, t, d, _ in rows) if rows else "-"


def _registry() -> Registry:
    from grpo_plugins.registry import get_registry

    return get_registry()


def cmd_list(args: argparse.Namespace) -> int:
    registry = _registry()
    components = registry.components(args.kind)
    duplicates = [d for d in registry.duplicates() if args.kind in (None, d[0].kind)]
    dup_keys = {(d[0].kind, d[0].name) for d in duplicates}
    if args.json:
        _print_json(
            {
                "components": [
                    {
                        "kind": c.kind,
                        "name": c.name,
                        "qualified_name": c.qualified_name,
                        "distribution": c.distribution,
                        "version": c.version,
                        "plugin": c.plugin,
                        "doc": c.doc,
                        "params_schema": c.params_schema(),
                        "duplicate": (c.kind, c.name) in dup_keys,
                    }
                    for c in components
                ],
                "broken": [
                    {"plugin": b.plugin, "distribution": b.distribution, "version": b.version, "error": b.error}
                    for b in registry.broken
                ],
                "duplicates": [
                    {"kind": d[0].kind, "name": d[0].name, "distributions": [c.distribution for c in d]}
                    for d in duplicates
                ],
            }
        )
        return 0
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    if not components:
        console.print("No components registered.")
    for kind in dict.fromkeys(c.kind for c in components):
        table = Table(title=f"{kind}", title_justify="left", title_style="bold")
        for column in ("name", "distribution", "version", "description", "params"):
            table.add_column(column, no_wrap=column in ("name", "distribution", "version"), ratio=None)
        for c in (c for c in components if c.kind == kind):
            name = escape(c.name) + (" [red](duplicate)[/red]" if (c.kind, c.name) in dup_keys else "")
            table.add_row(name, escape(c.distribution), c.version or "-", escape(c.doc), escape(_params_summary(c)))
        console.print(table)
    for d in duplicates:
        which = " and ".join(f"{c.distribution} {c.version or ''}".strip() for c in d)
        choose = " or ".join(f"'{c.qualified_name}'" for c in d)
        console.print(
            f"[red]duplicate {d[0].kind} '{d[0].name}': registered by {which}; name it as {choose}[/red]"
        )
    if registry.broken:
        broken = Table(title="broken plugins (not loaded)", title_justify="left", title_style="red")
        for column in ("plugin", "distribution", "version", "error"):
            broken.add_column(column, no_wrap=column != "error")
        for b in registry.broken:
            broken.add_row(b.plugin, b.distribution, b.version or "-", b.error)
        console.print(broken)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    import difflib

    from grpo_plugins.registry import UnknownComponentError

    registry = _registry()
    found = registry.find(args.name, args.kind)
    if not found:
        names = sorted({c.name for c in registry.components(args.kind)})
        close = difflib.get_close_matches(args.name.rpartition(":")[2], names, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        kind = args.kind or "component"
        raise UnknownComponentError(f"no {kind} named '{args.name}'{hint} (see grpo-plugins list)")
    if args.json:
        _print_json(
            [
                {
                    "kind": c.kind,
                    "name": c.name,
                    "distribution": c.distribution,
                    "version": c.version,
                    "doc": inspect.getdoc(c.obj) or c.doc,
                    "params_schema": c.params_schema(),
                }
                for c in found
            ]
        )
        return 0
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    for c in found:
        console.print(f"[bold]{c.kind} [cyan]{escape(c.name)}[/cyan][/bold]  from {escape(c.distribution)} {c.version or ''}")
        console.print(escape(inspect.getdoc(c.obj) or c.doc or "(no documentation)"))
        rows = params_rows(c.params_model)
        if rows:
            table = Table(title="params", title_justify="left")
            for column in ("name", "type", "default", "description"):
                table.add_column(column)
            for row in rows:
                table.add_row(*map(escape, row))
            console.print(table)
        else:
            console.print("params: none")
        console.print()
    return 0
