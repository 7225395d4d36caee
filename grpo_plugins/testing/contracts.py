"""Contract checks: does a component (or a plugin) satisfy the interface of its kind?

:func:`check_component` and :func:`check_plugin` raise :class:`ComponentContractError` listing
everything that is wrong: :data:`INTERFACES` names what each kind implements, and
:data:`BEHAVIOUR_CHECKS` the ``check_<kind>`` function that runs it on a small input.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.plugins import hook_problems
from grpo_plugins.registry import Component, ComponentParamsError, Registry
from grpo_plugins.testing.behaviour_checks import BEHAVIOUR_CHECKS
from grpo_plugins.testing.interfaces import (
    INTERFACES,
    OPTIONAL_METHODS,
    format_signature,
    interface_methods,
    interface_signatures,
    signature_problems,
)
from grpo_plugins.testing.registries import registered_plugin

__all__ = [
    "BEHAVIOUR_CHECKS",
    "INTERFACES",
    "OPTIONAL_METHODS",
    "ComponentContractError",
    "check_component",
    "check_plugin",
    "format_signature",
    "interface_methods",
    "interface_signatures",
]


class ComponentContractError(GRPOPluginsError, AssertionError):
    """A component (or a plugin) does not satisfy its kind's interface.

    Attributes:
        subject: what was checked, e.g. ``loss_type 'my_loss'``.
        problems: every violation found, one sentence each.
    """

    def __init__(self, subject: str, problems: list[str]) -> None:
        self.subject = subject
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{subject} does not satisfy its interface:\n{lines}")


def check_component(
    kind: str,
    obj: Any,
    *,
    name: str | None = None,
    params: dict[str, Any] | BaseModel | None = None,
    sample: dict[str, list[Any]] | None = None,
    behaviour: bool = True,
) -> Any:
    """Check a component against the interface of its kind and return it built.

    ``obj`` is what a plugin passes to ``register`` (a class, or for rewards also a function).
    Checked: that it registers (a name without ':', ``Params`` a pydantic model); that it builds
    as the registry builds it, with ``params`` (default: the params model's defaults); that each
    interface method exists, is implemented, and accepts the interface's arguments (the core passes
    them positionally; a reward gets keyword arguments); and, with ``behaviour``, what it does on a small random input:

    * reward: called with ``prompts``, ``completions``, ``completion_ids`` and the columns in
      ``sample`` (which may also replace those three); returns one float or None per completion;
    * loss_type: ``per_token_loss`` is (B, T) or (B, 1) and finite; ``reduce`` returns a finite
      0-d tensor with a gradient, ignores masked positions, and is exactly 0 when every token is
      masked; ``metrics`` values are (B, T) or (B, 1) (or a ``RowExtremum`` of such);
    * importance_sampling: (B, T) or (B, 1), finite, differentiable, 0 when log_ratio is 0;
    * reward_scaling: (N,) and finite for scorable rows with a NaN row and a zero-std group,
      input not modified;
    * rollout_correction: (B, T) or (B, 1) in [0, cap], 1 when sampler and policy agree;
    * task: ``load(0)`` gives a non-empty dataset with a ``prompt`` column, and
      ``default_rewards`` are names or mappings; ``load_eval(0)``, when it gives a dataset, has
      a ``prompt`` column and no prompt of ``load(0)``;
    * group_filter: ``keep`` returns (N/G,) bool, keeps every group when ``drops_groups`` is
      False, input not modified;
    * generator: only the static checks (generating needs a model);
    * environment: run with a scripted policy (``sample["reply"]``) on two chat prompts, its
      episodes are consistent (shapes, the model's tokens within the episode and the budget);
    * tool: transformers' ``get_json_schema`` can describe it.

    Raises:
        ComponentContractError: listing every problem found.
    """
    subject = f"{kind} '{name or getattr(obj, 'name', None) or getattr(obj, '__name__', None) or obj!r}'"
    try:
        component = Registry(entry_points=False).register(kind, name, obj)
    except (TypeError, ValueError) as exc:
        raise ComponentContractError(subject, [f"it cannot be registered: {exc}"]) from None
    subject = f"{kind} '{component.name}'"
    try:
        built = component.build(params)
    except ComponentParamsError as exc:
        hint = "" if params is not None else " (pass params= to check_component when its Params has required fields)"
        raise ComponentContractError(subject, [f"it cannot be built with these params: {exc}{hint}"]) from None
    except Exception as exc:  # noqa: BLE001 - whatever building raises is the problem to report
        how = "cls(params)" if component.params_model is not None else "cls()"
        raise ComponentContractError(subject, [f"building it as {how} raised {type(exc).__name__}: {exc}"]) from None
    problems = signature_problems(kind, built)
    if not problems and behaviour:
        try:
            problems = BEHAVIOUR_CHECKS[kind](built, dict(sample or {}))
        except Exception as exc:  # noqa: BLE001 - a component that raises on valid input fails the check
            problems = [f"it raised {type(exc).__name__} on a valid sample input: {exc}"]
    if problems:
        raise ComponentContractError(subject, problems)
    return built


def check_plugin(
    plugin: object,
    *,
    params: dict[str, dict[str, Any] | BaseModel] | None = None,
    sample: dict[str, list[Any]] | None = None,
    behaviour: bool = True,
) -> list[Component]:
    """Register ``plugin`` (a module or object with ``@hookimpl`` functions) in a scratch registry
    and :func:`check_component` every component it registers.

    First finds misspelt hooks and hook functions missing ``@hookimpl`` (then nothing else is
    checked: such a plugin is broken). ``params`` maps component
    names to the params to build them with; ``sample`` is passed to every reward's check.

    Returns:
        The components it registers.

    Raises:
        PluginLoadError: a registration hook raised or does not match its hookspec.
        ComponentContractError: listing the problems of every component.
    """
    label = getattr(plugin, "__name__", None) or type(plugin).__name__
    problems = hook_problems(plugin)
    if problems:  # its hooks would not be called (the registry marks such a plugin broken)
        raise ComponentContractError(f"plugin '{label}'", problems)
    scratch = Registry(entry_points=False)
    with registered_plugin(plugin, registry=scratch):
        components = scratch.components()
    if not components:
        problems.append("it registers no components: implement a registration hook (e.g. register_rewards)")
    for c in components:
        try:
            check_component(
                c.kind, c.obj, name=c.name, params=(params or {}).get(c.name), sample=sample, behaviour=behaviour
            )
        except ComponentContractError as exc:
            problems += [f"{c.kind} '{c.name}': {p}" for p in exc.problems]
    if problems:
        raise ComponentContractError(f"plugin '{label}'", problems)
    return components
