"""Format rewards: a regular expression, and the answer format of the built-in tasks."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from builtin_rewards._text import completion_text

#: ``<think>...</think>`` then ``<answer>...</answer>``. The lookahead with a back-reference
#: takes the first ``</think> <answer>`` and never retries a later one, which keeps a text with
#: many of them linear, not quadratic; with ``dotall`` (the default) a later one cannot match
#: where the first did not, so the pattern matches what the plain ``.*?`` version does.
THINK_ANSWER = r"^\s*<think>(?=(.*?</think>\s*<answer>))\1.*?</answer>\s*$"


class RegexMatch:
    """``match_reward`` when the completion matches ``pattern`` (default: ``<think>...</think>``
    then ``<answer>...</answer>``), else ``miss_reward``."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        pattern: str = Field(THINK_ANSWER, description="Python regular expression.")
        mode: Literal["search", "match", "fullmatch"] = Field("search", description="re.search, re.match or re.fullmatch.")
        dotall: bool = Field(True, description="'.' also matches newlines.")
        ignore_case: bool = False
        match_reward: float = 1.0
        miss_reward: float = 0.0

        @field_validator("pattern")
        @classmethod
        def _compiles(cls, value: str) -> str:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
            return value

    def __init__(self, params: Params | None = None) -> None:
        self.params = p = params or self.Params()
        flags = (re.DOTALL if p.dotall else 0) | (re.IGNORECASE if p.ignore_case else 0)
        self._find = getattr(re.compile(p.pattern, flags), p.mode)

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        p = self.params
        return [p.match_reward if self._find(completion_text(c)) else p.miss_reward for c in completions]


# No two adjacent quantifiers share characters, so a failed match costs time linear in the
# text (a megabyte of spaces after "Answer:" must not take minutes).
_NUM = r"-?\d[\d,]*(?:\.\d+)?"
_FINAL_TAG = re.compile(rf"<answer>\s*{_NUM}\s*</answer>[\s.]*$", re.IGNORECASE)
_OPEN_TAG = re.compile(r"<answer>", re.IGNORECASE)
_CLOSE_TAG = re.compile(r"</answer>", re.IGNORECASE)
_LINE_END = r"[^\S\n]*(?:\*+(?:[^\S\n]|\.)*|\.(?:[^\S\n]|\.)*)?$"  # spaces, stars, periods
_FINAL_LINE = re.compile(
    rf"(?:(?:final answer|answer)\s*(?:is(?:\s*:)?|:|=)|^[^\S\n]*####)\s*(?:\*+\s*)?{_NUM}{_LINE_END}",
    re.IGNORECASE | re.MULTILINE,
)


def _has_tag(text: str) -> bool:
    """Whether an ``<answer>`` tag is closed somewhere after it."""
    opening = _OPEN_TAG.search(text)
    return opening is not None and _CLOSE_TAG.search(text, opening.end()) is not None


class AnswerFormat:
    """The answer format of the built-in tasks: 1.0 when the completion ends with
    ``<answer>N</answer>`` (N a number); ``partial_credit`` when it has an ``<answer>`` tag
    elsewhere or ends with an ``Answer: N`` / ``The answer is N`` / ``#### N`` line; 0.0
    otherwise."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        partial_credit: float = Field(0.5, ge=0, le=1, description="Score of the near-misses.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        out = []
        for c in completions:
            text = completion_text(c).strip()
            if _FINAL_TAG.search(text):
                out.append(1.0)
            elif _has_tag(text) or _FINAL_LINE.search(text):
                out.append(self.params.partial_credit)
            else:
                out.append(0.0)
        return out
