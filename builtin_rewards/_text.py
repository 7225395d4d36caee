"""Text helpers shared by the built-in rewards: completion text, answer extraction, normalising."""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

_ANSWER_TAG = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_LINE = re.compile(
    r"(?:final answer|answer)\s*(?:is\s*:?|:|=)\s*\**\s*(.+?)\s*$|^\s*####\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE
)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


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


def boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_answer(text: str, *, last_number: bool = False) -> str | None:
    """The final answer in a completion: the last ``<answer>...</answer>``, else the last
    ``\\boxed{...}``, else an ``Answer: ...`` / ``The answer is ...`` / GSM8K ``#### ...`` line;
    with ``last_number``, else the last number."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1]
    boxed = boxed_content(text)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(text)  # (answer-line group, GSM8K "#### N" group)
    if lines:
        return next(g for g in lines[-1] if g)
    if last_number:
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1]
    return None


def parse_number(text: str) -> float | None:
    """A number written plainly (``42``, ``-3.5``, ``1,000``, ``$12.``), else None."""
    cleaned = text.strip().strip("*").strip().rstrip(".").strip()
    cleaned = cleaned.lstrip("$").replace(",", "").replace(" ", "")
    try:
        return float(cleaned)
    except ValueError:
        return None


def normalize(text: str, mode: str) -> str:
    """``none``: as is; ``strip``: trimmed, whitespace collapsed, trailing period dropped;
    ``lower``: and lower-cased; ``squad``: and punctuation and articles removed (SQuAD's)."""
    if mode == "none":
        return text
    out = " ".join(text.split()).rstrip(".").strip()
    if mode in ("lower", "squad"):
        out = out.lower()
    if mode == "squad":
        out = "".join(ch for ch in out if ch not in set(string.punctuation))
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
