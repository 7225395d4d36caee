"""Finding components by name: entry-point discovery, registration, duplicate and error reporting.

The built-in components are found exactly like a third party's: through the entry points of
group ``grpo_plugins``. Each entry point is loaded and checked on its own (its import, pluggy's
validation, ``check_pending`` for misspelt hooks, hook functions missing ``@hookimpl``), so a
broken plugin is reported (``grpo-plugins list``) and only a run that uses it fails. The
registration hooks are then called through pluggy, all plugins in one call per hook, so
``tryfirst``/``trylast`` and wrappers work; a hook that raises marks only its own plugin broken.
``GRPO_PLUGINS_STRICT=1`` makes any load error fatal; ``GRPO_PLUGINS_DISABLE=dist1,dist2`` skips
distributions.
"""

from __future__ import annotations

import contextvars
import difflib
import functools
import importlib.metadata
import inspect
import os
import re
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from grpo_plugins import hookspecs
from grpo_plugins.config_errors import accepted_keys, model_key_message, validation_errors
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.kinds import KINDS

ENTRY_POINT_GROUP = "grpo_plugins"
LOCAL_DISTRIBUTION = "<local>"


class PluginLoadError(GRPOPluginsError):
    """A plugin failed to import or register (fatal only with GRPO_PLUGINS_STRICT=1)."""


class UnknownComponentError(GRPOPluginsError, LookupError):
    """No component of that kind has that name."""


class DuplicateComponentError(GRPOPluginsError, LookupError):
    """Two distributions register the same name for the same kind."""


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
    plugin: str
    doc: str

    @property
    def qualified_name(self) -> str:
        return f"{self.distribution}:{self.name}"

    @property
    def origin(self) -> str:
        """``reward 'x' from acme-rewards 1.2``: what it is and where it comes from."""
        version = f" {self.version}" if self.version else ""
        return f"{self.kind} '{self.name}' from {self.distribution}{version}"

    @property
    def params_model(self) -> type[BaseModel] | None:
        return getattr(self.obj, "Params", None) if inspect.isclass(self.obj) else None

    def params_schema(self) -> dict[str, Any] | None:
        model = self.params_model
        return model.model_json_schema() if model is not None else None

    def validate_params(self, params: dict[str, Any] | BaseModel | None) -> BaseModel | None:
        """Validate ``params`` against the component's params model (None if it has none)."""
        model = self.params_model
        params = params or {}
        if model is None:
            if isinstance(params, BaseModel) or params:
                keys = list(params.model_dump()) if isinstance(params, BaseModel) else list(params)
                raise ComponentParamsError(
                    f"{self.origin} takes no params (got {', '.join(map(str, keys))})",
                    [(str(keys[0]), "this component takes no params")],
                )
            return None
        if isinstance(params, model):
            return params
        if isinstance(params, BaseModel):
            params = params.model_dump()
        errors: list[tuple[str, str]] = []
        if model.model_config.get("extra") != "allow":  # unknown keys are typos, whatever the model says
            allowed = accepted_keys(model)
            errors += [(str(k), model_key_message(str(k), model)) for k in params if k not in allowed]
        try:
            validated = model.model_validate(params)
        except ValidationError as exc:
            reported = {p for p, _ in errors}
            errors += [e for e in validation_errors(exc, model, params) if e[0] not in reported]
        except Exception as exc:  # noqa: BLE001 - a params validator that raises something else
            errors.append(("", f"its params model raised {type(exc).__name__}: {exc}"))
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


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin that failed to import, or whose registration hook raised."""

    plugin: str
    distribution: str
    version: str | None
    error: str
    traceback: str


@dataclass(frozen=True)
class _PluginInfo:
    label: str
    distribution: str
    version: str | None


#: The plugin whose registration hook is running (set around each hook implementation).
_CURRENT_PLUGIN: contextvars.ContextVar[_PluginInfo] = contextvars.ContextVar("grpo_plugins_current_plugin")
#: Where the hook implementations of the current registration call record their exceptions.
_FAILURES: contextvars.ContextVar[dict[_PluginInfo, BaseException]] = contextvars.ContextVar("grpo_plugins_failures")


def _attributed(fn: Callable[..., Any], info: _PluginInfo, *, wrapper: bool) -> Callable[..., Any]:
    """``fn`` (a hook implementation of the plugin ``info``) run with ``info`` as the plugin that
    registers; an exception is recorded as that plugin's failure (a plain implementation's is
    swallowed, so the other plugins' hooks still run; a wrapper's propagates)."""
    if wrapper:

        @functools.wraps(fn)
        def wrapped_generator(*args: Any, **kwargs: Any) -> Any:
            token = _CURRENT_PLUGIN.set(info)
            try:
                return (yield from fn(*args, **kwargs))
            except Exception as exc:
                _FAILURES.get({})[info] = exc
                raise
            finally:
                _CURRENT_PLUGIN.reset(token)

        return wrapped_generator

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        token = _CURRENT_PLUGIN.set(info)
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the plugin is marked broken with it
            _FAILURES.get({}).setdefault(info, exc)
            return None
        finally:
            _CURRENT_PLUGIN.reset(token)

    return wrapped


def hook_problems(plugin: object) -> list[str]:
    """What keeps a plugin's hooks from being called: a ``@hookimpl`` whose name is no hook (with
    the closest hook), a hook function without ``@hookimpl``, or no hook at all."""
    hooks = set(KINDS.values())
    marker = f"{hookspecs.PROJECT}_impl"
    problems: list[str] = []
    implemented = 0
    for attr in dir(plugin):
        fn = getattr(plugin, attr, None)
        marked = getattr(fn, marker, None) is not None
        if marked and attr not in hooks:
            close = difflib.get_close_matches(attr, hooks, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            problems.append(f"'{attr}' is marked @hookimpl but is not a grpo-plugins hook{hint}")
        elif not marked and attr in hooks and callable(fn):
            problems.append(f"'{attr}' is not decorated with @grpo_plugins.hookimpl, so it is never called")
        implemented += marked and attr in hooks
    if not implemented and not problems:
        problems.append("it implements no grpo-plugins hook (e.g. register_rewards)")
    return problems


@dataclass
class _Loaded:
    components: dict[str, dict[str, list[Component]]] = field(
        default_factory=lambda: {kind: {} for kind in KINDS}
    )
    broken: list[BrokenPlugin] = field(default_factory=list)


def _first_paragraph(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def normalize_distribution(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): ``My_Plugin`` == ``my-plugin``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _env_disabled() -> frozenset[str]:
    raw = os.environ.get("GRPO_PLUGINS_DISABLE", "")
    return frozenset(x.strip() for x in raw.split(",") if x.strip())


def _env_strict() -> bool:
    return os.environ.get("GRPO_PLUGINS_STRICT", "").strip().lower() in {"1", "true", "yes", "on"}


class Registry:
    """All components, by kind and name.

    Args:
        disabled: distribution names (or entry-point names) whose plugins are skipped; the
            ``GRPO_PLUGINS_DISABLE`` environment variable adds to it.
        strict: raise :class:`PluginLoadError` on the first broken plugin; default from
            ``GRPO_PLUGINS_STRICT``.
        entry_points: discover installed plugins (False gives an empty registry, for tests).
    """

    def __init__(
        self,
        *,
        disabled: Iterable[str] = (),
        strict: bool | None = None,
        entry_points: bool = True,
    ) -> None:
        self.disabled = frozenset(normalize_distribution(d) for d in (*disabled, *_env_disabled()))
        self.strict = _env_strict() if strict is None else strict
        self._discover = entry_points
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._loaded: _Loaded | None = None

    # -- loading -----------------------------------------------------------------------------

    @property
    def _state(self) -> _Loaded:
        if self._loaded is None:
            self._loaded = _Loaded()
            if self._discover:
                try:
                    self._load_entry_points()
                except PluginLoadError:
                    self._loaded = None  # strict mode: fail again on the next use
                    raise
        return self._loaded

    def _load_entry_points(self) -> None:
        seen: set[tuple[str, str]] = set()
        plugins: list[object] = []
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else "<unknown>"
            version = ep.dist.version if ep.dist is not None else None
            if (dist, ep.name) in seen:  # the same distribution seen twice on sys.path
                continue
            seen.add((dist, ep.name))
            if normalize_distribution(dist) in self.disabled or normalize_distribution(ep.name) in self.disabled:
                continue
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import error makes the plugin broken
                self._mark_broken(_PluginInfo(ep.name, dist, version), exc)
                continue
            if self._register_plugin(module, _PluginInfo(ep.name, dist, version)):
                plugins.append(module)
        self._call_hooks(plugins)

    def _mark_broken(self, info: _PluginInfo, exc: BaseException | str) -> None:
        error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        broken = BrokenPlugin(
            plugin=info.label,
            distribution=info.distribution,
            version=info.version,
            error=error,
            traceback="" if isinstance(exc, str) else "".join(traceback.format_exception(exc)),
        )
        assert self._loaded is not None
        self._loaded.broken.append(broken)
        if self.strict:
            raise PluginLoadError(
                f"plugin '{info.label}' from {info.distribution} {info.version or ''} failed to load: "
                f"{broken.error} (GRPO_PLUGINS_STRICT is set)"
            ) from (None if isinstance(exc, str) else exc)

    def add_plugin(
        self,
        plugin: object,
        *,
        name: str | None = None,
        distribution: str = LOCAL_DISTRIBUTION,
        version: str | None = None,
    ) -> None:
        """Register a plugin object (a module or any object with ``@hookimpl`` functions) and run
        its registration hooks now. Errors mark it broken instead of raising (unless strict)."""
        self.add_plugins({name or getattr(plugin, "__name__", None) or repr(plugin): plugin}, distribution, version)

    def add_plugins(
        self, plugins: Mapping[str, object], distribution: str = LOCAL_DISTRIBUTION, version: str | None = None
    ) -> None:
        """Register several plugins (name -> plugin) and run their registration hooks together,
        in one pluggy call per hook, as for the installed plugins (so ``tryfirst``, ``trylast``
        and wrappers order them)."""
        _ = self._state  # load entry points first, so their components come before these
        ok = [p for label, p in plugins.items() if self._register_plugin(p, _PluginInfo(label, distribution, version))]
        self._call_hooks(ok)

    def _register_plugin(self, plugin: object, info: _PluginInfo) -> bool:
        """Register ``plugin`` with pluggy and check its hooks; False (and broken) if they are wrong."""
        try:
            self._pm.register(plugin, name=f"{info.distribution}:{info.label}")
        except Exception as exc:  # noqa: BLE001 - e.g. pluggy.PluginValidationError
            self._mark_broken(info, exc)
            return False
        problems = hook_problems(plugin)
        try:
            self._pm.check_pending()  # a @hookimpl for a hook that does not exist
        except pluggy.PluginValidationError as exc:
            problems = problems or [str(exc)]
        if problems:
            self._pm.unregister(plugin)
            self._mark_broken(info, "; ".join(problems))
            return False
        for hook_name in KINDS.values():
            for impl in getattr(self._pm.hook, hook_name).get_hookimpls():
                if impl.plugin is plugin:
                    impl.function = _attributed(impl.function, info, wrapper=impl.wrapper or impl.hookwrapper)
        return True

    def _call_hooks(self, plugins: Sequence[object]) -> None:
        """Call the registration hooks of ``plugins`` through pluggy and add what they register;
        a plugin whose hook raises is unregistered, marked broken, and adds nothing."""
        if not plugins:
            return
        names = {self._pm.get_name(p) for p in plugins}
        staged: list[tuple[_PluginInfo, Component]] = []
        failed: dict[_PluginInfo, BaseException] = {}
        for kind, hook_name in KINDS.items():

            def register(obj: Any, name: str | None = None, doc: str | None = None, _kind: str = kind) -> None:
                info = _CURRENT_PLUGIN.get(None)
                if info is None:
                    raise RuntimeError("register() was called outside the registration hook it was given to")
                staged.append((info, self._make_component(_kind, obj, name, doc, info.distribution, info.version, info.label)))

            while True:
                others = [p for p in self._pm.get_plugins() if self._pm.get_name(p) not in names]
                caller = self._pm.subset_hook_caller(hook_name, remove_plugins=others)
                mark = len(staged)
                token = _FAILURES.set(failed)
                try:
                    caller(register=register)
                    break
                except Exception:  # noqa: BLE001 - a wrapper raised: drop its plugin and call again
                    del staged[mark:]
                    if not any(self._pm.get_name(p) in names for p in self._failed_plugins(failed)):
                        raise
                    for plugin in self._failed_plugins(failed):
                        names.discard(self._pm.get_name(plugin))
                        self._pm.unregister(plugin)
                finally:
                    _FAILURES.reset(token)
            for plugin in self._failed_plugins(failed):
                names.discard(self._pm.get_name(plugin))
                self._pm.unregister(plugin)
        for info, exc in failed.items():
            self._mark_broken(info, exc)
        for info, component in staged:
            if info not in failed:
                self._add(component)

    def _failed_plugins(self, failed: Mapping[_PluginInfo, BaseException]) -> list[object]:
        wanted = {f"{i.distribution}:{i.label}" for i in failed}
        return [p for p in self._pm.get_plugins() if self._pm.get_name(p) in wanted]

    @staticmethod
    def _make_component(
        kind: str,
        obj: Any,
        name: str | None,
        doc: str | None,
        distribution: str,
        version: str | None,
        plugin: str,
    ) -> Component:
        name = name or getattr(obj, "name", None) or getattr(obj, "__name__", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"cannot register {obj!r} as a {kind}: give it a name")
        if ":" in name:
            raise ValueError(f"{kind} name '{name}' must not contain ':'")
        params = getattr(obj, "Params", None) if inspect.isclass(obj) else None
        if params is not None and not (inspect.isclass(params) and issubclass(params, BaseModel)):
            raise TypeError(f"{kind} '{name}': Params must be a pydantic BaseModel subclass")
        if not inspect.isclass(obj) and not callable(obj):
            raise TypeError(f"{kind} '{name}' must be a class or a callable, got {type(obj).__name__}")
        return Component(
            kind=kind,
            name=name,
            obj=obj,
            distribution=distribution,
            version=version,
            plugin=plugin,
            doc=doc if doc is not None else _first_paragraph(obj),
        )

    def _add(self, component: Component) -> None:
        entries = self._state.components[component.kind].setdefault(component.name, [])
        # Re-registering from the same plugin module (a re-run notebook cell) replaces; another
        # module, even of the same distribution, is a duplicate (reported when the name is used).
        entries[:] = [c for c in entries if (c.distribution, c.plugin) != (component.distribution, component.plugin)]
        entries.append(component)

    def register(
        self,
        kind: str,
        name: str | None,
        obj: Any,
        *,
        doc: str | None = None,
        distribution: str = LOCAL_DISTRIBUTION,
    ) -> Component:
        """Register ``obj`` as a ``kind`` component in-process (scripts, notebooks, tests)."""
        self._check_kind(kind)
        component = self._make_component(kind, obj, name, doc, distribution, None, "<in-process>")
        self._add(component)
        return component

    def unregister(self, kind: str, name: str, distribution: str | None = None) -> None:
        """Remove a component (all distributions' entries for the name unless one is given)."""
        self._check_kind(kind)
        entries = self._state.components[kind].get(name, [])
        entries[:] = [c for c in entries if distribution is not None and c.distribution != distribution]
        if not entries:
            self._state.components[kind].pop(name, None)

    # -- lookup ------------------------------------------------------------------------------

    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in KINDS:
            raise UnknownComponentError(f"unknown component kind '{kind}'; kinds: {', '.join(KINDS)}")

    def names(self, kind: str) -> list[str]:
        """The names registered for ``kind``, sorted."""
        self._check_kind(kind)
        return sorted(self._state.components[kind])

    def components(self, kind: str | None = None) -> list[Component]:
        """All registered components (of one kind), duplicates included."""
        kinds = [kind] if kind else list(KINDS)
        out: list[Component] = []
        for k in kinds:
            self._check_kind(k)
            for name in sorted(self._state.components[k]):
                out.extend(self._state.components[k][name])
        return out

    @property
    def broken(self) -> list[BrokenPlugin]:
        return list(self._state.broken)

    def duplicates(self) -> list[list[Component]]:
        """Groups of components that share a kind and a name."""
        return [
            entries
            for kind in KINDS
            for entries in self._state.components[kind].values()
            if len(entries) > 1
        ]

    def get(self, kind: str, name: str) -> Component:
        """The component named ``name`` (or ``distribution:name``) of ``kind``.

        Raises:
            UnknownComponentError: with close matches, the installed names and broken plugins.
            DuplicateComponentError: naming both distributions and how to choose one.
        """
        self._check_kind(kind)
        dist, _, bare = name.rpartition(":")
        entries = self._state.components[kind].get(bare, [])
        if dist:
            entries = [c for c in entries if normalize_distribution(c.distribution) == normalize_distribution(dist)]
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
            c
            for c in self.components(kind)
            if c.name == bare
            and (not dist or normalize_distribution(c.distribution) == normalize_distribution(dist))
        ]

    def build(self, kind: str, name: str, params: dict[str, Any] | BaseModel | None = None) -> Any:
        """Look up and build a component with its params in one step."""
        return self.get(kind, name).build(params)

    def _unknown_message(self, kind: str, name: str) -> str:
        bare = name.rpartition(":")[2]
        renamed = [c for c in self.components(kind) if bare in getattr(c.obj, "former_names", ())]
        if renamed:
            return f"{kind} '{name}' has been renamed to '{renamed[0].name}' ({renamed[0].origin}); use the new name"
        names = self.names(kind)
        msg = f"unknown {kind} '{name}'"
        close = difflib.get_close_matches(name.rpartition(":")[2], names, n=3, cutoff=0.6)
        msg += f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "."
        msg += f" Installed {kind} names: {', '.join(names) if names else '(none)'}."
        for b in self._state.broken:
            msg += (
                f" Note: plugin '{b.plugin}' from {b.distribution} {b.version or ''} failed to load"
                f" ({b.error}); it may provide '{name}'."
            )
        return msg

    @contextmanager
    def temporary(self, kind: str, name: str | None, obj: Any) -> Iterator[Component]:
        """Register a component for the duration of a ``with`` block, then restore the registry."""
        self._check_kind(kind)
        key = name or getattr(obj, "name", None) or getattr(obj, "__name__", None)
        before = list(self._state.components[kind].get(key, [])) if isinstance(key, str) else []
        component = self.register(kind, name, obj)
        try:
            yield component
        finally:
            if before:
                self._state.components[kind][component.name] = before
            else:
                self._state.components[kind].pop(component.name, None)


# -- the process-wide registry and the decorators ----------------------------------------------

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


def registry_for(disabled: Sequence[str] = ()) -> Registry:
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
        extra = set(spec) - {"name", "params"}
        if "name" not in spec or extra:
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


#: A registering decorator: ``@decorator("name")``, ``@decorator`` or ``decorator("name")(obj)``.
Decorator = Callable[..., Any]


def _decorator_for(kind: str) -> Decorator:
    def decorator(name: str | None = None, *, doc: str | None = None) -> Callable[[Any], Any]:
        if callable(name) and not isinstance(name, str):  # used bare: @reward
            obj = name
            register(kind, None, obj)
            return obj

        def wrap(obj: Any) -> Any:
            register(kind, name, obj, doc=doc)
            return obj

        return wrap

    decorator.__name__ = kind
    decorator.__doc__ = (
        f"Register the decorated object as a ``{kind}`` component of the process-wide registry:"
        f" ``@grpo_plugins.{kind}(\"name\")`` (or bare, taking the object's name)."
    )
    return decorator


#: One decorator per kind, read from the table of kinds: ``@grpo_plugins.reward("name")``, ...
DECORATORS: dict[str, Decorator] = {kind: _decorator_for(kind) for kind in KINDS}
