"""The batch planner: its formulas (docs/cli.md, "plan"), four worked examples, and the rules' errors."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest

from grpo_plugins.batching import BatchPlanError, BatchPlanWarning, make_plan, plan_from_config
from grpo_plugins.config import GRPOConfig

U, N = True, False  # optimizer update after the step, or not


def batches(plan, cycle: int, process: int = 0) -> list[tuple[list[int], bool]]:
    return [(s.batch, s.optimizer_update) for s in plan.cycle(cycle, process)]


def test_example_1_two_updates_per_generation():
    plan = make_plan(per_device_train_batch_size=3, gradient_accumulation_steps=2, steps_per_generation=4, num_generations=3)
    assert (plan.effective_batch_size, plan.unique_prompts, plan.optimizer_steps_per_generation) == (12, 4, 2)
    assert batches(plan, 0) == [([0, 0, 0], N), ([1, 1, 1], U), ([2, 2, 2], N), ([3, 3, 3], U)]
    assert batches(plan, 1) == [([4, 4, 4], N), ([5, 5, 5], U), ([6, 6, 6], N), ([7, 7, 7], U)]


def test_example_2_one_update_per_generation():
    plan = make_plan(per_device_train_batch_size=3, gradient_accumulation_steps=4, num_generations=3)
    assert plan.steps_per_generation == 4  # None -> gradient_accumulation_steps
    assert (plan.effective_batch_size, plan.unique_prompts, plan.optimizer_steps_per_generation) == (12, 4, 1)
    assert batches(plan, 0) == [([0, 0, 0], N), ([1, 1, 1], N), ([2, 2, 2], N), ([3, 3, 3], U)]


def test_example_3_groups_span_micro_batches():
    plan = make_plan(per_device_train_batch_size=3, gradient_accumulation_steps=4, steps_per_generation=4, num_generations=4)
    assert (plan.effective_batch_size, plan.unique_prompts, plan.optimizer_steps_per_generation) == (12, 3, 1)
    assert batches(plan, 0) == [([0, 0, 0], N), ([0, 1, 1], N), ([1, 1, 2], N), ([2, 2, 2], U)]
    assert batches(plan, 1) == [([3, 3, 3], N), ([3, 4, 4], N), ([4, 4, 5], N), ([5, 5, 5], U)]


def test_example_4_two_groups_per_micro_batch():
    plan = make_plan(per_device_train_batch_size=6, gradient_accumulation_steps=2, steps_per_generation=2, num_generations=3)
    assert (plan.effective_batch_size, plan.unique_prompts) == (12, 4)
    assert batches(plan, 0) == [([0, 0, 0, 1, 1, 1], N), ([2, 2, 2, 3, 3, 3], U)]
    assert batches(plan, 1) == [([4, 4, 4, 5, 5, 5], N), ([6, 6, 6, 7, 7, 7], U)]


def test_to_json_has_the_documented_shape():
    data = make_plan(3, 2, 3, steps_per_generation=4).to_json(cycles=1)
    assert data["effective_batch_size"] == 12
    assert data["optimizer_steps_per_generation"] == 2
    assert data["unique_prompts"] == 4
    assert data["cycles"][0]["steps"][1] == {"step": 1, "batch": [1, 1, 1], "optimizer_update": True}
    assert len(data["cycles"]) == 1


def test_num_iterations_repeats_the_generation_batch():
    plan = make_plan(3, 2, 3, steps_per_generation=4, num_iterations=2)
    assert plan.steps_per_cycle == 8
    assert plan.optimizer_steps_per_generation == 4
    assert plan.unique_prompts == 4  # mu does not change what is generated
    one_pass = [([0, 0, 0], N), ([1, 1, 1], U), ([2, 2, 2], N), ([3, 3, 3], U)]
    assert batches(plan, 0) == one_pass + one_pass
    assert [s.step for s in plan.cycle(0)] == list(range(8))
    assert plan.cycle(1)[4].batch == [4, 4, 4]


def test_num_iterations_lets_an_update_span_both_passes():
    # GA 8 = spg 4 * mu 2: one update per cycle, after the second pass (exactly on-policy).
    plan = make_plan(3, 8, 3, steps_per_generation=4, num_iterations=2)
    assert [s.optimizer_update for s in plan.cycle(0)] == [N] * 7 + [U]
    assert plan.on_policy


def test_two_processes_split_the_generation_batch():
    plan = make_plan(3, 2, 3, steps_per_generation=4, num_processes=2)
    assert (plan.effective_batch_size, plan.unique_prompts, plan.completions_per_process) == (24, 8, 12)
    assert batches(plan, 0, process=0) == [([0, 0, 0], N), ([1, 1, 1], U), ([2, 2, 2], N), ([3, 3, 3], U)]
    assert batches(plan, 0, process=1) == [([4, 4, 4], N), ([5, 5, 5], U), ([6, 6, 6], N), ([7, 7, 7], U)]
    assert batches(plan, 1, process=1)[0] == ([12, 12, 12], N)
    assert plan.process_rows(1) == slice(12, 24)
    assert plan.to_json(cycles=1, process=1)["cycles"][0]["steps"][0]["batch"] == [4, 4, 4]


def test_groups_may_span_processes():
    # 6 completions per cycle over 3 processes of 2: prompt 0 is rows 0-2, prompt 1 rows 3-5.
    plan = make_plan(per_device_train_batch_size=2, gradient_accumulation_steps=1, num_generations=3, num_processes=3)
    assert plan.unique_prompts == 2
    assert [plan.cycle(0, p)[0].batch for p in range(3)] == [[0, 0], [0, 1], [1, 1]]


def test_micro_step_rows_index_the_process_share():
    plan = make_plan(3, 4, 4, steps_per_generation=4)
    assert [s.rows for s in plan.cycle(0)] == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    share = plan.prompt_indices(0)[plan.process_rows(0)]
    assert all(share[s.rows] == s.batch for s in plan.cycle(0))


@pytest.mark.parametrize("procs", [1, 2, 3])
@pytest.mark.parametrize("mu", [1, 2])
def test_every_completion_is_trained_once_per_iteration(procs: int, mu: int):
    plan = make_plan(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=6,
                     steps_per_generation=3 * 2, num_processes=procs, num_iterations=mu)
    seen = Counter()
    for p in range(procs):
        for step in plan.cycle(2, p):
            seen.update(step.batch)
    expected = {2 * plan.unique_prompts + i: plan.num_generations * mu for i in range(plan.unique_prompts)}  # cycle 2's prompts
    assert dict(seen) == expected
    updates = sum(s.optimizer_update for s in plan.cycle(0))
    assert updates == plan.optimizer_steps_per_generation


def test_generation_batch_size_sets_steps_per_generation():
    plan = make_plan(per_device_train_batch_size=3, gradient_accumulation_steps=2, num_generations=3,
                     generation_batch_size=24, num_processes=2)
    assert plan.steps_per_generation == 4
    assert plan.generation_batch_size == plan.effective_batch_size == 24


def test_not_on_policy_when_updates_fall_inside_a_cycle():
    assert not make_plan(3, 2, 3, steps_per_generation=4).on_policy
    assert make_plan(3, 4, 3).on_policy


@pytest.mark.parametrize(
    ("kwargs", "field", "says"),
    [
        (dict(num_generations=1), "num_generations", "at least 2"),
        (dict(num_generations=5), "num_generations", "not divisible by num_generations (5)"),
        (dict(steps_per_generation=4, generation_batch_size=12), "steps_per_generation", "mutually exclusive"),
        (dict(generation_batch_size=10), "generation_batch_size", "multiple of num_processes * per_device_train_batch_size"),
        (dict(gradient_accumulation_steps=3, steps_per_generation=4), "gradient_accumulation_steps", "must divide"),
        (dict(per_device_train_batch_size=0), "per_device_train_batch_size", "positive"),
        (dict(num_processes=0), "num_processes", "positive"),
        (dict(num_iterations=0), "num_iterations", "positive"),
    ],
)
def test_bad_settings_name_the_field_to_change(kwargs: dict, field: str, says: str):
    settings = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, num_generations=3, steps_per_generation=4)
    settings.update(kwargs)
    if "generation_batch_size" in kwargs and "steps_per_generation" not in kwargs:
        settings.pop("steps_per_generation")
    with pytest.raises(BatchPlanError) as info:
        make_plan(**settings)
    assert info.value.field == field
    assert says in str(info.value)


def test_error_suggests_values():
    with pytest.raises(BatchPlanError, match="set it to 9 or 12"):
        make_plan(3, 1, 3, generation_batch_size=10)
    with pytest.raises(BatchPlanError, match="a divisor of 4"):
        make_plan(3, 3, 3, steps_per_generation=4)


def test_two_generations_warn_but_work():
    with pytest.warns(BatchPlanWarning, match="num_generations is 2"):
        plan = make_plan(2, 1, 2)
    assert plan.unique_prompts == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_plan(3, 1, 3)  # no warning above 2


def test_plan_from_config_takes_processes_from_config_then_world_size(monkeypatch: pytest.MonkeyPatch):
    config = GRPOConfig(per_device_train_batch_size=3, gradient_accumulation_steps=2, steps_per_generation=4, num_generations=3)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert plan_from_config(config).num_processes == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert plan_from_config(config).effective_batch_size == 48
    assert plan_from_config(config.model_copy(update={"num_processes": 2})).num_processes == 2
    assert plan_from_config(config, num_processes=3).num_processes == 3
