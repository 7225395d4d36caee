"""What each component kind implements: :data:`INTERFACES` (the class in :mod:`grpo_plugins.kinds`,
or for rewards and tools the call signature), its methods and their exact signatures, and the
signature problems of a built component."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from grpo_plugins import kinds
from grpo_plugins.kinds import KINDS

#: What implements the interface of each kind: the class in :mod:`grpo_plugins.kinds` whose
#: public methods a component provides, or for rewards and tools the call signature itself.
INTERFACES: dict[str, Any] = {
    "reward": kinds.reward_interface,
    "loss_type": kinds.LossType,
    "importance_sampling": kinds.ImportanceSampling,
    "reward_scaling": kinds.RewardScaling,
    "rollout_correction": kinds.RolloutCorrection,
    "generator": kinds.Generator,
    "group_filter": kinds.GroupFilter,
    "environment": kinds.Environment,
    "tool": kinds.tool_interface,
    "task": kinds.Task,
}


#: Interface methods a component may leave out (the core then uses the base class's default).
OPTIONAL_METHODS: dict[str, tuple[str, ...]] = {"generator": ("sampling_override",), "task": ("load_eval",)}


def interface_methods(kind: str) -> dict[str, Callable[..., Any]]:
    """The methods a component of ``kind`` provides, as declared in :mod:`grpo_plugins.kinds`
    (for a reward: ``{"__call__": reward_interface}``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown component kind '{kind}'; kinds: {', '.join(KINDS)}")
    spec = INTERFACES.get(kind)
    if spec is None:
        return {}
    if not inspect.isclass(spec):
        return {"__call__": spec}
    return {n: f for n, f in vars(spec).items() if not n.startswith("_") and inspect.isfunction(f)}


class _Annotation:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _unquoted(annotation: Any) -> Any:
    if annotation is inspect.Parameter.empty:
        return annotation
    if isinstance(annotation, str):
        return _Annotation(annotation)
    return _Annotation(inspect.formatannotation(annotation))


def format_signature(name: str, fn: Callable[..., Any]) -> str:
    """``name(arg: Type, ...) -> Return``, with annotations as written in the source."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=_unquoted(p.annotation)) for p in sig.parameters.values()]
    sig = sig.replace(parameters=params, return_annotation=_unquoted(sig.return_annotation))
    return f"{name}{sig}"


def interface_signatures(kind: str) -> list[str]:
    """The exact signatures of ``kind``'s interface (what docs/plugins.md documents)."""
    return [
        format_signature(kind if method == "__call__" else method, fn)
        for method, fn in interface_methods(kind).items()
    ]


def _raises_not_implemented(fn: Callable[..., Any]) -> bool:
    try:
        return "raise NotImplementedError" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def signature_problems(kind: str, built: Any) -> list[str]:
    problems: list[str] = []
    base = INTERFACES.get(kind)
    for method, spec in interface_methods(kind).items():
        expected = format_signature(kind if method == "__call__" else method, spec)
        target = built if method == "__call__" else getattr(built, method, None)
        if target is None and method in OPTIONAL_METHODS.get(kind, ()):
            continue
        if target is None or not callable(target):
            problems.append(f"missing method: {expected}")
            continue
        if (
            inspect.isclass(base)
            and inspect.getattr_static(type(built), method, None) is vars(base).get(method)
            and _raises_not_implemented(spec)
        ):
            problems.append(
                f"{method} is not implemented (it is inherited from {base.__name__}, which raises "
                "NotImplementedError)"
            )
            continue
        try:
            actual = inspect.signature(target)
        except (TypeError, ValueError):  # builtins and C callables: nothing to check
            continue
        if method == "__call__":
            for p in actual.parameters.values():
                if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
                    problems.append(
                        f"parameter '{p.name}' is positional-only, but a {kind} is called with keyword "
                        f"arguments only: {expected}"
                    )
            continue
        # The core calls interface methods positionally, so parameter names are the author's.
        names = [p.name for p in inspect.signature(spec).parameters.values() if p.name != "self"]
        try:
            actual.bind(*names)
        except TypeError as exc:
            problems.append(f"{format_signature(method, target)} cannot be called as {expected} ({exc})")
    return problems
