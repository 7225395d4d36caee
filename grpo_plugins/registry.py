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
import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel

from grpo_plugins.components import (
    IMPORT_DISTRIBUTION,
    Component,
    ComponentBuildError,
    ComponentImportError,
    ComponentParamsError,
    UnknownComponentError,
    import_component,
    make_component,
)
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.kinds import KINDS
from grpo_plugins.plugins import BrokenPlugin, Origin, PluginLoadError, Plugins, normalize_distribution

__all__ = [  # with what the registry's users import from here (defined in components and plugins)
    "IMPORT_DISTRIBUTION", "LOCAL_DISTRIBUTION", "BrokenPlugin", "Component", "ComponentBuildError",
    "ComponentImportError", "ComponentParamsError", "ComponentSpecError", "DuplicateComponentError",
    "PluginLoadError", "Registry", "UnknownComponentError", "get_registry", "normalize_distribution",
    "register", "registry_for", "resolve_component", "set_registry",
]

LOCAL_DISTRIBUTION = "<local>"  # registered in-process (decorators, Registry.register)


class DuplicateComponentError(GRPOPluginsError, LookupError):
    """Two distributions (or two modules of one) register the same name for the same kind."""


class ComponentSpecError(GRPOPluginsError, ValueError):
    """A component given in a form that names no component (a malformed mapping, None)."""


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
        if not self._discover:
            return
        try:
            for component in self._plugins.load_entry_points(self.disabled, make_component):
                self._add(component)
        except PluginLoadError:  # strict mode: keep nothing, and fail again on the next use
            self._clear()
            raise

    def add_plugin(
        self,
        plugin: object,
        *,
        name: str | None = None,
        distribution: str = LOCAL_DISTRIBUTION,
        version: str | None = None,
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
        entries = self._components[kind].pop(name, [])
        kept = [c for c in entries if distribution is not None and c.distribution != distribution]
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
        known = [*self.components(), *self._plugins.broken, *self._plugins.skipped]
        distributions = {normalize_distribution(o.distribution) for o in known} | self.disabled
        return normalize_distribution(dist) not in distributions

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
        bare = name.rpartition(":")[2]
        entries = self.find(name, kind)
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
            return f"{kind} '{name}': distribution '{dist}' is disabled ({disabled}); enable it to use '{bare}'"
        renamed = [c for c in self.components(kind) if bare in getattr(c.obj, "former_names", ())]
        if renamed:
            return f"{kind} '{name}' has been renamed to '{renamed[0].name}' ({renamed[0].origin}); use the new name"
        names = self.names(kind)
        close = difflib.get_close_matches(bare, names, n=3, cutoff=0.6)
        msg = f"unknown {kind} '{name}'" + (f"; did you mean {' or '.join(map(repr, close))}?" if close else ".")
        msg += f" Installed {kind} names: {', '.join(names) if names else '(none)'}."
        if dist:
            msg += f" ('{dist}' is a distribution; to import from a module of that name, write '{dist}.{bare}'.)"
        for b in self._plugins.broken:
            where = f"{b.distribution} {b.version or ''}"
            msg += f" Note: plugin '{b.plugin}' from {where} failed to load ({b.error}); it may provide '{name}'."
        for dist in dict.fromkeys(f"{o.distribution} {o.version or ''}".strip() for o in self._plugins.skipped):
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
                f"a {kind} given as a mapping needs exactly the keys 'name' and optionally 'params'"
                f" (got {sorted(spec)})"
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
