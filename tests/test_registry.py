"""The plugin registry: discovery from installed distributions, broken and duplicate plugins,
strict mode, disabling, in-process registration, params models, and the core/builtin boundary."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

import grpo_plugins
from grpo_plugins import hookimpl
from grpo_plugins.registry import (
    ComponentParamsError,
    DuplicateComponentError,
    PluginLoadError,
    Registry,
    UnknownComponentError,
    get_registry,
    set_registry,
)
from plugin_dists import make_distribution, reward_plugin

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, path: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``grpo-plugins ARGS`` in a fresh interpreter, with ``path`` prepended to PYTHONPATH."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_PLUGINS_")}
    if path is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "grpo_plugins.cli", *args],
        capture_output=True, text=True, env=full_env, cwd=ROOT, timeout=60,
    )


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh path entry, on sys.path for this test, to "install" throwaway distributions into."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    for var in ("GRPO_PLUGINS_STRICT", "GRPO_PLUGINS_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    return root


def _forget_modules(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)


# -- discovery ---------------------------------------------------------------------------------


def test_installed_distribution_is_found_with_its_name_and_version(site: Path, monkeypatch: pytest.MonkeyPatch):
    make_distribution(site, "acme-rewards", "1.2.3", {"acme_rw_a": reward_plugin("acme_len", params=True)})
    _forget_modules(monkeypatch, "acme_rw_a")
    component = Registry().get("reward", "acme_len")
    assert (component.distribution, component.version, component.plugin) == ("acme-rewards", "1.2.3", "acme_rw_a")
    assert component.doc == "Scores short completions."
    assert component.build({"max_len": 2})(["p", "p"], ["ab", "abc"]) == [1.0, 0.0]


def test_list_shows_an_installed_distribution(tmp_path: Path):
    site = make_distribution(tmp_path, "acme-rewards", "1.2.3", {"acme_rw_b": reward_plugin("acme_len", params=True)})
    listed = run_cli("list", "--json", path=site)
    assert listed.returncode == 0, listed.stderr
    rows = [c for c in json.loads(listed.stdout)["components"] if c["name"] == "acme_len"]
    assert len(rows) == 1
    assert (rows[0]["kind"], rows[0]["distribution"], rows[0]["version"]) == ("reward", "acme-rewards", "1.2.3")
    assert rows[0]["doc"] == "Scores short completions."
    assert rows[0]["params_schema"]["properties"]["max_len"]["default"] == 100
    table = run_cli("list", "--kind", "reward", path=site)
    assert table.returncode == 0, table.stderr
    line = next(line for line in table.stdout.splitlines() if "acme_len" in line)
    assert "acme-rewards" in line and "1.2.3" in line and "max_len: int = 100" in line


def test_broken_plugin_is_listed_with_its_error_and_the_rest_works(tmp_path: Path):
    site = make_distribution(tmp_path, "good-plugin", "0.1.0", {"good_rw_c": reward_plugin("good_reward")})
    make_distribution(site, "bad-plugin", "6.6.6", {"bad_rw_c": "import no_such_module_anywhere\n"})
    listed = run_cli("list", "--json", path=site)
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    broken = [b for b in data["broken"] if b["distribution"] == "bad-plugin"]
    assert broken == [
        {
            "plugin": "bad_rw_c",
            "distribution": "bad-plugin",
            "version": "6.6.6",
            "error": "ModuleNotFoundError: No module named 'no_such_module_anywhere'",
        }
    ]
    assert any(c["name"] == "good_reward" for c in data["components"])
    assert any(c["name"] == "dapo" for c in data["components"]), "the built-in plugins still load"
    table = run_cli("list", path=site)
    assert "broken plugins" in table.stdout and "no_such_module_anywhere" in table.stdout
    assert "Traceback" not in table.stdout + table.stderr


def test_a_misspelt_hook_and_a_missing_hookimpl_are_listed_as_broken_with_what_is_wrong(tmp_path: Path):
    misspelt = "from grpo_plugins import hookimpl\n\n@hookimpl\ndef register_reward(register):\n    pass\n"
    unmarked = "def register_rewards(register):\n    register(lambda prompts, completions, **kw: [0.0], name='x')\n"
    site = make_distribution(tmp_path, "typo-plugin", "0.1.0", {"typo_rw_m": misspelt})
    make_distribution(site, "unmarked-plugin", "0.2.0", {"unmarked_rw_m": unmarked})
    listed = run_cli("list", "--json", path=site)
    assert listed.returncode == 0, listed.stderr
    broken = {b["distribution"]: b["error"] for b in json.loads(listed.stdout)["broken"]}
    assert broken["typo-plugin"] == (
        "'register_reward' is marked @hookimpl but is not a grpo-plugins hook; did you mean 'register_rewards'?"
    )
    assert broken["unmarked-plugin"] == (
        "'register_rewards' is not decorated with @grpo_plugins.hookimpl, so it is never called"
    )
    config = tmp_path / "run.yaml"
    config.write_text("task: arithmetic\nnum_generations: 4\nper_device_train_batch_size: 4\n")
    validated = run_cli("validate", str(config), path=site)
    assert validated.returncode == 0, validated.stderr
    out = " ".join(validated.stdout.split())
    assert "broken plugin (not loaded): typo_rw_m from typo-plugin 0.1.0: 'register_reward' is marked @hookimpl" in out


def test_two_modules_of_one_distribution_registering_one_name_are_a_duplicate(
    site: Path, monkeypatch: pytest.MonkeyPatch
):
    make_distribution(site, "twin-rewards", "1.0", {"twin_a_n": reward_plugin("twin"), "twin_b_n": reward_plugin("twin")})
    _forget_modules(monkeypatch, "twin_a_n", "twin_b_n")
    registry = Registry()
    with pytest.raises(DuplicateComponentError, match=r"reward 'twin' is registered by 2 plugins of twin-rewards"):
        registry.get("reward", "twin")
    assert any({c.plugin for c in group} == {"twin_a_n", "twin_b_n"} for group in registry.duplicates())


def test_re_registering_from_the_same_module_replaces():
    registry = Registry(entry_points=False)
    registry.register("reward", "cell", lambda prompts, completions, **kw: [0.0] * len(completions))
    second = registry.register("reward", "cell", lambda prompts, completions, **kw: [1.0] * len(completions))
    assert registry.get("reward", "cell") is second


def test_hooks_are_called_through_pluggy_so_tryfirst_and_wrappers_work():
    # Added together, as the installed plugins are loaded: one pluggy call per hook.
    registry = Registry(entry_points=False)
    calls: list[str] = []

    class Late:
        @hookimpl(trylast=True)
        def register_rewards(self, register):
            calls.append("late")

    class Early:
        @hookimpl(tryfirst=True)
        def register_rewards(self, register):
            calls.append("early")

    class Wrapping:
        @hookimpl(wrapper=True)
        def register_rewards(self, register):
            calls.append("wrapper before")
            result = yield
            calls.append("wrapper after")
            register(lambda prompts, completions, **kw: [0.0] * len(completions), name="from_wrapper")
            return result

    registry.add_plugins({"late": Late(), "early": Early(), "wrapping": Wrapping()})
    assert calls == ["wrapper before", "early", "late", "wrapper after"]
    assert registry.get("reward", "from_wrapper").plugin == "wrapping"


def test_a_broken_plugin_is_named_when_its_component_is_missing(site: Path, monkeypatch: pytest.MonkeyPatch):
    make_distribution(site, "bad-plugin", "6.6.6", {"bad_rw_d": "raise RuntimeError('boom at import')\n"})
    _forget_modules(monkeypatch, "bad_rw_d")
    registry = Registry()
    assert [b.distribution for b in registry.broken if b.plugin == "bad_rw_d"] == ["bad-plugin"]
    with pytest.raises(UnknownComponentError, match="bad-plugin 6.6.6 failed to load .*boom at import"):
        registry.get("reward", "its_reward")


def test_strict_mode_makes_a_load_error_fatal(site: Path, monkeypatch: pytest.MonkeyPatch):
    make_distribution(site, "bad-plugin", "6.6.6", {"bad_rw_e": "raise RuntimeError('boom')\n"})
    _forget_modules(monkeypatch, "bad_rw_e")
    monkeypatch.setenv("GRPO_PLUGINS_STRICT", "1")
    registry = Registry()
    with pytest.raises(PluginLoadError, match="bad_rw_e.*bad-plugin.*boom"):
        registry.names("reward")
    with pytest.raises(PluginLoadError):  # and again: the registry does not half-load
        registry.names("reward")
    result = run_cli("list", path=site, env={"GRPO_PLUGINS_STRICT": "1"})
    assert result.returncode == 2
    assert "GRPO_PLUGINS_STRICT" in result.stderr and "Traceback" not in result.stderr


def test_duplicate_names_are_reported_with_both_distributions(site: Path, monkeypatch: pytest.MonkeyPatch):
    make_distribution(site, "dist-one", "1.0", {"dup_one_f": reward_plugin("shared_score")})
    make_distribution(site, "dist-two", "2.0", {"dup_two_f": reward_plugin("shared_score", params=True)})
    _forget_modules(monkeypatch, "dup_one_f", "dup_two_f")
    registry = Registry()
    groups = [g for g in registry.duplicates() if g[0].name == "shared_score"]
    assert len(groups) == 1 and {c.distribution for c in groups[0]} == {"dist-one", "dist-two"}
    with pytest.raises(DuplicateComponentError) as info:
        registry.get("reward", "shared_score")
    message = str(info.value)
    assert "dist-one" in message and "dist-two" in message
    assert "'dist-one:shared_score'" in message and "'dist-two:shared_score'" in message
    assert registry.get("reward", "dist-two:shared_score").params_model is not None
    assert registry.get("reward", "dist_one:shared_score").distribution == "dist-one"  # pip-style name


def test_list_flags_duplicates(tmp_path: Path):
    make_distribution(tmp_path, "dist-one", "1.0", {"dup_one_g": reward_plugin("shared_score")})
    make_distribution(tmp_path, "dist-two", "2.0", {"dup_two_g": reward_plugin("shared_score")})
    listed = run_cli("list", "--json", path=tmp_path)
    data = json.loads(listed.stdout)
    assert {"kind": "reward", "name": "shared_score", "distributions": ["dist-one", "dist-two"]} in [
        {**d, "distributions": sorted(d["distributions"])} for d in data["duplicates"]
    ]
    assert all(c["duplicate"] for c in data["components"] if c["name"] == "shared_score")
    table = run_cli("list", "--kind", "reward", path=tmp_path)
    assert "duplicate reward 'shared_score'" in table.stdout
    assert "dist-one:shared_score" in table.stdout and "dist-two:shared_score" in table.stdout


def test_disable_env_skips_a_distribution(site: Path, monkeypatch: pytest.MonkeyPatch):
    make_distribution(site, "dist-one", "1.0", {"dis_one_h": reward_plugin("shared_score")})
    make_distribution(site, "dist-two", "2.0", {"dis_two_h": reward_plugin("shared_score")})
    _forget_modules(monkeypatch, "dis_one_h", "dis_two_h")
    monkeypatch.setenv("GRPO_PLUGINS_DISABLE", "dist-one, other")
    assert Registry().get("reward", "shared_score").distribution == "dist-two"
    monkeypatch.delenv("GRPO_PLUGINS_DISABLE")
    assert Registry(disabled=["dist_two"]).get("reward", "shared_score").distribution == "dist-one"


def test_a_component_of_a_disabled_plugin_is_reported_as_disabled_not_unknown(site: Path, monkeypatch: pytest.MonkeyPatch):
    make_distribution(site, "dist-one", "1.0", {"dis_one_j": reward_plugin("only_here")})
    _forget_modules(monkeypatch, "dis_one_j")
    registry = Registry(disabled=["dist_one"])
    with pytest.raises(UnknownComponentError) as info:
        registry.get("reward", "dist-one:only_here")  # a disabled distribution's name is never imported
    assert str(info.value) == (
        "reward 'dist-one:only_here': distribution 'dist-one' is disabled (GRPO_PLUGINS_DISABLE or the "
        "config's disable_plugins); enable it to use 'only_here'"
    )
    with pytest.raises(UnknownComponentError) as info:
        registry.get("reward", "only_here")
    assert (
        "Note: dist-one 1.0 is disabled (GRPO_PLUGINS_DISABLE or the config's disable_plugins); it may "
        "provide 'only_here'."
    ) in str(info.value)
    assert "dis_one_j" not in sys.modules  # disabled: not even imported


@pytest.mark.slow
def test_pip_installed_distribution_is_listed(tmp_path: Path):
    project = tmp_path / "project"
    (project / "pipplug_i").mkdir(parents=True)
    (project / "pipplug_i" / "__init__.py").write_text(reward_plugin("pip_reward"))
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "pip-plug"\nversion = "0.4.2"\n'
        '[project.entry-points.grpo_plugins]\npipplug = "pipplug_i"\n'
        '[tool.setuptools]\npackages = ["pipplug_i"]\n'
    )
    target = tmp_path / "target"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(project)],
        check=True, capture_output=True, timeout=300,
    )
    listed = run_cli("list", "--json", path=target)
    rows = [c for c in json.loads(listed.stdout)["components"] if c["name"] == "pip_reward"]
    assert [(r["distribution"], r["version"]) for r in rows] == [("pip-plug", "0.4.2")]


# -- in-process registration -------------------------------------------------------------------


@pytest.fixture
def fresh_global_registry():
    previous = set_registry(Registry(entry_points=False))
    try:
        yield get_registry()
    finally:
        set_registry(previous)


def test_decorators_register_in_the_process_wide_registry(fresh_global_registry: Registry):
    @grpo_plugins.reward("shortness")
    def shortness(prompts, completions, **kwargs):
        """Prefers short completions."""
        return [-len(c) for c in completions]

    @grpo_plugins.loss_type
    class my_loss:
        """A loss."""

    assert fresh_global_registry.get("reward", "shortness").obj is shortness
    assert fresh_global_registry.get("reward", "shortness").doc == "Prefers short completions."
    assert fresh_global_registry.get("loss_type", "my_loss").distribution == "<local>"
    grpo_plugins.register("task", "my_task", my_loss)
    assert fresh_global_registry.names("task") == ["my_task"]


def test_every_kind_has_a_decorator():
    from grpo_plugins.kinds import KINDS

    for kind in KINDS:
        assert callable(getattr(grpo_plugins, kind)), kind


def test_every_hookspec_registers_one_kind_and_is_documented():
    import inspect

    from grpo_plugins import hookspecs
    from grpo_plugins.kinds import KINDS

    specs = {name for name, fn in vars(hookspecs).items() if callable(fn) and name.startswith("register_")}
    assert specs == set(KINDS.values())
    for name in specs:
        fn = getattr(hookspecs, name)
        assert list(inspect.signature(fn).parameters) == ["register"], name
        assert inspect.getdoc(fn), name


def test_a_hook_that_raises_marks_its_plugin_broken():
    registry = Registry(entry_points=False)

    class Faulty:
        @hookimpl
        def register_rewards(self, register):
            register(lambda prompts, completions, **kw: [0.0], name="half_registered")
            raise ValueError("registration failed")

    class Fine:
        @hookimpl
        def register_loss_types(self, register):
            register(type("fine_loss", (), {}))

    registry.add_plugin(Faulty(), name="faulty", distribution="faulty-dist", version="0.1")
    registry.add_plugin(Fine(), name="fine")
    assert [(b.plugin, b.distribution, b.error) for b in registry.broken] == [
        ("faulty", "faulty-dist", "ValueError: registration failed")
    ]
    assert registry.names("reward") == []  # nothing half-registered
    assert registry.names("loss_type") == ["fine_loss"]


def test_a_hook_that_raises_in_a_joint_call_breaks_only_its_plugin():
    registry = Registry(entry_points=False)

    class Faulty:
        @hookimpl(tryfirst=True)
        def register_rewards(self, register):
            register(lambda prompts, completions, **kw: [0.0], name="half_registered")
            raise ValueError("registration failed")

    class Fine:
        @hookimpl
        def register_rewards(self, register):
            register(lambda prompts, completions, **kw: [1.0], name="fine_reward")

    registry.add_plugins({"faulty": Faulty(), "fine": Fine()}, distribution="mixed-dist")
    assert [(b.plugin, b.error) for b in registry.broken] == [("faulty", "ValueError: registration failed")]
    assert registry.names("reward") == ["fine_reward"]


def test_a_wrapper_that_raises_breaks_only_its_plugin_and_the_other_hooks_still_run():
    registry = Registry(entry_points=False)

    class RaisesBeforeYield:
        @hookimpl(wrapper=True)
        def register_rewards(self, register):
            register(lambda prompts, completions, **kw: [0.0] * len(completions), name="from_before")
            raise ValueError("before")
            yield  # noqa: unreachable - makes this a generator, as a wrapper is

    class RaisesAfterYield:
        @hookimpl(wrapper=True)
        def register_rewards(self, register):
            result = yield
            register(lambda prompts, completions, **kw: [0.0] * len(completions), name="from_after")
            raise ValueError("after")
            return result  # noqa: unreachable

    class Fine:
        @hookimpl
        def register_rewards(self, register):
            register(lambda prompts, completions, **kw: [1.0] * len(completions), name="fine_reward")

    registry.add_plugins({"before": RaisesBeforeYield(), "after": RaisesAfterYield(), "fine": Fine()})
    assert registry.names("reward") == ["fine_reward"]
    assert sorted((b.plugin, b.error) for b in registry.broken) == [
        ("after", "ValueError: after"), ("before", "ValueError: before")
    ]


def test_temporary_registration_is_undone():
    registry = Registry(entry_points=False)
    with registry.temporary("reward", "tmp_reward", lambda p, c, **k: [1.0]):
        assert registry.names("reward") == ["tmp_reward"]
    assert registry.names("reward") == []


# -- lookup and params -------------------------------------------------------------------------


class _Params(BaseModel):
    max_len: int = 100
    mode: str = "chars"


class _WithParams:
    """A component with params."""

    Params = _Params

    def __init__(self, params: _Params):
        self.params = params


def test_unknown_name_suggests_close_matches_and_lists_installed():
    registry = Registry(entry_points=False)
    registry.register("loss_type", "dapo", _WithParams)
    registry.register("loss_type", "grpo", _WithParams)
    with pytest.raises(UnknownComponentError) as info:
        registry.get("loss_type", "dapoo")
    assert "did you mean 'dapo'" in str(info.value)
    assert "Installed loss_type names: dapo, grpo." in str(info.value)


def test_params_are_validated_by_the_components_model():
    registry = Registry(entry_points=False)
    registry.register("reward", "lengthy", _WithParams)
    built = registry.build("reward", "lengthy", {"max_len": 7})
    assert built.params == _Params(max_len=7)
    with pytest.raises(ComponentParamsError) as info:
        registry.build("reward", "lengthy", {"max_len": "long", "mdoe": "words"})
    errors = dict(info.value.errors)
    assert "did you mean 'mode'" in errors["mdoe"]  # unknown keys are typos even without extra=forbid
    assert "valid integer" in errors["max_len"]


def test_component_without_params_rejects_params():
    registry = Registry(entry_points=False)
    registry.register("reward", "plain", lambda p, c, **k: [0.0] * len(c))
    with pytest.raises(ComponentParamsError, match="takes no params"):
        registry.get("reward", "plain").validate_params({"x": 1})


def test_find_searches_all_kinds():
    registry = Registry(entry_points=False)
    registry.register("reward", "same", _WithParams)
    registry.register("task", "same", _WithParams)
    assert sorted(c.kind for c in registry.find("same")) == ["reward", "task"]
    assert [c.kind for c in registry.find("same", "task")] == ["task"]


# -- packaging boundaries ------------------------------------------------------------------------


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in {
            "import_module", "__import__"
        } and node.args and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value))
    return found


def test_the_core_never_imports_the_builtin_packages():
    sources = sorted((ROOT / "grpo_plugins").rglob("*.py"))
    assert len(sources) > 5
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in _imported_modules(path) if m.split(".")[0] in {"builtin_rewards", "builtin_losses", "builtin_environments"})
        for path in sources
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_builtins_are_registered_through_the_public_entry_point_group():
    import importlib.metadata

    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="grpo_plugins") if ep.dist and ep.dist.name == "grpo-plugins"}
    assert eps.get("builtin_rewards") == "builtin_rewards"
    assert eps.get("builtin_losses") == "builtin_losses"
