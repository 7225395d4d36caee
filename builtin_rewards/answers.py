"""Answer-checking rewards: exact/normalised match, numeric answers, math equivalence."""

from __future__ import annotations

import logging
import math
import re
import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from builtin_rewards._text import column, completion_text, extract_answer, normalize, parse_number


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExactMatch:
    """1.0 when the completion's answer equals the dataset column's, else 0.0 (after normalising).

    The answer is the last ``<answer>...</answer>`` / ``\\boxed{}`` / ``Answer:`` line when
    ``extract`` is ``auto`` (the whole completion if there is none), or the whole completion.
    """

    class Params(_Params):
        column: str = Field("answer", description="Dataset column holding the reference answer.")
        normalize: Literal["none", "strip", "lower", "squad"] = Field(
            "strip", description="none | strip (whitespace, trailing period) | lower | squad (also punctuation, articles)."
        )
        extract: Literal["auto", "none"] = Field("auto", description="auto: answer tags/boxed/'Answer:' line; none: whole text.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        p = self.params
        refs = column(kwargs, p.column, "exact_match", len(completions))
        out = []
        for completion, ref in zip(completions, refs):
            text = completion_text(completion)
            answer = extract_answer(text) if p.extract == "auto" else None
            answer = text if answer is None else answer
            out.append(float(normalize(answer, p.normalize) == normalize(str(ref), p.normalize)))
        return out


class CorrectAnswer:
    """1.0 when the completion's final answer is the reference number (``answer`` column).

    Lenient about form: ``<answer>12</answer>``, ``Answer: 12.``, ``\\boxed{12}``, ``1,200``,
    ``12.0`` all count; without any answer marker the last number in the text is taken (set
    ``last_number: false`` to require a marker). A non-numeric reference is compared as text.
    """

    class Params(_Params):
        column: str = Field("answer", description="Dataset column holding the reference answer.")
        last_number: bool = Field(True, description="Without an answer marker, use the last number in the text.")
        tolerance: float = Field(1e-6, ge=0, description="Absolute tolerance of the numeric comparison.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        p = self.params
        refs = column(kwargs, p.column, "correct_answer", len(completions))
        out = []
        for completion, ref in zip(completions, refs):
            answer = extract_answer(completion_text(completion), last_number=p.last_number)
            if answer is None:
                out.append(0.0)
                continue
            expected, got = parse_number(str(ref)), parse_number(answer)
            if expected is not None:
                ok = got is not None and math.isclose(got, expected, rel_tol=0.0, abs_tol=p.tolerance)
            else:
                ok = normalize(answer, "lower") == normalize(str(ref), "lower")
            out.append(float(ok))
        return out


def _quiet_math_verify() -> None:
    """Drop math-verify's per-call warning that its timeout is off (it is, off the main thread)."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTimeoutWarning) for f in logger.filters):
            logger.addFilter(_NoTimeoutWarning())


class _NoTimeoutWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_MATHY = re.compile(r"[\d\\^_{}=+*/-]")


class MathVerify:
    """1.0 when the completion's answer is mathematically equivalent to the reference (the
    ``math-verify`` package: LaTeX and plain expressions, ``\\boxed{}``), else 0.0. A reference
    that math-verify cannot parse scores None (not applicable)."""

    class Params(_Params):
        column: str = Field("answer", description="Dataset column holding the reference answer.")
        float_rounding: int = Field(6, ge=0, description="Decimal places compared for floats.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        from math_verify import parse as mv_parse, verify

        # math-verify's timeouts use signals, which work only in a main thread (e.g. with
        # executor: process); in the runner's threads they are off.
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        if timeout is None:
            _quiet_math_verify()

        def parse(text: str) -> Any:
            return mv_parse(text, parsing_timeout=timeout)

        p = self.params
        refs = column(kwargs, p.column, "math_verify", len(completions))
        out: list[float | None] = []
        for completion, ref in zip(completions, refs):
            ref_text = str(ref)
            # Signal-based timeouts only work in the main thread; rewards run in worker threads.
            gold = parse(ref_text)
            if not gold and "$" not in ref_text and _MATHY.search(ref_text):
                gold = parse(f"${ref_text}$")  # bare LaTeX such as \sqrt{2} or x^2+1
            if not gold:
                out.append(None)
                continue
            text = completion_text(completion)
            tagged = extract_answer(text)
            pred = parse(f"${tagged}$" if tagged is not None and "$" not in tagged else text)
            if not pred and tagged is not None:
                pred = parse(text)
            ok = bool(pred) and verify(gold, pred, float_rounding=p.float_rounding, timeout_seconds=timeout)
            out.append(float(ok))
        return out
