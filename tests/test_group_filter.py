"""Dynamic sampling (DAPO): the group_filter kind, its built-ins, the refill rounds of the engine,
the plan's accounting, the loss normaliser over kept tokens, and resuming in a refill."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

PROMPTS = [{"prompt": p} for p in ["ab", "zc", "ef", "zg", "zi", "zk", "mn", "zp", "qr", "zs", "uv", "zw"]]
VOLATILE = ("timing/", "tokens_per_second", "peak_memory_gb")


def spread(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """Constant 1.0 for prompts starting with 'z' (a zero-std group), else varies with the text."""
    return [1.0 if p.startswith("z") else float(sum(map(ord, c)) % 7) for p, c in zip(prompts, completions)]


def _config(tiny_model: dict, output_dir: Path, **overrides: Any) -> dict[str, Any]:
    base = {
        "model": tiny_model,
        "task": None,
        "output_dir": str(output_dir),
        "max_steps": 4,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_generation": 2,  # on-policy: one optimizer step per cycle
        "num_generations": 4,  # 8 completions = 2 groups per round
        "max_completion_length": 6,
        "learning_rate": 1e-2,
        "report_to": ["jsonl"],
        "seed": 1,
        "group_filter": "drop_zero_std",
        "max_refill_rounds": 1,
    }
    base.update(overrides)
    return base


# -- the built-in filters ---------------------------------------------------------------------------

NAN = float("nan")
# Five groups of 4 (one reward): all 0, mixed, all 1, one scorable row, none scorable.
TABLE = [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, NAN, 1.0, NAN, NAN, NAN, NAN, NAN, NAN]


def _keep(name: str, params: dict[str, Any] | None = None, table: list[list[float]] | None = None) -> list[bool]:
    import torch

    from grpo_plugins.advantages import combine_rewards
    from grpo_plugins.registry import get_registry

    rewards = torch.tensor(table if table is not None else [[v] for v in TABLE], dtype=torch.float64)
    built = get_registry().build("group_filter", name, params)
    return built.keep(rewards, combine_rewards(rewards), ["a", "b"][: rewards.shape[1]], 4).tolist()


def test_keep_all_keeps_every_group_and_never_drops() -> None:
    from grpo_plugins.registry import get_registry

    assert _keep("keep_all") == [True] * 5
    assert get_registry().get("group_filter", "keep_all").obj.drops_groups is False


def test_drop_zero_std_keeps_only_groups_with_spread() -> None:
    assert _keep("drop_zero_std") == [False, True, False, False, False]
    # The mixed group's std is sqrt(1/3) = 0.577: min_std above it drops it too.
    assert _keep("drop_zero_std", {"min_std": 0.5}) == [False, True, False, False, False]
    assert _keep("drop_zero_std", {"min_std": 0.6}) == [False] * 5


def test_accuracy_band_is_open_by_default_and_closed_when_inclusive() -> None:
    # group means: 0, 0.5, 1, 1 (one scorable row), none
    assert _keep("accuracy_band") == [False, True, False, False, False]
    assert _keep("accuracy_band", {"low": 0.5, "high": 1.0, "inclusive": True}) == [False, True, True, True, False]
    assert _keep("accuracy_band", {"low": 0.0, "high": 0.5, "inclusive": True}) == [True, True, False, False, False]


def test_accuracy_band_reads_the_named_reward() -> None:
    # reward "b" is all right in group 0 and half right in group 1; the total says otherwise.
    table = [[0.0, 1.0]] * 4 + [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]]
    assert _keep("accuracy_band", {"reward": "b"}, table) == [False, True]
    assert _keep("accuracy_band", {"reward": "a"}, table) == [False, False]


def test_accuracy_band_names_an_unknown_reward_in_validate_and_in_the_run() -> None:
    import torch

    from grpo_plugins.config import ConfigError, load_config
    from grpo_plugins.dynamic_sampling import filter_groups
    from grpo_plugins.errors import TrainingError
    from grpo_plugins.registry import get_registry
    from grpo_plugins.validation import validate_config

    config = load_config({"task": "arithmetic", "group_filter": {"name": "accuracy_band", "params": {"reward": "correct"}}})
    with pytest.raises(ConfigError) as raised:
        validate_config(config)
    assert raised.value.errors == [(
        "group_filter.params",
        "group_filter accuracy_band: reward 'correct' is not a reward of this run (correct_answer, format); "
        "set group_filter.params.reward to one of them",
    )]
    validate_config(load_config({**config.model_dump(exclude_unset=True),
                                 "group_filter": {"name": "accuracy_band", "params": {"reward": "correct_answer"}}}))
    built = get_registry().build("group_filter", "accuracy_band", {"reward": "acc"})
    with pytest.raises(TrainingError, match="reward 'acc' is not a reward of this run \\(a\\)"):
        filter_groups(built, "accuracy_band", torch.zeros(8, 1), [1.0], ["a"], 4)


def test_accuracy_band_rejects_a_band_upside_down() -> None:
    from grpo_plugins.config import ConfigError, load_config
    from grpo_plugins.validation import validate_config

    config = load_config({"group_filter": {"name": "accuracy_band", "params": {"low": 0.8, "high": 0.2}}})
    with pytest.raises(ConfigError, match=r"group_filter\.params.*low \(0\.8\) must not be above high \(0\.2\)"):
        validate_config(config)


def test_a_filter_with_the_wrong_output_fails_the_contract_check_and_the_run() -> None:
    import torch

    from grpo_plugins.dynamic_sampling import filter_groups
    from grpo_plugins.errors import TrainingError
    from grpo_plugins.testing import ComponentContractError, check_component

    class PerRow:
        def keep(self, rewards, total, names, num_generations):
            return total > 0  # one per completion, not per group

    class Liar:
        drops_groups = False

        def keep(self, rewards, total, names, num_generations):
            return torch.zeros(total.shape[0] // num_generations, dtype=torch.bool)

    with pytest.raises(ComponentContractError, match=r"keep must return a \(N/G,\) bool tensor, here \(3,\); got \(9,\)"):
        check_component("group_filter", PerRow, name="per_row")
    with pytest.raises(ComponentContractError, match="drops_groups is False but keep dropped groups"):
        check_component("group_filter", Liar, name="liar")
    with pytest.raises(TrainingError, match=r"group_filter 'per_row': keep must return a \(2,\) bool tensor"):
        filter_groups(PerRow(), "per_row", torch.ones(8, 1), [1.0], ["a"], 4)


# -- plan and validate ----------------------------------------------------------------------------


def test_plan_accounts_for_refill_rounds() -> None:
    from grpo_plugins.batching import plan_from_config
    from grpo_plugins.config import load_config

    settings = {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 2, "steps_per_generation": 4,
                "num_generations": 3}
    plain = plan_from_config(load_config(settings), 1)
    assert plain.group_filter is None and plain.max_generations_per_cycle == 12
    assert "generations_per_cycle" not in plain.to_json()  # keep_all: the plan is as before

    plan = plan_from_config(load_config({**settings, "group_filter": "drop_zero_std", "max_refill_rounds": 3}), 1)
    data = plan.to_json(cycles=1)
    assert data["group_filter"] == "drop_zero_std" and data["max_refill_rounds"] == 3
    assert data["generations_per_cycle"] == {"min": 12, "max": 48}
    assert data["prompts_per_cycle"] == {"min": 4, "max": 16}
    assert [s["batch"] for s in data["cycles"][0]["steps"]] == [[0, 0, 0], [1, 1, 1], [2, 2, 2], [3, 3, 3]]


def test_plan_and_validate_commands_show_the_cost(tmp_path: Path) -> None:
    from grpo_plugins.cli import main

    config = tmp_path / "c.yaml"
    config.write_text("task: arithmetic\ngroup_filter: accuracy_band\nmax_refill_rounds: 2\nnum_generations: 4\n"
                      "per_device_train_batch_size: 4\ngradient_accumulation_steps: 2\n")
    out = subprocess.run([sys.executable, "-m", "grpo_plugins.cli", "plan", str(config), "--cycles", "1"],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "max_generations_per_cycle      = effective_batch_size * (1 + max_refill_rounds) = 8 * (1 + 2) = 24" in out.stdout
    assert "a cycle generates 8 to 24 completions (2 to 6 prompts) for its 1 optimizer step(s)" in out.stdout
    out = subprocess.run([sys.executable, "-m", "grpo_plugins.cli", "validate", str(config)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "dynamic sampling: group_filter accuracy_band, up to 2 refill round(s): 8 to 24 completions per generation" in out.stdout
    assert main is not None


def test_an_unknown_group_filter_is_one_clear_problem(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("task: arithmetic\ngroup_filter: drop_zero_sdt\n")
    out = subprocess.run([sys.executable, "-m", "grpo_plugins.cli", "validate", str(config)],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert out.stderr.count("unknown group_filter 'drop_zero_sdt'") == 1, out.stderr  # reported once
    assert "did you mean 'drop_zero_std'?" in out.stderr
    assert "Traceback" not in out.stderr


# -- the engine -----------------------------------------------------------------------------------


class Recorder:
    """The ``spread`` reward, recording each call (one call = one generation round here)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[int], list[float]]] = []  # prompts, lengths, rewards
        self.__name__ = "spread"

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kw: Any) -> list[float]:
        rewards = spread(prompts, completions)
        self.calls.append((list(prompts), [len(ids) for ids in completion_ids], rewards))
        return rewards


def _std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _simulate(calls: list[tuple[list[str], list[int], list[float]]], cycles: int, U: int, G: int, R: int) -> list[dict[str, Any]]:
    """Re-derive each cycle's kept groups from the recorded rounds (drop_zero_std)."""
    out, it = [], iter(calls)
    for _ in range(cycles):
        kept, rounds, dropped = [], 0, 0
        for _ in range(R + 1):
            prompts, lengths, rewards = next(it)
            rounds += 1
            for g in range(U):
                rows = slice(g * G, (g + 1) * G)
                if _std(rewards[rows]) > 1e-8:
                    kept.append((prompts[g * G], lengths[rows], rewards[rows]))
                else:
                    dropped += 1
            if len(kept) >= U:
                break
        out.append({"kept": kept[:U], "rounds": rounds, "dropped": dropped})
    assert next(it, None) is None  # every recorded round is accounted for
    return out


def _expected_loss(kept: list[tuple[str, list[int], list[float]]]) -> float:
    """dapo, on-policy (ratio 1): -sum_i A_i * len_i / kept tokens, A by group std (+1e-4)."""
    num = 0.0
    for _, lengths, rewards in kept:
        mean, std = sum(rewards) / len(rewards), _std(rewards)
        num += sum(-(r - mean) / (std + 1e-4) * n for r, n in zip(rewards, lengths))
    return num / sum(sum(lengths) for _, lengths, _ in kept)


def test_drop_zero_std_refills_and_the_normaliser_counts_kept_tokens(tiny_model: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import grpo_plugins.objective
    from grpo_plugins.engine import Engine
    from grpo_plugins.prompts import PromptStream

    seen: list[float] = []
    original = grpo_plugins.objective.compute_loss

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(float(kwargs["num_items_in_batch"]))
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo_plugins.objective, "compute_loss", recording)
    reward = Recorder()
    # One training pass (one compute_loss call) per micro-step: group_by_length would split a
    # micro-step whose lengths differ into passes.
    engine = Engine(_config(tiny_model, tmp_path / "out", group_by_length=False), rewards=[reward], dataset=PROMPTS)
    result = engine.train()

    cycles = _simulate(reward.calls, cycles=4, U=2, G=4, R=1)
    # The seed gives refills and a cycle where the cap is hit; both paths are exercised.
    assert any(c["rounds"] == 2 and len(c["kept"]) == 2 for c in cycles)
    assert any(len(c["kept"]) < 2 for c in cycles)
    stream = PromptStream(len(PROMPTS), 1)
    for n, (cycle, record) in enumerate(zip(cycles, result.history)):
        rows = [t["batch"] for t in engine.trace if t["cycle"] == n]
        trained = [PROMPTS[stream.row(i)]["prompt"] if i >= 0 else None for b in rows for i in b]
        expected = [p for p, _, _ in cycle["kept"] for _ in range(4)]
        assert trained == expected + [None] * (8 - len(expected))  # empty slots at the end
        assert record["group_filter/rounds"] == cycle["rounds"]
        assert record["group_filter/extra_generations"] == 8 * (cycle["rounds"] - 1)
        assert record["group_filter/groups_dropped"] == cycle["dropped"]
        assert record["group_filter/filtered_fraction"] == cycle["dropped"] / (2 * cycle["rounds"])
        assert record["group_filter/cap_hit"] == (1.0 if len(cycle["kept"]) < 2 else 0.0)
        assert record["frac_reward_zero_std"] == 0.0  # the trained batch: only groups with spread
        kept_tokens = sum(sum(lengths) for _, lengths, _ in cycle["kept"])
        assert seen[2 * n] == seen[2 * n + 1] == kept_tokens  # both micro-steps of the window
        if cycle["kept"]:
            assert record["loss"] == pytest.approx(_expected_loss(cycle["kept"]), rel=1e-5, abs=1e-7)
    generated = [r["group_filter/generated_frac_reward_zero_std"] for r in result.history]
    assert max(generated) > 0.0  # what was generated did have zero-std groups


def test_keep_all_takes_the_plain_path(tiny_model: dict, tmp_path: Path) -> None:
    from grpo_plugins.batching import make_plan
    from grpo_plugins.engine import Engine

    engine = Engine(_config(tiny_model, tmp_path / "out", group_filter="keep_all", max_steps=2), rewards=[spread],
                    dataset=PROMPTS)
    result = engine.train()
    assert not any(k.startswith("group_filter/") for r in result.history for k in r)
    plan = make_plan(4, 2, 4, steps_per_generation=2)
    assert [t["batch"] for t in engine.trace] == [s.batch for c in range(2) for s in plan.cycle(c)]
    assert result.history[0]["frac_reward_zero_std"] > 0  # nothing was filtered


# -- resume in the middle of a refill -------------------------------------------------------------


def _train(config: Path, *, resume: bool, kill: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GROUP_FILTER_KILL"}
    env["OMP_NUM_THREADS"] = "1"
    if kill is not None:
        env["GROUP_FILTER_KILL"] = str(kill)
    args = [sys.executable, __file__, str(config)] + (["--resume"] if resume else [])
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_killed_in_a_refill_and_resumed_equals_an_uninterrupted_run(tiny_model: dict, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from grpo_plugins.checkpoint import latest_checkpoint
    from grpo_plugins.metrics import read_metrics

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for name, out in (("straight", straight), ("killed", killed)):
        # Two optimizer steps per cycle and a checkpoint after each: checkpoints inside a cycle too.
        config = _config(tiny_model, out, max_steps=6, gradient_accumulation_steps=1, save_steps=1,
                         save_total_limit=None, logging_steps=1, max_refill_rounds=2)
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
    run = _train(tmp_path / "straight.json", resume=False)
    assert run.returncode == 0, run.stderr[-3000:]
    records = read_metrics(straight)
    rounds = [int(r["group_filter/rounds"]) for r in records[::2]]  # one record per step, two steps per cycle
    # The generate call to kill at: the first refill round after cycle 0 (a checkpoint exists then).
    calls_before = [sum(rounds[:c]) for c in range(len(rounds))]
    cycle = next(c for c in range(1, len(rounds)) if rounds[c] > 1)
    kill_at = calls_before[cycle] + 2  # the cycle's second round

    run = _train(tmp_path / "killed.json", resume=False, kill=kill_at)
    assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
    assert latest_checkpoint(killed).name == f"checkpoint-{2 * cycle}"
    run = _train(tmp_path / "killed.json", resume=True)
    assert run.returncode == 0, run.stderr[-3000:]

    a = load_file(str(straight / "checkpoints" / "checkpoint-6" / "model" / "model.safetensors"))
    b = load_file(str(killed / "checkpoints" / "checkpoint-6" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    stable = lambda rs: [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rs]  # noqa: E731
    assert stable(read_metrics(straight)) == stable(read_metrics(killed))
    state = json.loads((killed / "checkpoints" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["next_prompt"] == 2 * sum(rounds)  # every round consumed unique_prompts = 2 prompts


if __name__ == "__main__":  # the training subprocess: CONFIG.json [--resume]
    from grpo_plugins.engine import Engine

    if os.environ.get("GROUP_FILTER_KILL"):
        sys.path.insert(0, str(Path(__file__).parent))
        from kill_points import install_kill

        install_kill(f"generate:{os.environ['GROUP_FILTER_KILL']}")
    config = json.loads(Path(sys.argv[1]).read_text())
    Engine(config, rewards=[spread], dataset=PROMPTS).train(resume=True if "--resume" in sys.argv[2:] else None)


def test_dynamic_sampling_and_evaluation_import_nothing_of_the_rollout_pipeline() -> None:
    # The pipeline uses dynamic sampling, not the other way round (refill gets narrow inputs),
    # and evaluation shares the scorer, not the pipeline: no import of it anywhere in them.
    import ast

    import grpo_plugins.dynamic_sampling
    import grpo_plugins.evaluation

    for module in (grpo_plugins.dynamic_sampling, grpo_plugins.evaluation):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not imported & {"grpo_plugins.rollout", "grpo_plugins.engine"}, module.__name__
