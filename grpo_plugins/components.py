"""A component: what a plugin registers (or an import path names), where it comes from, and how
it is built with its params.

:func:`make_component` checks what ``register`` is given (a name without ``:``, a class or a
callable, ``Params`` a pydantic model); :meth:`Component.build` validates the params against the
component's own ``Params`` model and builds ``cls(params)``, ``cls()`` or returns a function as
it is; :func:`import_component` makes one from ``package.module:Attr`` or ``package.module.Attr``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from grpo_plugins.config_errors import validate_params
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.plugins import Origin

IMPORT_DISTRIBUTION = "<import>"  # the distribution of a component named by an import path


class UnknownComponentError(GRPOPluginsError, LookupError):
    """No component of that kind has that name."""


class ComponentImportError(UnknownComponentError):
    """An import path that does not import, or does not name a component."""


class ComponentBuildError(GRPOPluginsError):
    """A component's constructor raised (a bug or an unmet requirement in its plugin)."""


class ComponentParamsError(GRPOPluginsError, ValueError):
    """A component's parameters do not validate against its params model."""

    def __init__(self, message: str, errors: list[tuple[str, str]]):
        super().__init__(message)
        self.errors = errors  # (dotted path inside params, message)


@dataclass(frozen=True)
class Component:
    """One registered component: what it is, where it comes from, how to build it."""

    kind: str
    name: str
    obj: Any
    distribution: str
    version: str | None
    plugin: str  # the entry point or plugin that registered it, or the import path
    doc: str

    @property
    def qualified_name(self) -> str:
        return f"{self.distribution}:{self.name}"

    @property
    def origin(self) -> str:
        """``reward 'x' from acme-rewards 1.2`` (``reward 'pkg.mod:x'`` for an import path): what it
        is and where it comes from."""
        if self.distribution == IMPORT_DISTRIBUTION:
            return f"{self.kind} '{self.plugin}'"
        return f"{self.kind} '{self.name}' from {self.distribution}" + (f" {self.version}" if self.version else "")

    @property
    def params_model(self) -> type[BaseModel] | None:
        return getattr(self.obj, "Params", None) if inspect.isclass(self.obj) else None

    def params_schema(self) -> dict[str, Any] | None:
        return self.params_model.model_json_schema() if self.params_model is not None else None

    def validate_params(self, params: dict[str, Any] | BaseModel | None) -> BaseModel | None:
        """Validate ``params`` against the component's params model (None if it has none)."""
        model, params = self.params_model, params or {}
        if model is not None and isinstance(params, model):
            return params
        if isinstance(params, BaseModel):
            params = params.model_dump()
        if model is None:
            if params:
                keys = list(map(str, params))
                errors = [(keys[0], "this component takes no params")]
                raise ComponentParamsError(f"{self.origin} takes no params (got {', '.join(keys)})", errors)
            return None
        validated, errors = validate_params(model, params)
        if errors:
            detail = "; ".join(f"{p}: {m}" if p else m for p, m in errors)
            raise ComponentParamsError(f"{self.origin} params: {detail}", errors)
        return validated

    def build(self, params: dict[str, Any] | BaseModel | None = None) -> Any:
        """The ready-to-use component: ``cls(params)``, ``cls()``, or the object itself."""
        validated = self.validate_params(params)
        if not inspect.isclass(self.obj):
            return self.obj
        try:
            return self.obj(validated) if validated is not None else self.obj()
        except GRPOPluginsError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the plugin's constructor raises
            raise ComponentBuildError(f"building {self.origin} failed: {type(exc).__name__}: {exc}") from exc


def make_component(kind: str, origin: Origin, obj: Any, name: str | None = None, doc: str | None = None) -> Component:
    """A :class:`Component`, checked: a name without ``:``, a class or a callable, ``Params`` (if
    any) a pydantic model; ``doc`` defaults to the docstring's first paragraph."""
    name = name or getattr(obj, "name", None) or getattr(obj, "__name__", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"cannot register {obj!r} as a {kind}: give it a name")
    if ":" in name:
        raise ValueError(f"{kind} name '{name}' must not contain ':'")
    params = getattr(obj, "Params", None) if inspect.isclass(obj) else None
    if params is not None and not (inspect.isclass(params) and issubclass(params, BaseModel)):
        raise TypeError(f"{kind} '{name}': Params must be a pydantic BaseModel subclass")
    if not callable(obj):
        raise TypeError(f"{kind} '{name}' must be a class or a callable, got {type(obj).__name__}")
    doc = doc if doc is not None else (inspect.getdoc(obj) or "").strip().split("\n\n")[0].replace("\n", " ")
    return Component(kind, name, obj, origin.distribution, origin.version, origin.plugin, doc)


def _import_module(name: str) -> Any:
    """``importlib.import_module``, also finding a module in the current folder (after everything
    installed): ``python -m`` puts it on the path, the ``grpo-plugins`` command does not, and a
    file next to the config is the common case."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top, here = name.partition(".")[0], os.getcwd()
        if exc.name != top or here in sys.path or "" in sys.path or not (
            Path(here, top).is_dir() or Path(here, f"{top}.py").is_file()
        ):
            raise
        sys.path.append(here)
        return importlib.import_module(name)


def import_component(kind: str, path: str) -> Component:
    """The component an import path names: ``package.module:Attr`` (``Attr`` may be dotted:
    ``Class.method``) or ``package.module.Attr``."""
    module_name, colon, attr = path.partition(":")
    if not colon:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ComponentImportError(f"{kind} import path '{path}' must look like 'package.module:name'")
    try:
        obj = _import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - whatever importing the user's module raises
        raise ComponentImportError(
            f"{kind} '{path}': cannot import module '{module_name}' ({type(exc).__name__}: {exc}); it is "
            f"neither a registered {kind} (see grpo-plugins list) nor an importable 'module:attr' path"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ComponentImportError(f"{kind} '{path}': module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    try:
        name = getattr(obj, "__name__", None) or attr.rpartition(".")[2]
        return make_component(kind, Origin(path, IMPORT_DISTRIBUTION), obj, name)
    except (TypeError, ValueError) as exc:
        raise ComponentImportError(f"{kind} '{path}': {exc}") from None
