"""Registering plugins and components for the duration of a test.

:func:`registered_plugin`, :func:`registered_component` and :func:`isolated_registry` change a
registry inside a ``with`` block and restore it exactly afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from grpo_plugins.registry import Component, PluginLoadError, Registry, get_registry, set_registry

TEST_DISTRIBUTION = "<test>"


@contextmanager
def registered_plugin(
    *plugins: object,
    registry: Registry | None = None,
    distribution: str = TEST_DISTRIBUTION,
    version: str | None = None,
    strict: bool = True,
) -> Iterator[Registry]:
    """Register plugins (modules, or any objects with ``@hookimpl`` functions) for a ``with`` block.

    On exit the registry is exactly as before (components, broken plugins, pluggy's own
    registrations), so the same plugin can be registered again by the next test.

    Args:
        plugins: the plugin modules or objects.
        registry: the registry to change; default the process-wide one (what the config, the
            objective and the engine use).
        distribution: the distribution name their components are listed under (``dist:name``).
        version: the version shown for them.
        strict: raise :class:`~grpo_plugins.registry.PluginLoadError` (with the traceback) when a
            plugin's hook raises or does not validate, instead of marking it broken.

    Yields:
        The registry.
    """
    registry = registry if registry is not None else get_registry()
    snapshot = registry.snapshot()
    try:
        for plugin in plugins:
            if registry.is_registered(plugin):
                raise PluginLoadError(
                    f"plugin {getattr(plugin, '__name__', plugin)!r} is already registered (installed, so "
                    "loaded through its entry point?); test it alone with isolated_registry(plugin), or "
                    "use the installed components as they are"
                )
            known = len(registry.broken)
            registry.add_plugin(plugin, distribution=distribution, version=version)
            failed = registry.broken[known:]
            if strict and failed:
                raise PluginLoadError(
                    f"plugin '{failed[0].plugin}' failed to register: {failed[0].error}\n{failed[0].traceback}"
                )
        yield registry
    finally:
        registry.restore(snapshot)


@contextmanager
def registered_component(
    kind: str, obj: Any, name: str | None = None, *, registry: Registry | None = None
) -> Iterator[Component]:
    """Register one component for a ``with`` block, then restore whatever had that name before.

    ``obj`` is what a plugin passes to ``register`` (a class or a function); ``name`` defaults to
    ``obj.name`` or ``obj.__name__``. Yields the :class:`~grpo_plugins.registry.Component`.
    """
    registry = registry if registry is not None else get_registry()
    with registry.temporary(kind, name, obj) as component:
        yield component


@contextmanager
def isolated_registry(
    *plugins: object,
    entry_points: bool = False,
    disabled: tuple[str, ...] = (),
    distribution: str = TEST_DISTRIBUTION,
    version: str | None = None,
) -> Iterator[Registry]:
    """Make a fresh registry the process-wide one for a ``with`` block, holding only ``plugins``
    (plus the installed plugins when ``entry_points`` is True), then put the previous one back.

    Without ``entry_points`` not even the built-in components are there: use it for tests of the
    plugin alone, and :func:`registered_plugin` for tests that also need the built-ins.
    """
    registry = Registry(entry_points=entry_points, disabled=disabled)
    previous = set_registry(registry)
    try:
        with registered_plugin(*plugins, registry=registry, distribution=distribution, version=version):
            yield registry
    finally:
        set_registry(previous)
