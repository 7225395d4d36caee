"""The grpo-plugins command line: plan (the seed's examples), validate, show, train, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from grpo_plugins import cli
from grpo_plugins.cli import output as cli_output
from grpo_plugins.registry import Registry, set_registry
from plugin_dists import make_distribution

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("grpo-plugins")

TASK_PLUGIN = '''
from grpo_plugins import hookimpl


class CliTask:
    """A test task whose default reward is cli_reward."""

    default_rewards = ["cli_reward"]


def cli_reward(prompts, completions, **kwargs):
    """Always 1."""
    return [1.0] * len(completions)


@hookimpl
def register_tasks(register):
    register(CliTask, name="cli_task")


@hookimpl
def register_rewards(register):
    register(cli_reward)
'''

GOOD = "task: cli_task\nnum_generations: 4\nper_device_train_batch_size: 4\n"


def run(*args: str, path: Path | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_PLUGINS_") and k != "WORLD_SIZE"}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", code, *args] if code else [str(SCRIPT), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_distribution(tmp_path_factory.mktemp("site"), "cli-test-plugin", "0.0.1", {"cli_test_task_mod": TASK_PLUGIN})


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert cli.main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def steps(data: dict, cycle: int) -> list[tuple[list[int], bool]]:
    return [(s["batch"], s["optimizer_update"]) for s in data["cycles"][cycle]["steps"]]


# -- plan: the seed's examples (SPEC §5) -------------------------------------------------------

EXAMPLES = [
    (
        ["--per-device-train-batch-size", "3", "--gradient-accumulation-steps", "2", "--steps-per-generation", "4", "--num-generations", "3"],
        (12, 2, 4),
        [([0, 0, 0], False), ([1, 1, 1], True), ([2, 2, 2], False), ([3, 3, 3], True)],
        [([4, 4, 4], False), ([5, 5, 5], True), ([6, 6, 6], False), ([7, 7, 7], True)],
    ),
    (
        ["--per-device-train-batch-size", "3", "--gradient-accumulation-steps", "4", "--steps-per-generation", "4", "--num-generations", "3"],
        (12, 1, 4),
        [([0, 0, 0], False), ([1, 1, 1], False), ([2, 2, 2], False), ([3, 3, 3], True)],
        [([4, 4, 4], False), ([5, 5, 5], False), ([6, 6, 6], False), ([7, 7, 7], True)],
    ),
    (
        ["--per-device-train-batch-size", "3", "--gradient-accumulation-steps", "4", "--steps-per-generation", "4", "--num-generations", "4"],
        (12, 1, 3),
        [([0, 0, 0], False), ([0, 1, 1], False), ([1, 1, 2], False), ([2, 2, 2], True)],
        [([3, 3, 3], False), ([3, 4, 4], False), ([4, 4, 5], False), ([5, 5, 5], True)],
    ),
    (
        ["--per-device-train-batch-size", "6", "--gradient-accumulation-steps", "2", "--steps-per-generation", "2", "--num-generations", "3"],
        (12, 1, 4),
        [([0, 0, 0, 1, 1, 1], False), ([2, 2, 2, 3, 3, 3], True)],
        [([4, 4, 4, 5, 5, 5], False), ([6, 6, 6, 7, 7, 7], True)],
    ),
]


@pytest.mark.parametrize(("flags", "numbers", "cycle_a", "cycle_b"), EXAMPLES, ids=["example1", "example2", "example3", "example4"])
def test_plan_json_reproduces_the_seed_examples(capsys, flags, numbers, cycle_a, cycle_b):
    data = plan_json(capsys, *flags)
    assert (data["effective_batch_size"], data["optimizer_steps_per_generation"], data["unique_prompts"]) == numbers
    assert len(data["cycles"]) == 2
    assert steps(data, 0) == cycle_a
    assert steps(data, 1) == cycle_b
    assert [s["step"] for s in data["cycles"][0]["steps"]] == list(range(len(cycle_a)))
    assert set(data["cycles"][0]["steps"][0]) == {"step", "batch", "optimizer_update"}


def test_plan_console_script_prints_the_spec_json():
    result = run("plan", *EXAMPLES[2][0], "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert steps(data, 0) == EXAMPLES[2][2] and steps(data, 1) == EXAMPLES[2][3]


def test_plan_with_iterations_and_two_processes(capsys):
    flags = ["--per-device-train-batch-size", "3", "--gradient-accumulation-steps", "2", "--steps-per-generation", "4",
             "--num-generations", "3", "--num-processes", "2", "--num-iterations", "2", "--cycles", "1"]
    data = plan_json(capsys, *flags)
    assert (data["effective_batch_size"], data["optimizer_steps_per_generation"], data["unique_prompts"]) == (24, 4, 8)
    one_pass = [([0, 0, 0], False), ([1, 1, 1], True), ([2, 2, 2], False), ([3, 3, 3], True)]
    assert steps(data, 0) == one_pass + one_pass
    data = plan_json(capsys, *flags, "--process", "1")
    assert [b for b, _ in steps(data, 0)][:4] == [[4, 4, 4], [5, 5, 5], [6, 6, 6], [7, 7, 7]]


def test_plan_table_reads_like_the_seed(capsys):
    assert cli.main(["plan", *EXAMPLES[2][0], "--cycles", "2"]) == 0
    out = capsys.readouterr().out
    assert "Generation cycle A" in out and "Generation cycle B" in out
    assert "= 4 * 1 * 3 = 12" in out and "= 12 / 4 = 3" in out
    rows = [line for line in out.splitlines() if "[1,1,2]" in line]
    assert len(rows) == 1 and "optimizer update" not in rows[0]
    assert any("[2,2,2]" in line and "optimizer update" in line for line in out.splitlines())


def test_plan_from_a_config_file_with_flag_overrides(tmp_path: Path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("per_device_train_batch_size: 3\ngradient_accumulation_steps: 4\nnum_generations: 3\n")
    assert plan_json(capsys, str(config), "--cycles", "1")["unique_prompts"] == 4
    data = plan_json(capsys, str(config), "--num-generations", "4", "--cycles", "1")
    assert steps(data, 0)[1] == ([0, 1, 1], False)
    data = plan_json(capsys, str(config), "--set", "generation_batch_size=6", "--gradient-accumulation-steps", "2")
    assert data["effective_batch_size"] == 6


def test_plan_errors_are_one_line_with_exit_2():
    result = run("plan", "--per-device-train-batch-size", "3", "--gradient-accumulation-steps", "4", "--num-generations", "5")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "num_generations (5)" in lines[0]
    assert "Traceback" not in result.stderr


def test_plan_warns_at_two_generations(capsys):
    assert cli.main(["plan", "--num-generations", "2", "--per-device-train-batch-size", "2", "--cycles", "1"]) == 0
    assert "warning: num_generations is 2" in capsys.readouterr().err


def test_our_warning_prints_once_per_command_even_after_a_catch_warnings_block(capsys, monkeypatch):
    import warnings

    from grpo_plugins.batching import BatchPlanWarning

    monkeypatch.setattr(warnings, "showwarning", cli._warnings_printer(warnings.showwarning))

    def plan_twice():  # the config check, then the run's own plan, with a library's block between
        for _ in range(2):
            warnings.warn("num_generations is 2: noisy", BatchPlanWarning, stacklevel=1)
            with warnings.catch_warnings():  # leaving it resets Python's once-per-place memory
                warnings.simplefilter("ignore")
        warnings.warn("another one", BatchPlanWarning, stacklevel=1)

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        plan_twice()
    err = capsys.readouterr().err
    assert err.count("num_generations is 2: noisy") == 1 and err.count("another one") == 1


# -- validate ------------------------------------------------------------------------------------

PROBE = """
import json, sys, time
start = time.perf_counter()
from grpo_plugins.cli import main
code = main(sys.argv[1:])
elapsed = time.perf_counter() - start
heavy = sorted(m for m in ("torch", "transformers", "datasets", "accelerate", "peft") if m in sys.modules)
print(json.dumps({"code": code, "seconds": elapsed, "heavy": heavy}))
"""


def test_validate_is_fast_and_never_imports_torch(tmp_path: Path, site: Path):
    config = tmp_path / "run.yaml"
    config.write_text(GOOD)
    timings = []
    for _ in range(2):  # the first run may compile bytecode
        result = run("validate", str(config), path=site, code=PROBE)
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["code"] == 0, result.stdout
        assert report["heavy"] == [], "validate must not import these"
        timings.append(report["seconds"])
    # Well under 1 s on an idle machine; the bound leaves room for a busy shared CI box.
    assert min(timings) < 1.5, timings


def test_the_spec_minimal_config_validates_with_the_installed_plugins(tmp_path: Path):
    from test_config import MINIMAL

    config = tmp_path / "minimal.yaml"
    config.write_text(MINIMAL)
    result = run("validate", str(config), code=PROBE)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) | {"seconds": 0} == {"code": 0, "seconds": 0, "heavy": []}
    assert "rewards: correct_answer x 1, format x 0.5" in result.stdout


def test_validate_reports_what_it_checked(tmp_path: Path, site: Path):
    config = tmp_path / "run.yaml"
    config.write_text(GOOD)
    result = run("validate", str(config), "--set", "loss_type=grpo", path=site)
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout
    assert "task: cli_task (cli-test-plugin)" in result.stdout
    assert "loss_type: grpo (grpo-plugins)" in result.stdout
    assert "rewards (task cli_task's defaults): cli_reward" in result.stdout


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ("learning_rte: 0.1\n", "learning_rte: unknown key 'learning_rte'; did you mean 'learning_rate'?"),
        ("loss_type: dapoo\n", "loss_type: unknown loss_type 'dapoo'; did you mean 'dapo'"),
        ("top_p: 0\n", "top_p: Input should be greater than 0"),
        ("min_p: 2\n", "min_p: Input should be less than or equal to 1"),
        ("steps_per_generation: 2\ngeneration_batch_size: 12\n", "generation_batch_size: steps_per_generation and generation_batch_size are mutually exclusive"),
        ("gradient_accumulation_steps: 3\nsteps_per_generation: 4\n", "gradient_accumulation_steps: gradient_accumulation_steps (3) must divide"),
        ("rewards: [cli_reward, nope_reward]\n", "rewards.1: unknown reward 'nope_reward'"),
    ],
)
def test_validate_rejects_malformed_configs_without_a_traceback(tmp_path: Path, site: Path, extra: str, says: str):
    config = tmp_path / "bad.yaml"
    config.write_text(GOOD + extra)
    result = run("validate", str(config), path=site)
    assert result.returncode == 2
    assert says in result.stderr
    assert "Traceback" not in result.stderr


def test_validate_lists_every_independent_problem_in_one_pass(tmp_path: Path, capsys):
    """An unknown key and a TRL refusal no longer hide the component, param and batch problems."""
    config = tmp_path / "typos.yaml"
    config.write_text(
        "task: arithmetic\nlearnin_rate: 1e-5\npush_to_hub: true\nloss_type: dapoo\n"
        "rewards:\n  - {name: length, params: {maxlen: 3}}\nnum_generations: 3\nper_device_train_batch_size: 8\n"
    )
    assert cli.main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert "5 problems" in err
    paths = [line.split(":")[0].strip() for line in err.splitlines()[1:]]
    assert paths == ["push_to_hub", "learnin_rate", "loss_type", "rewards.0.params.maxlen", "num_generations"]


def test_validate_skips_the_batch_check_of_an_invalid_batch_key(tmp_path: Path, capsys):
    """A bad per_device_train_batch_size is reported; the batch arithmetic of its default is not."""
    config = tmp_path / "run.yaml"
    config.write_text("task: arithmetic\nper_device_train_batch_size: eight\nnum_generations: 3\nloss_type: nope\n")
    assert cli.main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert "per_device_train_batch_size:" in err and "loss_type: unknown loss_type 'nope'" in err
    assert "not divisible" not in err


def test_validate_checks_the_prompt_column_of_a_local_dataset(tmp_path: Path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    config = tmp_path / "run.yaml"
    config.write_text(f"dataset: {{path: json, data_files: {data}}}\nrewards: [correct_answer]\nloss_type: dapoo\n")
    assert cli.main(["validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert (
        f"dataset.prompt_column: dataset 'json' ({data}) has no column 'prompt' (its columns: question, answer); "
        "set dataset.prompt_column: question"
    ) in err
    assert "loss_type: unknown loss_type 'dapoo'" in err  # in the same pass
    # Named, it validates, and the summary names the data rather than the unused task.
    assert cli.main(["validate", str(config), "--set", "dataset.prompt_column=question", "--set", "loss_type=dapo"]) == 0
    out = capsys.readouterr().out
    assert f"data: dataset 'json' ({data}), prompt column 'question'" in out
    assert "task: arithmetic" not in out


def test_validate_checks_the_eval_datasets_prompt_column(tmp_path: Path, capsys):
    data = tmp_path / "eval.jsonl"
    data.write_text('{"text": "1+1?"}\n')
    config = tmp_path / "run.yaml"
    config.write_text(f"eval_dataset: {{path: json, data_files: {data}}}\n")
    assert cli.main(["validate", str(config)]) == 2
    assert "eval_dataset.prompt_column: dataset 'json'" in capsys.readouterr().err


def test_validate_bad_yaml_and_missing_file(tmp_path: Path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("beta: [0.1\n")
    assert cli.main(["validate", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert cli.main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read the config file" in capsys.readouterr().err


# -- list / show ---------------------------------------------------------------------------------


@pytest.fixture
def registry():
    reg = Registry(entry_points=False)

    from pydantic import BaseModel, Field

    class Params(BaseModel):
        max_len: int = Field(100, ge=1, description="Longest completion that scores 1.")

    class Short:
        """Scores short completions.

        Longer explanation.
        """

        def __init__(self, params: Params):
            self.params = params

    Short.Params = Params
    reg.register("reward", "short", Short)
    reg.register("loss_type", "short", type("ShortLoss", (), {"__doc__": "A loss."}))
    previous = set_registry(reg)
    try:
        yield reg
    finally:
        set_registry(previous)


def test_show_prints_docs_and_params(registry, capsys):
    assert cli.main(["show", "short", "--kind", "reward"]) == 0
    out = capsys.readouterr().out
    assert "reward short" in out and "Longer explanation." in out
    assert "max_len" in out and "int >= 1" in out and "100" in out and "Longest completion that scores 1." in out
    assert cli.main(["show", "short", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted(d["kind"] for d in data) == ["loss_type", "reward"]


def test_show_unknown_name_suggests(registry, capsys):
    assert cli.main(["show", "shrt"]) == 2
    assert "did you mean 'short'" in capsys.readouterr().err


def test_list_kind_filter(registry, capsys):
    assert cli.main(["list", "--kind", "loss_type", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(c["kind"], c["name"], c["doc"]) for c in data["components"]] == [("loss_type", "short", "A loss.")]


# -- train ----------------------------------------------------------------------------------------


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch):
    calls = []
    module = types.ModuleType("grpo_plugins.engine")

    def run_training(config, *, resume=None):
        calls.append((config, resume))
        return types.SimpleNamespace(output_dir=config.output_dir)

    module.run_training = run_training
    monkeypatch.setitem(sys.modules, "grpo_plugins.engine", module)
    return calls


@pytest.fixture
def train_registry():
    reg = Registry(entry_points=False)
    for kind, name in [("task", "t"), ("reward", "r"), ("loss_type", "dapo"), ("importance_sampling", "token"),
                       ("reward_scaling", "group"), ("rollout_correction", "token_truncate"), ("generator", "transformers"),
                       ("environment", "single_turn")]:
        reg.register(kind, name, type(name, (), {"default_rewards": ["r"]}))
    previous = set_registry(reg)
    try:
        yield reg
    finally:
        set_registry(previous)


def test_train_validates_and_calls_the_engine(tmp_path: Path, fake_engine, train_registry, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("task: t\nnum_generations: 4\nper_device_train_batch_size: 4\n")
    assert cli.main(["train", str(config), "--set", f"output_dir={tmp_path / 'out'}"]) == 0
    assert cli.main(["train", str(config), "--resume"]) == 0
    assert cli.main(["train", str(config), "--resume", str(tmp_path / "ckpt")]) == 0
    assert [resume for _, resume in fake_engine] == [None, True, str(tmp_path / "ckpt")]
    assert fake_engine[0][0].output_dir == str(tmp_path / "out")
    assert "done" in capsys.readouterr().out
    assert cli.main(["train", str(config), "--set", "num_generations=3"]) == 2  # invalid: no engine call
    assert len(fake_engine) == 3


def _engine_returning(monkeypatch: pytest.MonkeyPatch, outcome) -> None:
    module = types.ModuleType("grpo_plugins.engine")
    module.run_training = lambda config, *, resume=None: outcome(config)
    monkeypatch.setitem(sys.modules, "grpo_plugins.engine", module)


def test_train_ends_with_a_summary_of_the_run(tmp_path: Path, train_registry, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    # 8 logged steps: the first quarter is steps 1-2, the last steps 7-8.
    (out / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward": s / 10, "rewards/r/mean": s / 20, "completions/mean_length": 40.0 - s}) + "\n"
        for s in range(1, 9)
    ))
    checkpoint = out / "checkpoints" / "checkpoint-8"

    def finished(config):
        return types.SimpleNamespace(output_dir=out, global_step=8, checkpoint=checkpoint, history=[])

    _engine_returning(monkeypatch, finished)
    config = tmp_path / "run.yaml"
    config.write_text("task: t\nnum_generations: 4\nper_device_train_batch_size: 4\n")
    assert cli.main(["train", str(config), "--set", f"output_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert "done: 8 steps in 0:00:0" in text
    assert "first quarter (steps 1-2)" in text and "last quarter (steps 7-8)" in text
    rows = {line.split()[0]: line.split()[-2:] for line in text.splitlines() if line.strip()}
    assert rows["reward"] == ["0.150", "0.750"]
    assert rows["r"] == ["0.075", "0.375"]
    assert rows["completion"] == ["38.5", "32.5"]
    assert f"checkpoint: {checkpoint}" in text and f"metrics: {out / 'metrics.jsonl'}" in text
    assert f"grpo-plugins eval {config} --set output_dir={out}" in text
    assert f"grpo-plugins report {out}" in text and f"grpo-plugins export {out} --out {out / 'exported'}" in text


def test_ctrl_c_names_the_checkpoint_and_the_resume_command(tmp_path: Path, train_registry, monkeypatch, capsys):
    from grpo_plugins.engine import TrainingInterrupted

    config = tmp_path / "run.yaml"
    config.write_text("task: t\nnum_generations: 4\nper_device_train_batch_size: 4\n")
    saved = tmp_path / "out" / "checkpoints" / "checkpoint-7"

    def stopped(config):
        raise TrainingInterrupted(7, saved, saved_now=True)

    _engine_returning(monkeypatch, stopped)
    assert cli.main(["train", str(config), "--set", f"output_dir={tmp_path / 'out'}"]) == 130
    err = capsys.readouterr().err
    assert f"interrupted at step 7: saved {saved}" in err
    assert f"continue with: grpo-plugins train {config} --set output_dir={tmp_path / 'out'} --resume" in err

    older = tmp_path / "out" / "checkpoints" / "checkpoint-5"

    def stopped_at_once(config):
        raise TrainingInterrupted(7, older, saved_now=False)  # Ctrl-C twice: nothing saved at the stop

    _engine_returning(monkeypatch, stopped_at_once)
    assert cli.main(["train", str(config)]) == 130
    err = capsys.readouterr().err
    assert f"the last checkpoint is {older}; steps 6-7 are not in it and will be trained again" in err
    assert "--resume" in err


# -- error handling --------------------------------------------------------------------------------


def test_set_with_a_space_shows_the_one_argument_spelling(capsys):
    assert cli.main(["validate", "run.yaml", "--set", "learning_rate", "1e-5"]) == 2
    assert capsys.readouterr().err.strip() == "error: --set takes KEY=VALUE as one argument: write --set learning_rate=1e-5"
    assert cli.main(["train", "run.yaml", "--set", "max_steps"]) == 2
    assert "write --set max_steps=VALUE" in capsys.readouterr().err


def test_debug_shows_the_traceback():
    from grpo_plugins.batching import BatchPlanError

    with pytest.raises(BatchPlanError):
        cli.main(["--debug", "plan", "--num-generations", "5", "--per-device-train-batch-size", "3"])
    with pytest.raises(BatchPlanError):  # also after the command
        cli.main(["plan", "--num-generations", "5", "--per-device-train-batch-size", "3", "--debug"])


def test_interrupt_exits_130(monkeypatch: pytest.MonkeyPatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_plan", interrupted)
    assert cli.main(["plan"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_unexpected_errors_are_one_line_too(monkeypatch: pytest.MonkeyPatch, capsys):
    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_plan", broken)
    assert cli.main(["plan"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: a bug" in err and "--debug" in err and "Traceback" not in err


def test_config_reference_check(tmp_path: Path, capsys):
    assert cli.main(["config-reference", "--check", "--output", str(ROOT / "docs" / "config.md")]) == 0
    stale = tmp_path / "config.md"
    stale.write_text("old")
    assert cli.main(["config-reference", "--check", "--output", str(stale)]) == 2
    assert cli.main(["config-reference", "--output", str(stale)]) == 0
    assert stale.read_text() == cli.render_config_reference()


def test_the_commands_in_docs_cli_md_run(capsys):
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    shown = [line.removeprefix("$ ").split()[1:] for line in text.splitlines() if line.startswith("$ grpo-plugins plan")]
    assert shown
    for argv in shown:
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "[1,1,2]" in out  # the example's output as the doc shows it


def test_train_shows_the_runs_own_info_notes_on_stderr(capsys) -> None:
    import logging

    log = logging.getLogger("grpo_plugins")
    saved = (list(log.handlers), log.level)
    try:
        cli_output._show_info_logs()
        logging.getLogger("grpo_plugins.models").info("converting x into a trainable checkpoint")
        logging.getLogger("transformers.other").info("not ours")
        assert capsys.readouterr().err.splitlines()[-1] == "grpo-plugins: converting x into a trainable checkpoint"
    finally:
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])


def _log_bitsandbytes_noise(args: object) -> int:
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
        "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", "no kernels"
    )
    logging.getLogger("bitsandbytes.backends.cpu.ops").warning("another bitsandbytes warning")
    return 0


@pytest.mark.parametrize("debug", [False, True])
def test_known_third_party_noise_is_dropped_unless_debug(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, debug: bool
) -> None:
    """bitsandbytes' missing-kernel line (peft imports it on every run) is not shown; its other
    warnings are, and --debug shows everything. The filter does not outlive the command."""
    import logging

    monkeypatch.setattr(cli, "cmd_list", _log_bitsandbytes_noise)
    caplog.set_level(logging.WARNING)
    assert cli.main((["--debug"] if debug else []) + ["list"]) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert "another bitsandbytes warning" in messages
    assert any(m.startswith("Failed to load CPU gemm_4bit_forward") for m in messages) is debug
    assert logging.getLogger("bitsandbytes.backends.cpu.ops").filters == []
