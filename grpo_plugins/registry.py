"""Finding components by name.

A config names a component of any kind by its registered ``name``; by ``distribution:name``, to
choose between two distributions that register one name; or by an import path,
``package.module:Attr`` or ``package.module.Attr``, for a class or function no plugin registers.
Installed plugins are the entry points of group ``grpo_plugins`` (the built-ins too), each
imported and checked on its own: a broken plugin is recorded with its distribution and version
(``grpo-plugins list`` shows it) and only a run that names one of its components fails.
``GRPO_PLUGINS_STRICT=1`` makes any load error fatal; ``GRPO_PLUGINS_DISABLE=dist1,dist2`` skips
distributions (or entry points).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from grpo_plugins.config_errors import validate_params
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.kinds import KINDS
from grpo_plugins.plugins import BrokenPlugin, Origin, PluginLoadError, Plugins, normalize_distribution

LOCAL_DISTRIBUTION = "<local>"  # registered in-process (decorators, Registry.register)
IMPORT_DISTRIBUTION = "<import>"  # named by an import path


class UnknownComponentError(GRPOPluginsError, LookupError):
    """No component of that kind has that name."""


class ComponentImportError(UnknownComponentError):
    """An import path that does not import, or does not name a component."""


class DuplicateComponentError(GRPOPluginsError, LookupError):
    """Two distributions (or two modules of one) register the same name for the same kind."""


class ComponentSpecError(GRPOPluginsError, ValueError):
    """A component given in a form that names no component (a malformed mapping, None)."""


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
                keys = ", ".join(map(str, params))
                raise ComponentParamsError(f"{self.origin} takes no params (got {keys})", [(str(next(iter(params))), "this component takes no params")])
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


class Registry:
    """All components, by kind and name.

    Args:
        disabled: distribution names (or entry-point names) whose plugins are skipped; the
            ``GRPO_PLUGINS_DISABLE`` environment variable adds to it.
        strict: raise :class:`PluginLoadError` on the first broken plugin; default from
            ``GRPO_PLUGINS_STRICT``.
        entry_points: discover installed plugins (False gives an empty registry, for tests).
    """

    def __init__(self, *, disabled: Iterable[str] = (), strict: bool | None = None, entry_points: bool = True) -> None:
        from_env = os.environ.get("GRPO_PLUGINS_DISABLE", "").split(",")
        self.disabled = frozenset(normalize_distribution(d.strip()) for d in (*disabled, *from_env) if d.strip())
        env_strict = os.environ.get("GRPO_PLUGINS_STRICT", "").strip().lower() in {"1", "true", "yes", "on"}
        self.strict = env_strict if strict is None else strict
        self._discover = entry_points
        self._clear()

    def _clear(self) -> None:
        self._plugins = Plugins(self.strict)
        self._components: dict[str, dict[str, list[Component]]] = {kind: {} for kind in KINDS}
        self._loaded = False

    def _load(self) -> None:
        """Load the installed plugins, once, on first use."""
        if self._loaded:
            return
        self._loaded = True
        try:
            for component in self._plugins.load_entry_points(self.disabled, make_component) if self._discover else ():
                self._add(component)
        except PluginLoadError:  # strict mode: keep nothing, and fail again on the next use
            self._clear()
            raise

    def add_plugin(
        self, plugin: object, *, name: str | None = None, distribution: str = LOCAL_DISTRIBUTION, version: str | None = None
    ) -> None:
        """Register a plugin (a module, or any object with ``@hookimpl`` functions) and run its
        registration hooks now. Errors mark it broken instead of raising (unless strict)."""
        self.add_plugins({name or getattr(plugin, "__name__", None) or repr(plugin): plugin}, distribution, version)

    def add_plugins(
        self, plugins: Mapping[str, object], distribution: str = LOCAL_DISTRIBUTION, version: str | None = None
    ) -> None:
        """Register several plugins (name -> plugin) and run their hooks together, in one pluggy
        call per hook as for the installed plugins (so ``tryfirst``, ``trylast`` and wrappers
        order them)."""
        self._load()  # the installed plugins' components come first
        pairs = [(plugin, Origin(label, distribution, version)) for label, plugin in plugins.items()]
        for component in self._plugins.add(pairs, make_component):
            self._add(component)

    # -- registering in-process --------------------------------------------------------------

    def _add(self, component: Component) -> None:
        entries = self._components[component.kind].setdefault(component.name, [])
        # Re-registering from the same plugin module (a re-run notebook cell) replaces; another
        # module, even of the same distribution, is a duplicate (reported when the name is used).
        entries[:] = [c for c in entries if (c.distribution, c.plugin) != (component.distribution, component.plugin)]
        entries.append(component)

    def register(
        self, kind: str, name: str | None, obj: Any, *, doc: str | None = None, distribution: str = LOCAL_DISTRIBUTION
    ) -> Component:
        """Register ``obj`` as a ``kind`` component in-process (scripts, notebooks, tests)."""
        self._check_kind(kind)
        self._load()
        component = make_component(kind, Origin("<in-process>", distribution), obj, name, doc)
        self._add(component)
        return component

    def unregister(self, kind: str, name: str, distribution: str | None = None) -> None:
        """Remove a component (all distributions' entries for the name unless one is given)."""
        self._check_kind(kind)
        self._load()
        kept = [c for c in self._components[kind].pop(name, []) if distribution is not None and c.distribution != distribution]
        if kept:
            self._components[kind][name] = kept

    def snapshot(self) -> tuple[Any, ...]:
        """Everything registered (components, broken plugins, pluggy's plugins), for :meth:`restore`."""
        self._load()
        components = {kind: {n: list(e) for n, e in by_name.items()} for kind, by_name in self._components.items()}
        return components, list(self._plugins.broken), {id(p) for p in self._plugins.pm.get_plugins()}

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        """Put the registry back as :meth:`snapshot` found it."""
        components, broken, plugins = snapshot
        self._components = {kind: {n: list(e) for n, e in by_name.items()} for kind, by_name in components.items()}
        self._plugins.broken[:] = broken
        for plugin in self._plugins.pm.get_plugins():
            if id(plugin) not in plugins:
                self._plugins.pm.unregister(plugin)

    @contextmanager
    def temporary(self, kind: str, name: str | None, obj: Any) -> Iterator[Component]:
        """Register a component for the duration of a ``with`` block, then restore the registry."""
        before = self.snapshot()
        try:
            yield self.register(kind, name, obj)
        finally:
            self.restore(before)

    def is_registered(self, plugin: object) -> bool:
        """Whether ``plugin`` (a module or object with hooks) is registered."""
        self._load()
        return self._plugins.pm.is_registered(plugin)

    # -- lookup ------------------------------------------------------------------------------

    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in KINDS:
            raise UnknownComponentError(f"unknown component kind '{kind}'; kinds: {', '.join(KINDS)}")

    def names(self, kind: str) -> list[str]:
        """The names registered for ``kind``, sorted."""
        self._check_kind(kind)
        self._load()
        return sorted(self._components[kind])

    def components(self, kind: str | None = None) -> list[Component]:
        """All registered components (of one kind), duplicates included."""
        return [c for k in ([kind] if kind else KINDS) for name in self.names(k) for c in self._components[k][name]]

    @property
    def broken(self) -> list[BrokenPlugin]:
        self._load()
        return list(self._plugins.broken)

    def duplicates(self) -> list[list[Component]]:
        """Groups of components that share a kind and a name."""
        self._load()
        return [entries for kind in KINDS for entries in self._components[kind].values() if len(entries) > 1]

    def _is_import_path(self, kind: str, name: str) -> bool:
        """``a:b`` where ``a`` is no distribution this registry knows of, or an unregistered ``a.b``."""
        dist, colon, _ = name.rpartition(":")
        if not colon:
            return "." in name and name not in self._components[kind]
        known = [*self.components(), *self._plugins.broken, *self._plugins.disabled]
        return normalize_distribution(dist) not in {normalize_distribution(o.distribution) for o in known} | self.disabled

    def get(self, kind: str, name: str) -> Component:
        """The component of ``kind`` named ``name``, ``distribution:name``, or by an import path
        (``package.module:Attr`` or ``package.module.Attr``; a known distribution wins).

        Raises:
            UnknownComponentError: with close matches, the installed names and broken or disabled
                plugins (:class:`ComponentImportError` for an import path that does not import).
            DuplicateComponentError: naming both distributions and how to choose one.
        """
        self._check_kind(kind)
        self._load()
        if self._is_import_path(kind, name):
            return import_component(kind, name)
        dist, _, bare = name.rpartition(":")
        entries = [
            c for c in self._components[kind].get(bare, [])
            if not dist or normalize_distribution(c.distribution) == normalize_distribution(dist)
        ]
        if not entries:
            raise UnknownComponentError(self._unknown_message(kind, name))
        if len(entries) > 1 and len({normalize_distribution(c.distribution) for c in entries}) == 1:
            modules = " and ".join(f"'{c.plugin}'" for c in entries)
            raise DuplicateComponentError(
                f"{kind} '{bare}' is registered by {len(entries)} plugins of {entries[0].distribution} "
                f"({modules}); a name must be registered once per distribution: remove one registration"
            )
        if len(entries) > 1:
            which = ", ".join(f"{c.distribution} {c.version or ''}".strip() for c in entries)
            choices = " or ".join(f"'{c.qualified_name}'" for c in entries)
            raise DuplicateComponentError(
                f"{kind} '{bare}' is registered by more than one distribution ({which}); "
                f"name one of them as {choices}, or disable one with GRPO_PLUGINS_DISABLE"
            )
        return entries[0]

    def find(self, name: str, kind: str | None = None) -> list[Component]:
        """Every component called ``name`` (or ``distribution:name``), of any kind or of ``kind``."""
        dist, _, bare = name.rpartition(":")
        return [
            c for c in self.components(kind)
            if c.name == bare and (not dist or normalize_distribution(c.distribution) == normalize_distribution(dist))
        ]

    def build(self, kind: str, name: str, params: dict[str, Any] | BaseModel | None = None) -> Any:
        """Look up and build a component with its params in one step."""
        return self.get(kind, name).build(params)

    def _unknown_message(self, kind: str, name: str) -> str:
        dist, _, bare = name.rpartition(":")
        disabled = "GRPO_PLUGINS_DISABLE or the config's disable_plugins"
        if dist and normalize_distribution(dist) in self.disabled:
            return f"{kind} '{name}': distribution '{dist}' is disabled ({disabled}); enable it to use its {kind} '{bare}'"
        renamed = [c for c in self.components(kind) if bare in getattr(c.obj, "former_names", ())]
        if renamed:
            return f"{kind} '{name}' has been renamed to '{renamed[0].name}' ({renamed[0].origin}); use the new name"
        names = self.names(kind)
        close = difflib.get_close_matches(bare, names, n=3, cutoff=0.6)
        msg = f"unknown {kind} '{name}'" + (f"; did you mean {' or '.join(map(repr, close))}?" if close else ".")
        msg += f" Installed {kind} names: {', '.join(names) if names else '(none)'}."
        if dist:
            msg += f" ('{dist}' is an installed distribution; to import from a module of that name, write '{dist}.{bare}'.)"
        for b in self._plugins.broken:
            msg += f" Note: plugin '{b.plugin}' from {b.distribution} {b.version or ''} failed to load ({b.error}); it may provide '{name}'."
        for dist in dict.fromkeys(f"{o.distribution} {o.version or ''}".strip() for o in self._plugins.disabled):
            msg += f" Note: {dist} is disabled ({disabled}); it may provide '{name}'."
        return msg


# -- the process-wide registry -----------------------------------------------------------------

_REGISTRY: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry (created, and entry points loaded, on first use)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry()
    return _REGISTRY


def set_registry(registry: Registry | None) -> Registry | None:
    """Replace the process-wide registry (None: rebuild on next use); returns the previous one."""
    global _REGISTRY
    previous, _REGISTRY = _REGISTRY, registry
    return previous


def registry_for(disabled: Iterable[str] = ()) -> Registry:
    """The registry of a run: the process-wide one, or a fresh one without the ``disabled``
    distributions (a run's ``disable_plugins``)."""
    return Registry(disabled=disabled) if disabled else get_registry()


def resolve_component(kind: str, spec: Any, registry: Registry | None = None) -> Any:
    """A ready-to-use component from a name, a ``{name, params}`` mapping or ComponentRef, a
    component class (built with default params) or an already-built object (returned as is)."""
    registry = registry if registry is not None else get_registry()
    if isinstance(spec, str):
        return registry.build(kind, spec)
    if isinstance(spec, Mapping):
        if "name" not in spec or set(spec) - {"name", "params"}:
            raise ComponentSpecError(
                f"a {kind} given as a mapping needs exactly the keys 'name' and optionally 'params' (got {sorted(spec)})"
            )
        return registry.build(kind, spec["name"], spec.get("params"))
    if isinstance(spec, BaseModel) and hasattr(spec, "name") and hasattr(spec, "params"):
        return registry.build(kind, spec.name, spec.params)
    if inspect.isclass(spec):
        params = getattr(spec, "Params", None)
        return spec(params()) if params is not None else spec()
    if spec is None:
        raise ComponentSpecError(f"no {kind} given; name one (see `grpo-plugins list`)")
    return spec


def register(kind: str, name: str | None, obj: Any, *, doc: str | None = None) -> Component:
    """Register ``obj`` as a ``kind`` component of the process-wide registry."""
    return get_registry().register(kind, name, obj, doc=doc)


# -- one registering decorator per kind: @grpo_plugins.reward("name"), or bare @grpo_plugins.reward

Decorator = Callable[..., Any]


def _decorator(kind: str) -> Decorator:
    def decorator(name: Any = None, *, doc: str | None = None) -> Any:
        if callable(name):  # used bare
            register(kind, None, name)
            return name

        def wrap(obj: Any) -> Any:
            register(kind, name, obj, doc=doc)
            return obj

        return wrap

    decorator.__name__ = decorator.__qualname__ = kind
    decorator.__doc__ = f'Register the decorated object as a ``{kind}``: ``@grpo_plugins.{kind}("name")`` or bare.'
    return decorator


reward = _decorator("reward")
loss_type = _decorator("loss_type")
importance_sampling = _decorator("importance_sampling")
reward_scaling = _decorator("reward_scaling")
rollout_correction = _decorator("rollout_correction")
generator = _decorator("generator")
group_filter = _decorator("group_filter")
environment = _decorator("environment")
tool = _decorator("tool")
task = _decorator("task")
