"""A reward with parameters: keyword coverage.

A reward is anything called as ``reward(prompts, completions, completion_ids=..., **columns)``
that returns one float (or None, "not applicable") per completion: TRL's contract. A class with
a pydantic ``Params`` model is built by grpo-plugins as ``cls(params)`` with the validated
``params:`` of the run config.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from grpo_plugins import hookimpl


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of a completion: a string, or the last message of a conversational completion."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"]) if completion else ""


class KeywordCoverage:
    """The fraction of the keywords that a completion mentions; None ("not applicable") for a
    sample with no keywords. Keywords come from ``params.keywords`` and, per sample, from a
    dataset column."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

        keywords: list[str] = Field(default_factory=list, description="Keywords every completion should mention.")
        column: str | None = Field(
            None, description="Dataset column with per-sample keyword lists, added to `keywords`."
        )
        case_sensitive: bool = Field(False, description="Match keywords with their exact case.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        column = self.params.column
        if column is not None and column not in columns:
            raise ValueError(f"keyword_coverage: the dataset has no column '{column}' (columns: {sorted(columns)})")
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
    register(KeywordCoverage, name="keyword_coverage")
