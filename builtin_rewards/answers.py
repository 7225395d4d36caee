"""Answer-checking rewards: exact/normalised match, numeric answers, math equivalence."""

from __future__ import annotations

import threading
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from builtin_rewards._text import column, completion_text, extract_answer, normalize, numbers_close, parse_number


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
                ok = got is not None and numbers_close(got, expected, p.tolerance)
            else:
                ok = normalize(answer, "lower") == normalize(str(ref), "lower")
            out.append(float(ok))
        return out


class MathVerify:
    """1.0 when the completion's answer is mathematically equivalent to the reference (the
    ``math-verify`` package: LaTeX and plain expressions, ``\\boxed{}``), else 0.0. A reference
    that math-verify cannot parse scores None (not applicable).

    math-verify hands answers to sympy, where a short answer such as ``9^{9^{9^{9}}}`` can take
    unbounded time; its time limits use signals, which only a process's main thread receives.
    Called from another thread (the reward runner's), the answers are checked in a worker
    process of this reward's own, whose main thread applies ``timeout``; a worker stuck past
    that in C code is killed and each answer of the batch rechecked alone (the stuck one scores
    0.0).
    """

    class Params(_Params):
        column: str = Field("answer", description="Dataset column holding the reference answer.")
        float_rounding: int = Field(6, ge=0, description="Decimal places compared for floats.")
        timeout: int = Field(5, ge=1, description="Seconds math-verify may spend parsing or comparing one answer.")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or self.Params()
        self._worker: Any = None  # a ProcessWorker, started on the first call off the main thread

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        p = self.params
        refs = [str(ref) for ref in column(kwargs, p.column, "math_verify", len(completions))]
        texts = [completion_text(c) for c in completions]
        if threading.current_thread() is threading.main_thread():
            from builtin_rewards._math_verify import verify_answers

            return verify_answers(refs, texts, p.float_rounding, p.timeout)
        return self._in_worker(refs, texts)

    def _in_worker(self, refs: list[str], texts: list[str]) -> list[float | None]:
        from builtin_rewards._math_verify import verify_answers
        from grpo_plugins.rewards.worker import CallFailed, ProcessWorker

        if self._worker is None:
            # The worker imports math-verify (seconds) while it starts, which is not timed.
            self._worker = ProcessWorker(verify_answers)
        # Each answer: at most four parses and one comparison, each within the timeout.
        budget = 5 * self.params.timeout + 1

        def call(r: list[str], t: list[str]) -> list[float | None]:
            kwargs = {"refs": r, "texts": t, "float_rounding": self.params.float_rounding, "timeout": self.params.timeout}
            return self._worker.call(kwargs, budget * len(t))

        try:
            return call(refs, texts)
        except CallFailed as exc:
            if not exc.timed_out:
                raise
        out: list[float | None] = []
        for ref, text in zip(refs, texts):
            try:
                out.extend(call([ref], [text]))
            except CallFailed as exc:
                if not exc.timed_out:
                    raise
                out.append(0.0)
        return out

    def close(self) -> None:
        """Stop the worker process (the reward runner calls this at the end of a run)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
