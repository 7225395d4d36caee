"""The built-in rewards and tasks of grpo-plugins, registered through the public entry point
(group ``grpo_plugins``) exactly as a third-party plugin's are.

Rewards: ``correct_answer``, ``exact_match``, ``math_verify``, ``format``, ``regex_match``,
``length``, ``overlong_punishment``, ``ngram_repetition``, ``json_valid``, ``json_schema``,
``code_execution``, ``reward_model``. Tasks: ``arithmetic``, ``shapes`` (pictures; docs/vision.md). See docs/rewards.md.

Nothing heavy is imported here (torch, transformers, datasets and math_verify are imported when
a reward is first called), so ``grpo-plugins list`` and ``validate`` stay fast.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_plugins import hookimpl

from builtin_rewards.answers import CorrectAnswer, ExactMatch, MathVerify
from builtin_rewards.code_execution import CodeExecution
from builtin_rewards.formats import AnswerFormat, RegexMatch
from builtin_rewards.json_rewards import JsonSchemaMatch, JsonValid
from builtin_rewards.lengths import LengthReward, OverlongPunishment, NgramRepetition
from builtin_rewards.reward_model import RewardModel
from builtin_rewards.tasks import ArithmeticTask
from builtin_rewards.vision_tasks import ShapesTask

REWARDS: dict[str, type] = {
    "correct_answer": CorrectAnswer,
    "exact_match": ExactMatch,
    "math_verify": MathVerify,
    "format": AnswerFormat,
    "regex_match": RegexMatch,
    "length": LengthReward,
    "overlong_punishment": OverlongPunishment,
    "ngram_repetition": NgramRepetition,
    "json_valid": JsonValid,
    "json_schema": JsonSchemaMatch,
    "code_execution": CodeExecution,
    "reward_model": RewardModel,
}


@hookimpl
def register_rewards(register: Callable[..., Any]) -> None:
    for name, cls in REWARDS.items():
        register(cls, name=name)


@hookimpl
def register_tasks(register: Callable[..., Any]) -> None:
    register(ArithmeticTask, name="arithmetic")
    register(ShapesTask, name="shapes")
