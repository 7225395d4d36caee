"""The hooks a grpo-plugins plugin may implement: one registration hook per component kind.

A plugin is a module (named by an entry point in the ``grpo_plugins`` group) that implements
one or more of these hooks, each decorated with ``@grpo_plugins.hookimpl``. Every hook receives a
``register`` callback and calls it once per component it provides::

    from grpo_plugins import hookimpl

    @hookimpl
    def register_rewards(register):
        register(my_reward)                  # name taken from the function's __name__
        register(MyReward, name="my_reward_with_params")

``register(obj, name=None, doc=None)``: ``obj`` is the component (see :mod:`grpo_plugins.kinds`
for what each kind must provide), ``name`` defaults to ``obj.name`` or ``obj.__name__``, ``doc``
to the first paragraph of its docstring. A component that declares a pydantic model as
``obj.Params`` receives its validated parameters when it is built.

The hooks are called through pluggy when the registry is first used (all installed plugins in
one call per hook, so ``tryfirst``/``trylast`` and ``wrapper=True`` implementations work), and
for a plugin added later when it is added. A hook that raises, a ``@hookimpl`` whose name is no
hook (``register_reward``), or a hook function without ``@hookimpl`` marks its plugin as broken
(shown by ``grpo-plugins list``); the other plugins keep working.

The hookspecs below are generated from :data:`grpo_plugins.kinds.COMPONENT_KINDS`, the one table
of kinds; each is ``<hook>(register)`` with the kind's documentation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

from grpo_plugins.kinds import COMPONENT_KINDS, ComponentKind

PROJECT = "grpo_plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


def _hookspec(kind: ComponentKind) -> Callable[..., Any]:
    def spec(register):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        """(replaced by the kind's hook_doc)"""

    spec.__name__ = spec.__qualname__ = kind.hook
    spec.__doc__ = kind.hook_doc
    spec.__module__ = __name__
    return hookspec(spec)


for _kind in COMPONENT_KINDS.values():
    globals()[_kind.hook] = _hookspec(_kind)
del _kind
