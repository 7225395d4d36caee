"""Prompts to token ids: the chat template for conversations, plain tokenization for text, and
the ``max_prompt_length`` rule; the errors that loading data raises."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from grpo_plugins.errors import GRPOPluginsError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["DataError", "PromptTooLongError", "encode_prompts"]


class DataError(GRPOPluginsError):
    """The dataset of a run cannot be loaded or does not have the expected shape."""


class PromptTooLongError(DataError):
    """A prompt is longer than max_prompt_length and prompt_truncation is 'error'."""



def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str | list[dict[str, Any]]],
    *,
    max_prompt_length: int | None,
    truncation: Literal["error", "left"] = "error",
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Token ids of each prompt.

    Conversational prompts (lists of messages) go through the tokenizer's chat template with
    ``add_generation_prompt=True`` (the template adds any special tokens itself); strings are
    tokenized as they are. A prompt over ``max_prompt_length`` tokens raises
    :class:`PromptTooLongError` (``truncation="error"``) or keeps its last tokens (``"left"``).
    ``chat_template_kwargs`` go to the chat template (e.g. ``tools=`` of a tool-calling
    environment).
    """
    if truncation not in ("error", "left"):
        raise DataError(f"prompt_truncation must be 'error' or 'left', not '{truncation}'")
    encoded: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = list(tokenizer(prompt)["input_ids"])
        else:
            if not getattr(tokenizer, "chat_template", None):
                raise DataError(
                    "prompts are chat messages but the tokenizer has no chat template; use a "
                    "tokenizer with one (model.tokenizer) or plain-text prompts"
                )
            text = tokenizer.apply_chat_template(
                list(prompt), tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
            )
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise DataError(f"prompt {index} is empty after tokenization")
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if truncation == "error":
                raise PromptTooLongError(
                    f"prompt {index} is {len(ids)} tokens long, over max_prompt_length="
                    f"{max_prompt_length}; raise max_prompt_length or set prompt_truncation: left "
                    "(keeps the last tokens)"
                )
            ids = ids[-max_prompt_length:]
        encoded.append(ids)
    return encoded
