"""Text helpers shared by the built-in rewards: completion text, answer extraction, normalising."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal, InvalidOperation
from typing import Any

# Every pattern here runs in time linear in the text: no two adjacent quantifiers can share
# characters (a megabyte of model output must not take minutes), and "<answer>...</answer>" is
# only searched up to the last closing tag (an opening tag with no closing one after it would
# otherwise scan the rest of the text, once per opening tag).
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_LAST_CLOSE = re.compile(r".*</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_LINE = re.compile(
    r"(?:final answer|answer)\s*(?:is(?:\s*:)?|:|=)\s*(?:\*+\s*)?(\S[^\n]*)|^[^\S\n]*####\s*(\S[^\n]*)",
    re.IGNORECASE | re.MULTILINE,
)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)
_SURROGATE = re.compile("[\ud800-\udfff]")


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the last message of a conversational one
    (``[{"role": "assistant", "content": ...}]``; list-of-parts content is joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        content = completion.get("content", "")
    elif isinstance(completion, Sequence) and completion:
        return completion_text(completion[-1])
    else:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return str(content)


def prompt_text(prompt: Any) -> str:
    """A prompt as text: a string, or its messages' contents joined by newlines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence):
        return "\n".join(completion_text(m) for m in prompt)
    return str(prompt)


def without_surrogates(text: str) -> str:
    """``text`` with each lone surrogate (``"\\ud800"``, which no tokenizer or UTF-8 encoder
    takes) replaced by U+FFFD."""
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


_BRACE = re.compile(r"[{}]")


def boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for brace in _BRACE.finditer(text, i):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[i + 1 : brace.start()]
    return None


def _last(pattern: re.Pattern[str], text: str, endpos: int | None = None) -> re.Match[str] | None:
    match = None
    for match in pattern.finditer(text, 0, len(text) if endpos is None else endpos):
        pass
    return match


def extract_answer(text: str, *, last_number: bool = False) -> str | None:
    """The final answer in a completion: the last ``<answer>...</answer>``, else the last
    ``\\boxed{...}``, else an ``Answer: ...`` / ``The answer is ...`` / GSM8K ``#### ...`` line;
    with ``last_number``, else the last number."""
    close = _LAST_CLOSE.match(text)
    if close is not None:
        tag = _last(_ANSWER_TAG, text, close.end())
        if tag is not None:
            return tag.group(1).strip()
    boxed = boxed_content(text)
    if boxed is not None:
        return boxed
    line = _last(_ANSWER_LINE, text)  # (answer-line group, GSM8K "#### N" group)
    if line is not None:
        return (line.group(1) or line.group(2)).rstrip()
    if last_number:
        number = _last(_NUMBER, text)
        if number is not None:
            return number.group()
    return None


def parse_number(text: str) -> Decimal | None:
    """A number written plainly (``42``, ``-3.5``, ``1,000``, ``$12.``, ``1e5``, ``inf``), exactly
    as written (a ``Decimal``: no rounding, any number of digits), else None (NaN included)."""
    cleaned = text.strip().strip("*").strip().rstrip(".").strip()
    cleaned = cleaned.lstrip("$").replace(",", "").replace(" ", "")
    try:
        number = Decimal(cleaned)
    except InvalidOperation:
        return None
    return None if number.is_nan() else number


#: Arithmetic on numbers as written: 50 significant digits, any exponent, no exceptions.
_WIDE = Context(prec=50, Emax=MAX_EMAX, Emin=MIN_EMIN, traps=[])


def numbers_close(a: Decimal, b: Decimal, tolerance: float) -> bool:
    """``|a - b| <= tolerance``, computed without float rounding: two integers that differ by
    one are apart at any size (as floats, 9007199254740993 equals 9007199254740992)."""
    if a.is_infinite() or b.is_infinite():
        return a == b
    difference = _WIDE.abs(_WIDE.subtract(a, b))
    return _WIDE.compare(difference, _WIDE.create_decimal_from_float(tolerance)) <= 0


def normalize(text: str, mode: str) -> str:
    """``none``: as is; ``strip``: trimmed, whitespace collapsed, trailing period dropped;
    ``lower``: and lower-cased; ``squad``: and punctuation and articles removed (SQuAD's)."""
    if mode == "none":
        return text
    out = " ".join(text.split()).rstrip(".").strip()
    if mode in ("lower", "squad"):
        out = out.lower()
    if mode == "squad":
        out = out.translate(_NO_PUNCTUATION)
        out = " ".join(_ARTICLES.sub(" ", out).split())
    return out


def column(kwargs: Mapping[str, Any], name: str, reward: str, n: int) -> list[Any]:
    """The dataset column ``name`` from a reward's keyword arguments, or a clear error."""
    if name not in kwargs or kwargs[name] is None:
        available = sorted(k for k in kwargs if k not in ("trainer_state", "completion_ids"))
        raise KeyError(
            f"reward '{reward}' reads the dataset column '{name}', which the data does not have "
            f"(columns: {', '.join(available) or 'none'}); set the reward's 'column' param"
        )
    values = list(kwargs[name])
    if len(values) != n:
        raise ValueError(f"column '{name}' has {len(values)} values for {n} completions")
    return values
