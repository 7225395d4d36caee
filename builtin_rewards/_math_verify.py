"""math-verify's verdicts for the ``math_verify`` reward, in a module of their own that imports
math-verify at once: a worker process loads it while starting (not timed), not in a timed call."""

from __future__ import annotations

import logging
import re
from typing import Any

from math_verify import parse as mv_parse, verify

from builtin_rewards._text import extract_answer

_MATHY = re.compile(r"[\d\\^_{}=+*/-]")


class _Shortened(logging.Filter):
    """Cuts math-verify's warnings, which quote the whole text ("Timeout during parsing: ...")."""

    LIMIT = 200

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > self.LIMIT:
            record.msg, record.args = f"{message[: self.LIMIT]}... ({len(message)} characters)", ()
        return True


logging.getLogger("math_verify.parser").addFilter(_Shortened())


def verify_answers(refs: list[str], texts: list[str], float_rounding: int, timeout: int | None) -> list[float | None]:
    """math-verify's verdict on each (reference, completion text): 1.0, 0.0, or None when the
    reference does not parse. ``timeout`` bounds each parse and comparison, by a signal: it
    works only in a process's main thread (None: unbounded)."""
    def parse(text: str) -> Any:
        return mv_parse(text, parsing_timeout=timeout)  # type: ignore[arg-type]

    out: list[float | None] = []
    for ref_text, text in zip(refs, texts):
        gold = parse(ref_text)
        if not gold and "$" not in ref_text and _MATHY.search(ref_text):
            gold = parse(f"${ref_text}$")  # bare LaTeX such as \sqrt{2} or x^2+1
        if not gold:
            out.append(None)
            continue
        tagged = extract_answer(text)
        pred = parse(f"${tagged}$" if tagged is not None and "$" not in tagged else text)
        if not pred and tagged is not None:
            pred = parse(text)
        ok = bool(pred) and verify(gold, pred, float_rounding=float_rounding, timeout_seconds=timeout)
        out.append(float(ok))
    return out
