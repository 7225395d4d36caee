"""docs/plugins.md against the code: every hook with its exact argument list, every kind's
interface with its exact signature, the fields of the data classes, and every registering example
passes the contract check."""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
from pathlib import Path

import pytest

from grpo_plugins import hookspecs, kinds
from grpo_plugins.kinds import KINDS
from grpo_plugins.testing import check_plugin, interface_signatures

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
DOC = DOC_PATH.read_text()
CODE_BLOCKS = re.findall(r"```(\w+)\n(.*?)```", DOC, flags=re.S)

HOOKSPECS = {
    name: fn
    for name, fn in vars(hookspecs).items()
    if inspect.isfunction(fn) and hasattr(fn, f"{hookspecs.PROJECT}_spec")
}
#: A hook as "The hooks" lists it: "- `register_rewards(register)` — rewards (kind `reward`)."
HOOK_LINE = re.compile(r"^- `(\w+)\(([^)]*)\)` — .*\(kind `(\w+)`\)", flags=re.M)


def documented_hooks(doc: str) -> dict[str, tuple[list[str], str]]:
    """hook -> (its documented argument names, the kind it says it registers), from the list in
    the section "The hooks"."""
    section = doc.split("\n## The hooks\n", 1)[1].split("\n## ", 1)[0]
    return {
        hook: ([a.strip() for a in args.split(",") if a.strip()], kind)
        for hook, args, kind in HOOK_LINE.findall(section)
    }


def hookspec_arguments() -> dict[str, tuple[list[str], str]]:
    """hook -> (its argument names, its kind), read from the hookspecs themselves."""
    kind_of = {hook: kind for kind, hook in KINDS.items()}
    return {name: (list(inspect.signature(fn).parameters), kind_of.get(name, "?")) for name, fn in HOOKSPECS.items()}


def kind_section(kind: str) -> str:
    """The text under the heading '### <kind> — `<hook>`', up to the next heading."""
    heading = f"### {kind} — `{KINDS[kind]}`"
    assert heading in DOC, f"docs/plugins.md has no section headed: {heading}"
    return DOC.split(heading, 1)[1].split("\n#", 1)[0]


def test_every_kind_has_a_hookspec_and_every_hookspec_a_kind() -> None:
    assert set(HOOKSPECS) == set(KINDS.values())


def test_every_hook_is_documented_with_its_exact_argument_list_and_kind() -> None:
    assert documented_hooks(DOC) == hookspec_arguments()


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("`register_tasks(register)`", "`register_tasks(register, config)`"),  # an argument too many
        ("- `register_tools(register)`", "- `register_tool(register)`"),  # a hook that does not exist
        ("(kind `group_filter`)", "(kind `group_filters`)"),  # the wrong kind
    ],
)
def test_the_hook_check_fails_on_a_wrong_hook_line(old: str, new: str) -> None:
    assert old in DOC
    assert documented_hooks(DOC.replace(old, new)) != hookspec_arguments()


def test_every_hookspec_says_what_it_registers_and_its_argument() -> None:
    for name, fn in HOOKSPECS.items():
        doc = inspect.getdoc(fn) or ""
        assert "Args:\n    register:" in doc, name
        assert f"(kind ``{hookspec_arguments()[name][1]}``)" in doc, name


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_interface_method_is_documented_with_its_exact_signature(kind: str) -> None:
    section = kind_section(kind)
    for signature in interface_signatures(kind):
        assert signature in section, f"the {kind} section of docs/plugins.md lacks: {signature}"


@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        ("loss_type", kinds.LossInputs), ("generator", kinds.SamplingSettings), ("generator", kinds.GenerationOutput),
        ("environment", kinds.EnvironmentSettings), ("environment", kinds.Episodes),
    ],
)
def test_every_field_of_the_interface_data_classes_is_documented(kind: str, cls: type) -> None:
    section = kind_section(kind)
    for field in dataclasses.fields(cls):
        assert f"`{field.name}`" in section, f"{cls.__name__}.{field.name} is not documented under {kind}"


@pytest.mark.parametrize(
    ("kind", "attribute"), [("generator", "samples_from_policy"), ("task", "default_rewards")]
)
def test_interface_class_attributes_are_documented(kind: str, attribute: str) -> None:
    assert hasattr(kinds.Generator if kind == "generator" else kinds.Task, attribute)
    assert f"`{attribute}`" in kind_section(kind)


def test_the_environment_switches_it_documents_exist() -> None:
    registry_source = Path(kinds.__file__).with_name("registry.py").read_text()
    for variable in ("GRPO_PLUGINS_DISABLE", "GRPO_PLUGINS_STRICT"):
        assert variable in DOC and variable in registry_source


def test_every_python_example_compiles() -> None:
    python = [code for lang, code in CODE_BLOCKS if lang == "python"]
    assert len(python) >= 8
    for code in python:
        compile(code, str(DOC_PATH), "exec")


EXAMPLES = [code for lang, code in CODE_BLOCKS if lang == "python" and "@hookimpl" in code]


def example_id(code: str) -> str:
    return re.search(r"@hookimpl\ndef (\w+)", code).group(1)  # type: ignore[union-attr]


@pytest.mark.parametrize("code", EXAMPLES, ids=[example_id(c) for c in EXAMPLES])
def test_every_registering_example_passes_the_contract_check(code: str) -> None:
    module = types.ModuleType("doc_example")
    exec(compile(code, str(DOC_PATH), "exec"), module.__dict__)
    assert check_plugin(module)


def test_every_kind_has_a_registering_example() -> None:
    hooks = {example_id(code) for code in EXAMPLES}
    assert hooks == set(KINDS.values())
