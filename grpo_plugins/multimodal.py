"""The image inputs of a prompt as they travel with it: :class:`MultimodalInputs` (one prompt's
tensors from the model's processor), :class:`PromptIds` (a prompt's token ids carrying them to
the generator) and :func:`collate` (the tensors of a forward pass's rows, in row order).

A processor returns, besides ``input_ids`` and ``attention_mask``, two sorts of tensors:

* per-token fields (``mm_token_type_ids``, ``token_type_ids``): one value per prompt token; in a
  pass they sit under the prompt's tokens (0 under padding and completion tokens);
* image fields (``pixel_values``, ``image_grid_thw``, ``pixel_attention_mask``, ...): one prompt's
  tensors have a leading dimension that a batch concatenates. Qwen2-VL's flattened patches
  (patches, D) and ``image_grid_thw`` (images, 3) concatenate as they are; Idefics3's (1, images,
  C, H, W) and its pixel mask concatenate after padding the images dimension with zeros, as its
  processor pads a batch (the model drops all-zero images).

A text-only run never builds any of these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = ["TOKEN_FIELDS", "MultimodalInputs", "PromptIds", "collate", "multimodal_of"]

#: Processor outputs with one value per prompt token.
TOKEN_FIELDS = ("mm_token_type_ids", "token_type_ids")
#: Processor outputs that are the prompt's tokens themselves.
_TEXT_FIELDS = ("input_ids", "attention_mask")


@dataclass(frozen=True)
class MultimodalInputs:
    """One prompt's image inputs as its processor made them.

    Attributes:
        images: the image fields (``pixel_values`` and the model's extras), each with a leading
            dimension that a batch concatenates.
        tokens: the per-token fields, each (P,) aligned with the prompt's P tokens.
    """

    images: dict[str, Tensor]
    tokens: dict[str, Tensor]

    @classmethod
    def from_processor(cls, encoded: Mapping[str, Any]) -> MultimodalInputs:
        """The inputs of a processor's output for one prompt (batch of one)."""
        import torch

        images, tokens = {}, {}
        for key, value in encoded.items():
            if key in _TEXT_FIELDS or not isinstance(value, torch.Tensor):
                continue
            if key in TOKEN_FIELDS:
                tokens[key] = value[0]
            else:
                images[key] = value
        return cls(images, tokens)


class PromptIds(list):  # type: ignore[type-arg]
    """A prompt's token ids (a ``list[int]``) that carry its :class:`MultimodalInputs` to the
    generator (``multimodal``)."""

    def __init__(self, ids: Sequence[int], multimodal: MultimodalInputs) -> None:
        super().__init__(ids)
        self.multimodal = multimodal


def multimodal_of(prompt_ids: Any) -> MultimodalInputs | None:
    """The image inputs a prompt's ids carry (None for a text prompt)."""
    return getattr(prompt_ids, "multimodal", None)


def _concat(values: list[Tensor]) -> Tensor:
    """Concatenate along dim 0, zero-padding dim 1 (images per prompt) where the rows differ."""
    import torch

    if len({v.shape[1:] for v in values}) > 1:
        width = max(v.shape[1] for v in values)
        values = [
            torch.cat([v, v.new_zeros((v.shape[0], width - v.shape[1], *v.shape[2:]))], dim=1) for v in values
        ]
    return torch.cat(values, dim=0)


def collate(
    items: Sequence[MultimodalInputs | None], input_ids: Tensor, prompt_end: int, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """The forward arguments of a pass over rows whose image inputs are ``items`` (None: a text
    row), in row order. ``input_ids`` (B, L): the pass's left-padded prompts end at column
    ``prompt_end``. Floating tensors are cast to ``dtype`` (the model's). Empty when no row has
    images."""
    import torch

    present = [m for m in items if m is not None]
    if not present:
        return {}
    device = input_ids.device
    out: dict[str, Tensor] = {}
    for key in dict.fromkeys(k for m in present for k in m.images):
        value = _concat([m.images[key] for m in present if key in m.images]).to(device)
        out[key] = value.to(dtype) if dtype is not None and value.is_floating_point() else value
    for key in dict.fromkeys(k for m in present for k in m.tokens):
        field = torch.zeros_like(input_ids)  # (B, L)
        for row, m in enumerate(items):
            if m is not None and key in m.tokens:
                values = m.tokens[key]
                field[row, prompt_end - values.shape[0] : prompt_end] = values.to(device)
        out[key] = field
    return out


def placeholder_token_ids(config: Any) -> list[int]:
    """The image/video placeholder tokens of a vision-language model's config (none for a text
    model). The generator never samples them and the log-probs leave them out, since a
    placeholder in a completion would stand for an image that is not there."""
    ids = {getattr(config, name, None) for name in ("image_token_id", "video_token_id", "image_token_index")}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)
