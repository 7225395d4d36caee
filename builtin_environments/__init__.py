"""The built-in environments and tools of grpo-plugins, registered through the public entry
point (group ``grpo_plugins``) exactly as a third-party plugin's are; the core never imports
this package.

Environments: ``single_turn`` (the default: one completion per prompt) and ``tool_calling``
(multi-turn with tools). Tools: ``calculator`` and ``python``. See docs/environments.md.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_plugins import hookimpl

from builtin_environments.single_turn import SingleTurn
from builtin_environments.tool_calling import ToolCalling
from builtin_environments.tools import calculator, python


@hookimpl
def register_environments(register: Callable[..., Any]) -> None:
    register(SingleTurn, name="single_turn")
    register(ToolCalling, name="tool_calling")


@hookimpl
def register_tools(register: Callable[..., Any]) -> None:
    register(calculator, name="calculator")
    register(python, name="python")
