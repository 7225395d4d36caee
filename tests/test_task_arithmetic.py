"""The built-in task ``arithmetic``: deterministic problems, correct answers, default rewards."""

from __future__ import annotations

import json
import re

import pytest

from grpo_plugins.config import GRPOConfig
from grpo_plugins.registry import ComponentParamsError, Registry
from grpo_plugins.rewards import RewardRunner, reward_specs_for
from grpo_plugins.testing import check_component

from builtin_rewards.tasks import ArithmeticTask


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry()


def task(registry: Registry, **params) -> ArithmeticTask:
    return registry.build("task", "arithmetic", params)


def _numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def test_meets_the_task_contract():
    check_component("task", ArithmeticTask, name="arithmetic", params={"num_samples": 8})


def test_same_seed_same_problems_other_seed_other_problems(registry):
    t = task(registry, num_samples=20)
    assert t.rows(1) == t.rows(1)
    assert t.rows(1) != t.rows(2)
    fixed = task(registry, num_samples=20, seed=7)
    assert fixed.rows(1) == fixed.rows(2)  # params.seed overrides the run's seed


def test_default_problems_are_easy_sums_with_correct_answers(registry):
    rows = task(registry, num_samples=200).rows(0)
    assert len(rows) == 200
    for row in rows:
        a, b = _numbers(row["question"])
        assert 1 <= a <= 20 and 1 <= b <= 20
        assert row["answer"] == str(a + b)


@pytest.mark.parametrize(("op", "check"), [("-", lambda a, b, r: r == max(a, b) - min(a, b)), ("*", lambda a, b, r: r == a * b), ("/", lambda a, b, r: r * b == a)])
def test_other_operations(registry, op, check):
    for row in task(registry, num_samples=50, operations=[op], max_operand=9).rows(0):
        a, b = _numbers(row["question"])
        assert check(a, b, int(row["answer"])), row


@pytest.mark.parametrize("style", ["short", "story", "expression"])
def test_every_style_states_both_operands(registry, style):
    rows = task(registry, num_samples=40, style=style, operations=["+", "-", "*", "/"]).rows(0)
    questions = {row["question"] for row in rows}
    assert len(questions) > 30  # varied
    for row in rows:
        assert len(_numbers(row["question"])) == 2
    if style == "expression":
        assert all(re.fullmatch(r"What is \d+ [-+*/] \d+\?", q) for q in questions)


def test_expressions_with_more_operands(registry):
    for row in task(registry, num_samples=30, operations=["+", "-", "*"], num_operands=3).rows(0):
        expr = row["question"].removeprefix("What is ").removesuffix("?")
        assert int(row["answer"]) == eval(expr)  # noqa: S307 - digits and + - * only


def test_prompts_are_conversational_with_the_answer_format(registry):
    row = task(registry, num_samples=1).rows(0)[0]
    system, user = row["prompt"]
    assert system["role"] == "system" and "<answer>" in system["content"]
    assert user == {"role": "user", "content": row["question"]}


def test_load_returns_a_dataset(registry):
    ds = task(registry, num_samples=5).load(3)
    assert ds.column_names == ["prompt", "question", "answer"] and len(ds) == 5


def test_params_are_checked(registry):
    with pytest.raises(ComponentParamsError, match="max_operand must be >= min_operand"):
        task(registry, min_operand=10, max_operand=5)
    with pytest.raises(ComponentParamsError, match="operations"):
        task(registry, operations=["^"])


def test_default_rewards_score_ideal_and_sloppy_answers(registry):
    specs = reward_specs_for(GRPOConfig(rewards=[]), registry.get("task", "arithmetic"))
    assert [(s.name, s.weight) for s in specs] == [("correct_answer", 1.0), ("format", 0.5)]
    rows = task(registry, num_samples=4).rows(0)
    answers = [r["answer"] for r in rows]
    completions = [
        f"{rows[0]['question']} So the total is {answers[0]}. <answer>{answers[0]}</answer>",
        f"The answer is {answers[1]}.",  # right, with a near-miss format
        f"<answer>{int(answers[2]) + 1}</answer>",  # well formatted, wrong
        "I don't know.",
    ]
    with RewardRunner(specs, registry) as runner:
        out = runner([r["prompt"] for r in rows], completions, None, {"answer": answers})
    assert out.tolist() == [[1.0, 1.0], [1.0, 0.5], [0.0, 1.0], [0.0, 0.0]]


@pytest.mark.parametrize(
    "params",
    [{}, {"num_samples": 300, "num_eval_samples": 50, "style": "story"}, {"operations": ["+", "-", "*", "/"], "max_operand": 9}, {"seed": 4}],
)
def test_held_out_split_shares_no_prompt_with_the_training_prompts(registry, params):
    t = task(registry, **params)
    for seed in (0, 1, 42):
        train = {json.dumps(row["prompt"]) for row in t.rows(seed)}
        held_out = [json.dumps(p) for p in t.load_eval(seed)["prompt"]]
        assert len(held_out) == t.params.num_eval_samples == len(set(held_out))  # no duplicates either
        assert train.isdisjoint(held_out)


def test_held_out_split_is_deterministic_and_has_the_training_columns(registry):
    t = task(registry, num_samples=50, num_eval_samples=10)
    assert t.eval_rows(3) == t.eval_rows(3) and t.eval_rows(3) != t.eval_rows(4)
    rows = t.eval_rows(3)
    assert set(rows[0]) == {"prompt", "question", "answer"}
    for row in rows:
        a, b = _numbers(row["question"])
        assert row["answer"] == str(a + b)


def test_a_problem_space_too_small_for_a_held_out_split_is_a_clear_error(registry):
    from grpo_plugins.data import DataError

    t = task(registry, max_operand=2, style="expression", num_samples=100, num_eval_samples=5)  # 4 questions in all
    with pytest.raises(DataError, match="found only 0 of num_eval_samples=5 held-out questions"):
        t.load_eval(0)


def test_the_task_contract_rejects_a_held_out_split_that_overlaps_training():
    import datasets

    from grpo_plugins.testing import ComponentContractError

    class Leaky:
        default_rewards = ["correct_answer"]

        def load(self, seed):
            return datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}])

        def load_eval(self, seed):
            return datasets.Dataset.from_list([{"prompt": "b"}, {"prompt": "c"}])

    with pytest.raises(ComponentContractError, match="1 prompt.* of load_eval.0. are also prompts of load.0."):
        check_component("task", Leaky, name="leaky")


def test_a_task_without_a_held_out_split_still_meets_the_contract():
    import datasets

    class Plain:
        def load(self, seed):
            return datasets.Dataset.from_list([{"prompt": "a"}])

    check_component("task", Plain, name="plain")
