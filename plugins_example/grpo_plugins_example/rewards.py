"""Two rewards with parameters: a length target and keyword coverage.

A reward is anything called as ``reward(prompts, completions, completion_ids=..., **columns)``
that returns one float (or None, "not applicable") per completion: TRL's contract. A class with
a pydantic ``Params`` model is built by grpo-plugins as ``cls(params)`` with the validated
``params:`` of the run config.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from grpo_plugins import hookimpl


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of a completion: a string, or the last message of a conversational completion."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"]) if completion else ""


class LengthTarget:
    """Rewards completions close to a target length: 1.0 at the target, falling linearly to 0.0
    at ``tolerance`` away from it."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        target: int = Field(200, ge=1, description="The length that earns the full reward.")
        tolerance: int | None = Field(None, ge=1, description="Distance at which the reward reaches 0; None: the target.")
        unit: Literal["chars", "words", "tokens"] = Field("chars", description="What the length counts.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def _length(self, completion: str | list[dict[str, Any]], ids: list[int] | None) -> int:
        if self.params.unit == "tokens":
            if ids is None:
                raise ValueError("length_target with unit 'tokens' needs completion_ids")
            return len(ids)
        text = completion_text(completion)
        return len(text.split()) if self.params.unit == "words" else len(text)

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        **columns: Any,
    ) -> list[float]:
        tolerance = self.params.tolerance or self.params.target
        ids = completion_ids or [None] * len(completions)
        return [
            max(0.0, 1.0 - abs(self._length(c, i) - self.params.target) / tolerance)
            for c, i in zip(completions, ids)
        ]


class KeywordCoverage:
    """The fraction of the keywords that a completion mentions; None ("not applicable") for a
    sample with no keywords. Keywords come from ``params.keywords`` and, per sample, from a
    dataset column."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        keywords: list[str] = Field(default_factory=list, description="Keywords every completion should mention.")
        column: str | None = Field(None, description="Dataset column with per-sample keyword lists, added to `keywords`.")
        case_sensitive: bool = False

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        column = self.params.column
        if column is not None and column not in columns:
            raise KeyError(f"keyword_coverage: the dataset has no column '{column}' (columns: {sorted(columns)})")
        per_sample = columns[column] if column is not None else [[]] * len(completions)
        scores: list[float | None] = []
        for completion, extra in zip(completions, per_sample):
            keywords = [*self.params.keywords, *(extra or [])]
            if not keywords:
                scores.append(None)
                continue
            text = completion_text(completion)
            if not self.params.case_sensitive:
                text, keywords = text.lower(), [k.lower() for k in keywords]
            scores.append(sum(k in text for k in keywords) / len(keywords))
        return scores


@hookimpl
def register_rewards(register: Any) -> None:
    register(LengthTarget, name="length_target")
    register(KeywordCoverage, name="keyword_coverage")
