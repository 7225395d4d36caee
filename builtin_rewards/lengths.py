"""Length-shaped rewards: a target length, DAPO's soft overlong punishment, n-gram repetition."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from builtin_rewards._text import completion_text


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _lengths(completions: list[Any], completion_ids: list[list[int]] | None, unit: str) -> list[int]:
    if unit == "tokens":
        if completion_ids is None:
            raise ValueError("unit 'tokens' needs completion_ids; use unit: chars or words")
        return [len(ids) for ids in completion_ids]
    texts = [completion_text(c) for c in completions]
    return [len(t) if unit == "chars" else len(t.split()) for t in texts]


class LengthReward:
    """Rewards a length close to ``target``: ``max(0, 1 - |L - target| / target)``, so 1.0 at
    the target and 0.0 at zero length or twice the target."""

    class Params(_Params):
        target: int = Field(100, gt=0, description="The ideal completion length.")
        unit: Literal["tokens", "chars", "words"] = "tokens"

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
    ) -> list[float]:
        t = self.params.target
        return [max(0.0, 1.0 - abs(n - t) / t) for n in _lengths(completions, completion_ids, self.params.unit)]


class OverlongPunishment:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), on completion tokens |y|:

    0 when |y| <= L_max - L_cache; (L_max - L_cache - |y|) / L_cache in the buffer before L_max;
    -1 beyond L_max -- all times ``penalty_factor``. L_max = ``max_completion_length``, L_cache
    = ``overlong_buffer_length``.
    """

    class Params(_Params):
        max_completion_length: int = Field(256, gt=0, description="L_max: the generation limit, in tokens.")
        overlong_buffer_length: int = Field(64, gt=0, description="L_cache: the soft-punishment buffer before L_max.")
        penalty_factor: float = Field(1.0, ge=0, description="Scale of the punishment (1.0 in DAPO).")

        @model_validator(mode="after")
        def _buffer_fits(self) -> OverlongPunishment.Params:
            if self.overlong_buffer_length > self.max_completion_length:
                raise ValueError("overlong_buffer_length must not exceed max_completion_length")
            return self

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
    ) -> list[float]:
        p = self.params
        start = p.max_completion_length - p.overlong_buffer_length
        out = []
        for n in _lengths(completions, completion_ids, "tokens"):
            if n <= start:
                r = 0.0
            elif n <= p.max_completion_length:
                r = (start - n) / p.overlong_buffer_length
            else:
                r = -1.0
            out.append(r * p.penalty_factor)
        return out


class NgramRepetition:
    """Penalises repeated n-grams: ``-max_penalty * (1 - distinct n-grams / n-grams)``, so 0.0
    for text without a repeated n-gram and close to ``-max_penalty`` for a loop (Yeo et al.
    2025, "Demystifying Long Chain-of-Thought Reasoning")."""

    #: Its name until 0.1: the same as the sampling parameter ``repetition_penalty``.
    former_names = ("repetition_penalty",)

    class Params(_Params):
        ngram_size: int = Field(3, ge=1)
        max_penalty: float = Field(1.0, ge=0, description="Penalty of a fully repeated text (applied as negative).")
        unit: Literal["words", "tokens", "chars"] = "words"

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None, **kwargs: Any
    ) -> list[float]:
        p = self.params
        out = []
        for i, c in enumerate(completions):
            items: Sequence[Any]
            if p.unit == "tokens":
                if completion_ids is None:
                    raise ValueError("unit 'tokens' needs completion_ids; use unit: words")
                items = list(completion_ids[i])
            else:
                text = completion_text(c)
                items = text.lower().split() if p.unit == "words" else text
            n = p.ngram_size
            total = len(items) - n + 1
            if total <= 0:
                out.append(0.0)
                continue
            # Only the distinct n-grams are kept (a megabyte of text is not a million tuples);
            # an n-gram of characters is a slice of the text.
            grams = (items[j : j + n] if isinstance(items, str) else tuple(items[j : j + n]) for j in range(total))
            distinct = len(set(grams))
            out.append(-p.max_penalty * (1.0 - distinct / total))
        return out
