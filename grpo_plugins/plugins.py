"""Loading plugins: entry points, pluggy, and keeping a broken plugin from breaking the rest.

Each entry point of the ``grpo_plugins`` group is imported and checked on its own (pluggy's
validation, a ``@hookimpl`` whose name is no hook, a hook function without ``@hookimpl``). The
registration hooks of all plugins are then called through pluggy, one call per hook, so
``tryfirst``, ``trylast`` and wrappers work; every ``register`` call is attributed to the plugin
that made it, and a hook that raises marks only its own plugin broken, keeping nothing it
registered. What ``register`` makes of a registration is the caller's (:mod:`grpo_plugins.registry`).
Importing a plugin and calling its hooks leaves the random generators and torch's thread count as
they were (:func:`global_state_kept`).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.metadata
import random
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pluggy

from grpo_plugins import hookspecs
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.kinds import KINDS

ENTRY_POINT_GROUP = "grpo_plugins"

#: What a registration becomes: ``make(kind, origin, obj, name=None, doc=None)``; it may raise
#: (a name with ':'), which marks the registering plugin broken.
Make = Callable[..., Any]


class PluginLoadError(GRPOPluginsError):
    """A plugin failed to import or register (fatal only with GRPO_PLUGINS_STRICT=1)."""


def normalize_distribution(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): ``My_Plugin`` == ``my-plugin``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Origin:
    """Where components come from: a plugin's (entry-point) name, distribution and version."""

    plugin: str
    distribution: str
    version: str | None = None


@dataclass(frozen=True)
class BrokenPlugin:
    """A plugin that failed to import, or whose registration hook raised."""

    plugin: str
    distribution: str
    version: str | None
    error: str
    traceback: str


def hook_problems(plugin: object) -> list[str]:
    """What keeps a plugin's hooks from being called: a ``@hookimpl`` whose name is no hook (with
    the closest hook), a hook function without ``@hookimpl``, or no hook at all."""
    hooks, problems, implemented = set(KINDS.values()), [], False
    for attr in dir(plugin):
        marked = getattr(getattr(plugin, attr, None), f"{hookspecs.PROJECT}_impl", None) is not None
        if marked and attr not in hooks:
            close = difflib.get_close_matches(attr, hooks, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            problems.append(f"'{attr}' is marked @hookimpl but is not a grpo-plugins hook{hint}")
        elif not marked and attr in hooks and callable(getattr(plugin, attr)):
            problems.append(f"'{attr}' is not decorated with @grpo_plugins.hookimpl, so it is never called")
        implemented = implemented or (marked and attr in hooks)
    if not implemented and not problems:
        problems.append("it implements no grpo-plugins hook (e.g. register_rewards)")
    return problems


@contextlib.contextmanager
def global_state_kept() -> Iterator[None]:
    """Put back what a plugin's import or registration hook may change and a seeded run depends
    on: the state of Python's, NumPy's and torch's random number generators (torch's CUDA ones
    where CUDA is initialised) and torch's thread count. So an installed plugin that the config
    does not use cannot change a seeded run, whenever it is loaded. Modules first imported inside
    the block (torch or NumPy by a plugin) start from their own import-time state."""
    py_state = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    torch = sys.modules.get("torch")
    torch_state = None
    if torch is not None:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        torch_state = (torch.random.get_rng_state(), cuda, torch.get_num_threads())
    try:
        yield
    finally:
        random.setstate(py_state)
        if np is not None:
            np.random.set_state(np_state)
        if torch is not None and torch_state is not None:
            cpu, cuda, threads = torch_state
            torch.random.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)


class Plugins:
    """The plugins of one registry: pluggy's manager, the broken plugins, the disabled ones.

    Args:
        strict: raise :class:`PluginLoadError` on the first broken plugin instead of recording it.
    """

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.broken: list[BrokenPlugin] = []
        self.skipped: list[Origin] = []  # disabled: not even imported
        self._failures: dict[Origin, BaseException] = {}  # the hooks that raised in the current call

    def load_entry_points(self, disabled: frozenset[str], make: Make) -> list[Any]:
        """Load the installed plugins except the ``disabled`` distributions or entry points, and
        return what they register."""
        plugins, seen = [], set()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            origin = Origin(ep.name, ep.dist.name if ep.dist else "<unknown>", ep.dist.version if ep.dist else None)
            if origin in seen:  # one distribution found twice on sys.path
                continue
            seen.add(origin)
            if {normalize_distribution(origin.distribution), normalize_distribution(ep.name)} & disabled:
                self.skipped.append(origin)
                continue
            try:
                with global_state_kept():
                    plugins.append((ep.load(), origin))
            except Exception as exc:  # noqa: BLE001 - any import error makes the plugin broken
                self.mark_broken(origin, exc)
        return self.add(plugins, make)

    def add(self, plugins: list[tuple[object, Origin]], make: Make) -> list[Any]:
        """Register ``plugins`` (modules, or objects with ``@hookimpl`` functions) with pluggy,
        call their registration hooks together and return what they register."""
        plugins = [(plugin, origin) for plugin, origin in plugins if self._accept(plugin, origin)]
        others = [p for p in self.pm.get_plugins() if all(p is not q for q, _ in plugins)]
        made: list[tuple[Origin, Any]] = []

        def register(kind: str, origin: Origin, obj: Any, name: str | None = None, doc: str | None = None) -> None:
            made.append((origin, make(kind, origin, obj, name, doc)))

        self._failures = {}
        for kind, hook in KINDS.items():
            with global_state_kept():
                self.pm.subset_hook_caller(hook, remove_plugins=others)(register=functools.partial(register, kind))
            for plugin, origin in plugins:  # a failed plugin's other hooks are not called
                if origin in self._failures and self.pm.is_registered(plugin):
                    self.pm.unregister(plugin)
        failures, self._failures = self._failures, {}
        for origin, exc in failures.items():
            self.mark_broken(origin, exc)
        return [thing for origin, thing in made if origin not in failures]

    def _accept(self, plugin: object, origin: Origin) -> bool:
        """Register ``plugin`` with pluggy if its hooks are right; else mark it broken."""
        try:
            self.pm.register(plugin, name=f"{origin.distribution}:{origin.plugin}")
        except Exception as exc:  # noqa: BLE001 - e.g. pluggy.PluginValidationError
            self.mark_broken(origin, exc)
            return False
        problems = hook_problems(plugin)
        try:
            self.pm.check_pending()  # a @hookimpl for a hook that does not exist
        except pluggy.PluginValidationError as exc:
            problems = problems or [str(exc)]
        if problems:
            self.pm.unregister(plugin)
            self.mark_broken(origin, "; ".join(problems))
            return False
        for hook in KINDS.values():
            for impl in getattr(self.pm.hook, hook).get_hookimpls():
                if impl.plugin is plugin:
                    impl.function = self._guarded(impl.function, origin, impl.wrapper or impl.hookwrapper)
        return True

    def _guarded(self, fn: Callable[..., Any], origin: Origin, wrapper: bool) -> Callable[..., Any]:
        """``fn``, a hook implementation of the plugin ``origin``, given a ``register`` that knows
        the plugin; an exception is recorded as the plugin's failure instead of propagating, so
        the other plugins' hooks still run (a failing wrapper passes the result through)."""

        def attempt(step: Callable[[], Any]) -> tuple[bool, Any]:
            try:
                return True, step()
            except StopIteration as stop:  # a wrapper's return value
                return True, stop.value
            except Exception as exc:  # noqa: BLE001 - the plugin is marked broken with it
                self._failures.setdefault(origin, exc)
                return False, None

        def own(args: tuple[Any, ...]) -> list[Any]:  # the hook's arguments: () or (register,)
            return [functools.partial(register, origin) for register in args]

        if not wrapper:
            return functools.wraps(fn)(lambda *args: attempt(lambda: fn(*own(args)))[1])

        @functools.wraps(fn)
        def guarded_wrapper(*args: Any) -> Any:
            generator = fn(*own(args))
            ok, _ = attempt(lambda: next(generator))
            result = returned = yield
            if ok:
                ok, returned = attempt(lambda: generator.send(result))
            return returned if ok else result

        return guarded_wrapper

    def mark_broken(self, origin: Origin, exc: BaseException | str) -> None:
        """Record ``origin`` as broken by ``exc`` (a message, or the exception it raised)."""
        error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        trace = "" if isinstance(exc, str) else "".join(traceback.format_exception(exc))
        self.broken.append(BrokenPlugin(origin.plugin, origin.distribution, origin.version, error, trace))
        if self.strict:
            raise PluginLoadError(
                f"plugin '{origin.plugin}' from {origin.distribution} {origin.version or ''} failed to load: "
                f"{error} (GRPO_PLUGINS_STRICT is set)"
            ) from (None if isinstance(exc, str) else exc)
