"""The shape of the ``grpo_plugins`` package: no import cycles, no oversized modules, and no
import of the built-in component packages (the core finds those through the registry)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "grpo_plugins"
MAX_LINES = 450

#: Modules allowed over MAX_LINES, each with the reason. Keep this list short.
OVERSIZED: dict[str, str] = {}  # module -> why it may exceed MAX_LINES (none today)

BUILTIN_PACKAGES = ("builtin_rewards", "builtin_losses", "builtin_environments")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Import statements run when the module is imported: not inside a function or class body,
    nor under ``if TYPE_CHECKING:``; those inside ``try``/``if``/``with`` blocks count."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            found.extend(_module_level_imports(node.orelse))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [h.body for h in getattr(node, "handlers", [])]
            for block in blocks:
                found.extend(_module_level_imports(block))
    return found


def _imported_names(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement names, relative names resolved. ``from pkg import sub``
    names ``pkg.sub`` when that is a module, else ``pkg``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        is_package = MODULES[module].name == "__init__.py"
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def import_graph() -> nx.DiGraph:
    """Module -> module it imports at module level, within ``grpo_plugins``. Importing a
    submodule also runs its parent packages' ``__init__``; that is not drawn as an arrow."""
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module, path in MODULES.items():
        for node in _module_level_imports(ast.parse(path.read_text(encoding="utf-8")).body):
            for name in _imported_names(module, node):
                if name in MODULES and name != module:
                    graph.add_edge(module, name)
    return graph


def test_the_import_graph_finds_a_known_arrow() -> None:
    graph = import_graph()
    assert graph.has_edge("grpo_plugins.registry", "grpo_plugins.kinds")
    assert graph.has_edge("grpo_plugins.plugins", "grpo_plugins.hookspecs")  # from grpo_plugins import hookspecs


def test_no_module_level_import_cycle() -> None:
    cycles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert not cycles, "modules of grpo_plugins import each other in a cycle: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_no_module_is_oversized() -> None:
    too_long = [
        f"{module} has {lines} lines"
        for module, path in MODULES.items()
        if module not in OVERSIZED and (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    ]
    assert not too_long, f"at most {MAX_LINES} lines a module (split it by job): " + "; ".join(too_long)


def test_oversized_list_names_only_oversized_modules() -> None:
    for module in OVERSIZED:
        lines = len(MODULES[module].read_text(encoding="utf-8").splitlines())
        assert lines > MAX_LINES, f"{module} has {lines} lines: remove it from OVERSIZED"


def test_core_never_imports_the_builtin_packages() -> None:
    offenders = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "level", 0) == 0:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                offenders += [f"{module} imports {n}" for n in names if n.split(".")[0] in BUILTIN_PACKAGES]
    assert not offenders, "; ".join(offenders)
