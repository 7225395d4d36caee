"""The built-in task ``arithmetic``: synthetic word problems with exactly checkable answers."""

from __future__ import annotations

import operator
import random
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SYSTEM_PROMPT = (
    "Solve the arithmetic problem. Think briefly, then give the final answer as a number inside "
    "answer tags, like this: <answer>7</answer>"
)

_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lena"]
_ITEMS = [
    ("apple", "apples"), ("book", "books"), ("marble", "marbles"), ("pencil", "pencils"),
    ("cookie", "cookies"), ("stamp", "stamps"), ("shell", "shells"), ("card", "cards"),
]
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}
_SHORT = {
    "+": [
        "What is {a} plus {b}?",
        "What is the sum of {a} and {b}?",
        "Add {a} and {b}.",
        "You have {a} {A} and get {b} more. How many {items} do you have?",
    ],
    "-": [
        "What is {a} minus {b}?",
        "Subtract {b} from {a}.",
        "You have {a} {A} and give away {b}. How many {items} are left?",
    ],
    "*": ["What is {a} times {b}?", "Multiply {a} by {b}.", "You have {a} bags with {b} {B} each. How many {items} is that?"],
    "/": ["What is {a} divided by {b}?", "Divide {a} by {b}.", "Share {a} {A} equally among {b} friends. How many {items} does each get?"],
}
_STORIES = {
    "+": [
        "{name} has {a} {A} and gets {b} more. How many {items} does {name} have now?",
        "There are {a} {A} in a box. {name} puts in {b} more. How many {items} are in the box?",
        "{name} found {a} {A} on Monday and {b} {B} on Tuesday. How many {items} is that in total?",
    ],
    "-": [
        "{name} has {a} {A} and gives {b} away. How many {items} does {name} have left?",
        "There are {a} {A} on a table. {name} takes {b}. How many {items} are still on the table?",
    ],
    "*": [
        "{name} has {a} bags with {b} {B} in each bag. How many {items} does {name} have?",
        "A shelf has {a} rows of {b} {B}. How many {items} are on the shelf?",
    ],
    "/": [
        "{name} shares {a} {A} equally among {b} friends. How many {items} does each friend get?",
    ],
}


class ArithmeticTask:
    """Arithmetic word problems generated deterministically from a seed (the default task).

    Each row: ``prompt`` (a system message with the answer format and a user message with the
    problem), ``answer`` (the integer result as text) and ``question``. Default rewards:
    ``correct_answer`` (weight 1.0) and ``format`` (weight 0.5). Problems are deliberately easy
    by default (sums of two numbers up to 20) so a 135M model learns visibly within a few
    dozen steps; raise ``max_operand``, add ``operations`` or ``num_operands`` for harder ones.
    """

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        num_samples: int = Field(1000, ge=1, description="Number of problems.")
        num_eval_samples: int = Field(
            100, ge=1, description="Problems in the held-out split (load_eval); none of their prompts is a training prompt."
        )
        min_operand: int = Field(1, ge=0)
        max_operand: int = Field(20, ge=1)
        operations: list[Literal["+", "-", "*", "/"]] = Field(default_factory=lambda: ["+"], min_length=1)
        num_operands: int = Field(2, ge=2, le=5, description="More than 2 gives plain expressions, not word problems.")
        style: Literal["short", "story", "expression"] = Field(
            "short", description="short word problems ('What is 3 plus 4?'), longer stories, or bare expressions ('What is 3 + 4?')."
        )
        seed: int | None = Field(None, description="Seed of the generator; None: the run's seed.")
        system_prompt: str = Field(SYSTEM_PROMPT, description="The system message (states the answer format).")
        examples: list[dict[str, Any]] = Field(
            default_factory=list,
            description="Chat messages placed between the system message and the problem: a worked example (few-shot), e.g. a tool call and its result.",
        )

        @model_validator(mode="after")
        def _range(self) -> ArithmeticTask.Params:
            if self.max_operand < self.min_operand:
                raise ValueError("max_operand must be >= min_operand")
            if "/" in self.operations and self.max_operand < 1:
                raise ValueError("division needs max_operand >= 1")
            return self

    default_rewards: ClassVar[list[str | dict[str, Any]]] = [
        "correct_answer",
        {"name": "format", "weight": 0.5},
    ]

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def problem(self, rng: random.Random) -> tuple[str, int]:
        """One (question, answer) pair drawn from ``rng``."""
        p = self.params
        lo, hi = p.min_operand, p.max_operand
        if p.num_operands == 2:
            op = rng.choice(p.operations)
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            if op == "-" and b > a:
                a, b = b, a  # no negative answers in word problems
            if op == "/":
                b = max(b, 1)
                a = b * rng.randint(lo, hi)  # exact division
            answer = _OPS[op](a, b)
            if p.style == "expression":
                return f"What is {a} {op} {b}?", answer
            name = rng.choice(_NAMES)
            single, plural = rng.choice(_ITEMS)
            templates = _SHORT if p.style == "short" else _STORIES
            text = rng.choice(templates[op]).format(
                name=name, a=a, b=b, A=single if a == 1 else plural, B=single if b == 1 else plural, items=plural
            )
            return text, answer
        ops = [rng.choice([o for o in p.operations if o != "/"] or ["+"]) for _ in range(p.num_operands - 1)]
        nums = [rng.randint(lo, hi) for _ in range(p.num_operands)]
        expr = " ".join(str(x) for pair in zip(nums, ops + [""]) for x in pair).strip()
        return f"What is {expr}?", int(eval(expr, {"__builtins__": {}}))  # noqa: S307 - our own digits and + - *

    def rows(self, seed: int) -> list[dict[str, Any]]:
        """The task's rows as plain dicts (what :meth:`load` turns into a Dataset)."""
        p = self.params
        rng = random.Random(p.seed if p.seed is not None else seed)
        return [self._row(*self.problem(rng)) for _ in range(p.num_samples)]

    def eval_rows(self, seed: int) -> list[dict[str, Any]]:
        """The held-out rows (what :meth:`load_eval` turns into a Dataset): ``num_eval_samples``
        problems drawn from a separate random stream, each skipped when its question is one of
        the training rows' (or an earlier held-out row's). The system message is the same for
        every row, so no held-out prompt equals a training prompt.

        With the default small operands the same sum can appear in another wording (the
        held-out split tests new prompts, not unseen sums; raise ``max_operand`` for that).

        Raises:
            DataError: the problem space is too small to draw that many new questions.
        """
        from grpo_plugins.data import DataError

        p = self.params
        base = p.seed if p.seed is not None else seed
        seen = {row["question"] for row in self.rows(seed)}
        rng = random.Random(f"arithmetic-eval/{base}")  # a str seed is hashed with sha512: stable
        rows: list[dict[str, Any]] = []
        for _ in range(1000 + 200 * p.num_eval_samples):
            question, answer = self.problem(rng)
            if question not in seen:
                seen.add(question)
                rows.append(self._row(question, answer))
                if len(rows) == p.num_eval_samples:
                    return rows
        raise DataError(
            f"task 'arithmetic': found only {len(rows)} of num_eval_samples={p.num_eval_samples} held-out "
            f"questions that are not among the {p.num_samples} training problems; lower num_eval_samples "
            "or num_samples, or widen the problems (max_operand, operations, style)"
        )

    def _row(self, question: str, answer: int) -> dict[str, Any]:
        return {
            "prompt": [
                {"role": "system", "content": self.params.system_prompt},
                *[dict(m) for m in self.params.examples],
                {"role": "user", "content": question},
            ],
            "question": question,
            "answer": str(answer),
        }

    def load(self, seed: int) -> Any:
        """A ``datasets.Dataset`` with ``prompt``, ``question`` and ``answer`` columns."""
        from datasets import Dataset

        return Dataset.from_list(self.rows(seed))

    def load_eval(self, seed: int) -> Any:
        """The held-out split (:meth:`eval_rows`): same columns as :meth:`load`, no shared prompt."""
        from datasets import Dataset

        return Dataset.from_list(self.eval_rows(seed))
