"""RewardRunner and resolve_reward: the TRL contract, concurrency, timeouts, failures.

torch is imported inside the tests only: the worker process of ``executor: process`` rewards
imports this module to find them, and should start quickly.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from pathlib import Path

import pytest

import grpo_plugins
from grpo_plugins.config import GRPOConfig, RewardSpec
from grpo_plugins.registry import UnknownComponentError
from grpo_plugins.rewards import (
    RewardConfigError,
    RewardError,
    RewardRunner,
    resolve_reward,
    reward_specs_for,
)
from grpo_plugins.testing import isolated_registry

PROMPTS = ["What is 1+1?", "What is 2+2?", "What is 3+3?", "What is 4+4?"]
COMPLETIONS = [r"\boxed{2}", r"it is \boxed{5}", "no idea", r"\boxed{8}"]
COLUMNS = {"ground_truth": ["2", "4", "6", "8"]}


# -- rewards written exactly as the TRL documentation writes them --------------------------------


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def only_boxed(completions, **kwargs):
    """None ('not applicable') for completions without a box."""
    return [1.0 if "boxed" in c else None for c in completions]


async def async_reward(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [float(len(c)) for c in completions]


def uses_ids_and_state(prompts, completions, completion_ids, trainer_state, **kwargs):
    return [float(len(ids) + trainer_state.global_step) for ids in completion_ids]


def cpu_heavy(completions, **kwargs):
    """Module level, so it can run in a worker process; reports which process ran it."""
    return [float(os.getpid())] * len(completions)


def sleepy(completions, **kwargs):
    time.sleep(30)
    return [0.0] * len(completions)


@pytest.fixture()
def registry():
    with isolated_registry() as reg:
        yield reg


def run(rewards, registry, *, prompts=PROMPTS, completions=COMPLETIONS, columns=COLUMNS, ids=None, step=None):
    ids = ids if ids is not None else [[1] * (i + 1) for i in range(len(completions))]
    with RewardRunner(rewards, registry) as runner:
        return runner(prompts, completions, ids, columns, step=step), runner


# -- the contract -----------------------------------------------------------------------------


def test_trl_reward_functions_run_unchanged(registry):
    import torch

    out, runner = run([reward_func, reward_len], registry)
    assert runner.names == ["reward_func", "reward_len"]
    assert out.dtype == torch.float32 and out.shape == (4, 2)
    assert out[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out[:, 1].tolist() == [-(20 - len(c)) for c in COMPLETIONS]


def test_conversational_completions_are_message_lists(registry):
    prompts = [[{"role": "user", "content": "hi"}]] * 2
    completions = ["<think>x</think><answer>1</answer>", "just 1"]
    out, _ = run([format_reward_func], registry, prompts=prompts, completions=completions, columns={})
    assert out[:, 0].tolist() == [1.0, 0.0]


def test_none_becomes_nan(registry):
    out, _ = run([only_boxed], registry)
    assert out[:, 0].tolist()[0] == 1.0
    assert math.isnan(out[2, 0]) and not math.isnan(out[3, 0])


def test_async_reward(registry):
    out, _ = run([async_reward], registry)
    assert out[:, 0].tolist() == [float(len(c)) for c in COMPLETIONS]


def test_completion_ids_and_trainer_state_are_passed(registry):
    out, _ = run([uses_ids_and_state], registry, step=10)
    assert out[:, 0].tolist() == [11.0, 12.0, 13.0, 14.0]


def test_reward_without_kwargs_gets_only_what_it_names(registry):
    def strict(completions, ground_truth):
        return [float(c.endswith(g + "}")) for c, g in zip(completions, ground_truth)]

    out, _ = run([strict], registry)
    assert out[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_missing_column_is_named(registry):
    def needs_solution(completions, solution, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"'needs_solution' needs the argument\(s\) 'solution'.*ground_truth"):
        run([needs_solution], registry)


def test_rewards_run_concurrently(registry):
    def slow_a(completions, **kwargs):
        time.sleep(0.4)
        return [1.0] * len(completions)

    async def slow_b(completions, **kwargs):
        await asyncio.sleep(0.4)
        return [2.0] * len(completions)

    def slow_c(completions, **kwargs):
        time.sleep(0.4)
        return [3.0] * len(completions)

    start = time.monotonic()
    out, _ = run([slow_a, slow_b, slow_c], registry)
    assert time.monotonic() - start < 0.8  # three 0.4 s rewards, not 1.2 s
    assert out[0].tolist() == [1.0, 2.0, 3.0]


def test_process_executor_runs_in_a_worker_process(registry):
    registry.register("reward", "cpu_heavy", cpu_heavy)
    out, _ = run([{"name": "cpu_heavy", "executor": "process"}], registry)
    pids = set(out[:, 0].tolist())
    assert len(pids) == 1 and pids != {float(os.getpid())}


# -- resolution ---------------------------------------------------------------------------------


def test_resolve_registered_decorated_and_import_path(registry):
    @grpo_plugins.reward("decorated")
    def decorated(completions, **kwargs):
        return [0.5] * len(completions)

    assert resolve_reward("decorated", registry).obj is decorated
    path = resolve_reward(f"{__name__}:reward_len", registry)
    assert path.obj is reward_len and path.name == "reward_len"
    out, runner = run(["decorated", f"{__name__}:reward_len"], registry)
    assert runner.names == ["decorated", "reward_len"]
    assert out[0].tolist() == [0.5, -(20 - len(COMPLETIONS[0]))]


def test_known_distribution_wins_over_import_path(registry):
    def mine(completions, **kwargs):
        return [7.0] * len(completions)

    # "json:loads" is also an importable path; the distribution "json" registered a reward "loads".
    registry.register("reward", "loads", mine, distribution="json")
    assert resolve_reward("json:loads", registry).obj is mine
    with pytest.raises(UnknownComponentError):  # a known distribution: never imported
        resolve_reward("json:dumps", registry)
    assert resolve_reward("os.path:join", registry).obj is os.path.join


def test_resolve_errors(registry):
    with pytest.raises(UnknownComponentError, match="unknown reward 'nope'"):
        resolve_reward("nope", registry)
    with pytest.raises(RewardConfigError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward("no_such_module_xyz:f", registry)
    with pytest.raises(RewardConfigError, match="has no attribute 'nothing'"):
        resolve_reward("json:nothing", registry)
    with pytest.raises(RewardConfigError, match=r"rewards\.1: unknown reward 'nope'"):
        RewardRunner([reward_len, "nope"], registry)
    with pytest.raises(RewardConfigError, match=r"rewards\.0: on_eror: Extra inputs"):
        RewardRunner([{"name": "x", "on_eror": "none"}], registry)
    with pytest.raises(RewardConfigError, match=r"rewards\.0: timeout: Input should be greater than 0"):
        RewardRunner([{"name": "x", "timeout": -1}], registry)


def test_duplicate_names_get_suffixes(registry):
    _, runner = run([reward_len, reward_len], registry)
    assert runner.names == ["reward_len", "reward_len_2"]


def test_reward_specs_for_task_defaults_and_weights():
    class Task:
        default_rewards = ["a", {"name": "b", "weight": 0.5}]

    cfg = GRPOConfig(rewards=[])
    specs = reward_specs_for(cfg, Task())
    assert [(s.name, s.weight) for s in specs] == [("a", 1.0), ("b", 0.5)]
    with pytest.raises(RewardConfigError, match="no rewards"):
        reward_specs_for(GRPOConfig(rewards=[], task=None))


def test_a_runs_reward_weights_replace_each_rewards_own_weight(registry):
    from grpo_plugins.rewards import reward_runner

    rewards = [f"{__name__}:reward_len", {"name": f"{__name__}:reward_func", "weight": 3.0}]
    with reward_runner(GRPOConfig(rewards=rewards), registry) as r:
        assert r.weights == [1.0, 3.0]
    config = GRPOConfig(rewards=rewards, reward_weights=[0.1, 0.2])
    with reward_runner(config, registry) as r:
        assert r.weights == [0.1, 0.2]
    with reward_runner(config, registry, rewards=[reward_len, reward_func]) as r:  # callables given
        assert r.weights == [0.1, 0.2]
    with pytest.raises(RewardConfigError, match="reward_weights has 1 values but the run has 2 rewards"):
        reward_runner(GRPOConfig(rewards=rewards, reward_weights=[1.0]), registry)


def test_runner_weights(registry):
    with RewardRunner([reward_len, {"name": f"{__name__}:reward_func", "weight": 2.0}], registry) as r:
        assert r.weights == [1.0, 2.0]
    with RewardRunner([reward_len, reward_func], registry, reward_weights=[0.3, 0.7]) as r:
        assert r.weights == [0.3, 0.7]


def test_reward_params_are_validated_with_their_path_by_validate_and_built_by_the_runner():
    from pydantic import BaseModel

    from grpo_plugins.validation import check_config

    class WithParams:
        class Params(BaseModel):
            max_len: int = 10

        def __init__(self, params):
            self.params = params

        def __call__(self, completions, **kwargs):
            return [0.0] * len(completions)

    with isolated_registry() as registry:
        registry.register("reward", "with_params", WithParams)
        config = {"task": None, "dataset": {"path": "json", "data_files": "x.jsonl"}, "num_generations": 4,
                  "per_device_train_batch_size": 4,
                  "rewards": ["with_params", {"name": "with_params", "params": {"max_len": "x"}}]}
        problems = dict(check_config(config, registry).problems)
        assert "valid integer" in problems["rewards.1.params.max_len"]
        assert not any(path.startswith("rewards.0") for path in problems)
        with RewardRunner([RewardSpec(name="with_params", params={"max_len": 3})], registry) as runner:
            assert runner._rewards[0].fn.params.max_len == 3


# -- failures -----------------------------------------------------------------------------------


def raises_on_third(completions, **kwargs):
    if len(completions) > 2 or "no idea" in completions:
        if "no idea" in completions:
            raise ValueError("cannot score this")
    return [1.0] * len(completions)


def wrong_length(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def returns_string(completions, **kwargs):
    return [1.0, "high", 1.0, 1.0]


def returns_nan(completions, **kwargs):
    return [1.0, 1.0, 1.0, float("nan")]


def returns_inf(completions, **kwargs):
    return [1.0, float("inf"), 1.0, 1.0]


def test_raising_reward_names_reward_and_sample(registry):
    with pytest.raises(RewardError) as info:
        run([reward_len, raises_on_third], registry)
    err = info.value
    assert err.reward_name == "raises_on_third" and err.sample_index == 2
    assert "reward 'raises_on_third' raised ValueError: cannot score this for sample 2" in str(err)
    assert "'no idea'" in str(err)  # a short repr of the sample


@pytest.mark.parametrize(
    ("fn", "index", "message"),
    [
        (wrong_length, None, "returned 3 values for 4 completions"),
        (returns_string, 1, "returned a str ('high'), not a number for sample 1"),
        (returns_nan, 3, "returned nan (rewards must be finite; return None for 'not applicable') for sample 3"),
        (returns_inf, 1, "returned inf"),
    ],
)
def test_bad_values_name_reward_and_sample(registry, fn, index, message):
    with pytest.raises(RewardError) as info:
        run([fn], registry)
    assert info.value.reward_name == fn.__name__ and info.value.sample_index == index
    assert f"reward '{fn.__name__}' {message}" in str(info.value)


def test_thread_timeout_is_reported_and_does_not_block(registry):
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"reward 'sleepy' timed out after 0.2 s on the batch of samples 0\.\.3"):
        run([{"name": f"{__name__}:sleepy", "timeout": 0.2}], registry)
    assert time.monotonic() - start < 2


def test_async_timeout(registry):
    async def hangs(completions, **kwargs):
        await asyncio.sleep(30)

    registry.register("reward", "hangs", hangs)
    with pytest.raises(RewardError, match="reward 'hangs' timed out after 0.2 s"):
        run([{"name": "hangs", "timeout": 0.2}], registry)


@pytest.mark.slow
def test_process_timeout_kills_the_worker(registry):
    registry.register("reward", "sleepy", sleepy)
    runner = RewardRunner([{"name": "sleepy", "timeout": 0.5, "executor": "process"}], registry)
    try:
        start = time.monotonic()
        with pytest.raises(RewardError, match="reward 'sleepy' timed out after 0.5 s"):
            runner(PROMPTS, COMPLETIONS, None, {})
        assert time.monotonic() - start < 10
        assert runner._rewards[0].worker._proc is None  # killed, restarted on the next call
    finally:
        runner.close()


@pytest.mark.parametrize("fn", [raises_on_third, wrong_length, returns_string, returns_nan, returns_inf])
def test_on_error_none_turns_failures_into_nan(registry, fn):
    import torch

    out, _ = run([{"name": f"{__name__}:{fn.__name__}", "on_error": "none"}, reward_len], registry)
    col = out[:, 0]
    assert torch.isnan(col).any() and not torch.isnan(out[:, 1]).any()
    if fn is raises_on_third:  # only the failing sample is None; the others keep their scores
        assert torch.isnan(col).tolist() == [False, False, True, False]


def test_on_error_none_timeout(registry):
    import torch

    out, _ = run([{"name": f"{__name__}:sleepy", "timeout": 0.2, "on_error": "none"}, reward_len], registry)
    assert torch.isnan(out[:, 0]).all() and not torch.isnan(out[:, 1]).any()


def test_a_failure_stops_a_loop_after_its_last_completed_step(registry, tmp_path: Path):
    """What the engine does with RewardError: stop, with the last completed step saved whole."""
    calls = {"n": 0}

    def fails_at_step_3(completions, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("reward server down")
        return [1.0] * len(completions)

    ckpt = tmp_path / "last_step.json"
    with RewardRunner([fails_at_step_3], registry) as runner:
        with pytest.raises(RewardError, match=r"'fails_at_step_3' raised RuntimeError: reward server down"):
            for step in range(1, 6):
                rewards = runner(PROMPTS[:1], COMPLETIONS[:1], [[1]], {}, step=step)
                tmp = ckpt.with_suffix(".tmp")
                tmp.write_text(json.dumps({"step": step, "reward": rewards.mean().item()}))
                os.replace(tmp, ckpt)  # atomic: a checkpoint is whole or absent
    assert json.loads(ckpt.read_text()) == {"step": 2, "reward": 1.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last_step.json"]


# -- completion text -----------------------------------------------------------------------------


def test_completion_text_reads_plain_and_chat_completions():
    assert grpo_plugins.completion_text("42") == "42"
    assert grpo_plugins.completion_text([{"role": "assistant", "content": "<answer>42</answer>"}]) == "<answer>42</answer>"
    assert grpo_plugins.completion_text([]) == ""


def test_the_readme_reward_scores_chat_completions_by_their_text():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("from Python\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    source = block[block.index("@grpo_plugins.reward") :].split("\n\n", 1)[0]  # the reward alone
    namespace: dict = {"grpo_plugins": grpo_plugins}
    try:
        exec(source, namespace)
        chat = [[{"role": "user", "content": "2+2?"}]] * 2
        with RewardRunner(["brevity"]) as runner:
            scores = runner(chat, ["4", "The answer is 4."])[:, 0].tolist()
    finally:
        grpo_plugins.get_registry().unregister("reward", "brevity")
    assert scores == pytest.approx([0.99, 0.84])


def test_a_module_function_reward_is_found_in_the_current_folder(registry, tmp_path, monkeypatch):
    """The grpo-plugins command does not put the current folder on sys.path (python -m does); a
    reward file next to the config is still found, after everything installed."""
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    (tmp_path / "local_rewards_cwd_test.py").write_text("def brevity(completions, **kw):\n    return [1.0] * len(completions)\n")
    with pytest.raises(RewardConfigError, match="cannot import module 'no_such_module_xyz'"):
        resolve_reward("no_such_module_xyz:f", registry)  # nothing of that name here: the same error
    assert str(tmp_path) not in sys.path
    fn = resolve_reward("local_rewards_cwd_test:brevity", registry).obj
    assert fn(["a", "b"]) == [1.0, 1.0]
    assert sys.path[-1] == str(tmp_path)
    sys.modules.pop("local_rewards_cwd_test", None)
