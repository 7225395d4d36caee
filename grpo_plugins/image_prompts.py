"""Prompts with images, encoded by a vision-language model's processor.

The data follows TRL's conventions: a ``prompt`` (chat messages whose user content mixes
``{"type": "image"}`` and ``{"type": "text", "text": ...}`` items, or a string) and its images in
an ``image`` column (one image or None) or an ``images`` column (a list). An image is a
``PIL.Image``, a file path, or a ``{"bytes": ..., "path": ...}`` dict as ``datasets`` stores
images. Conversational prompts without image items get one per image at the start of their first
user message, as TRL does. The processor's chat template and image processing make the token ids
and the image tensors (:class:`~grpo_plugins.multimodal.MultimodalInputs`).
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo_plugins.multimodal import MultimodalInputs, PromptIds
from grpo_plugins.prompt_encoding import DataError, PromptTooLongError

__all__ = ["IMAGE_COLUMNS", "ImagePromptEncoder", "MultimodalCache", "has_image_column", "load_image", "row_images"]

#: The columns that hold a prompt's images (TRL's names).
IMAGE_COLUMNS = ("images", "image")


def has_image_column(columns: Sequence[str]) -> bool:
    """Whether a dataset with these columns has prompts with images."""
    return any(c in columns for c in IMAGE_COLUMNS)


def load_image(value: Any, where: str = "image") -> Any:
    """An RGB ``PIL.Image`` from a PIL image, a file path or a ``{"bytes", "path"}`` dict."""
    from PIL import Image

    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, (str, Path)):
        if not Path(value).expanduser().is_file():
            raise DataError(f"{where}: image file '{value}' does not exist")
        image = Image.open(Path(value).expanduser())
    elif isinstance(value, Mapping) and (value.get("bytes") or value.get("path")):
        source = io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]
        try:
            image = Image.open(source)
        except (OSError, ValueError) as exc:
            raise DataError(f"{where}: cannot read the image: {exc}") from exc
    else:
        raise DataError(
            f"{where} is a {type(value).__name__}; an image must be a PIL image, a file path or a "
            "{'bytes': ..., 'path': ...} dict"
        )
    return image.convert("RGB")


def row_images(row: Mapping[str, Any], where: str) -> list[Any]:
    """The images of a dataset row (its ``images`` list or its ``image``), loaded."""
    if "images" in row and row["images"] is not None:
        values = row["images"] if isinstance(row["images"], (list, tuple)) else [row["images"]]
        return [load_image(v, f"{where} images[{i}]") for i, v in enumerate(values)]
    if row.get("image") is not None:
        return [load_image(row["image"], f"{where} image")]
    return []


def _image_items(prompt: Any) -> int:
    if isinstance(prompt, str):
        return 0
    return sum(
        1 for m in prompt if not isinstance(m.get("content"), str)
        for c in m.get("content") or [] if isinstance(c, Mapping) and c.get("type") == "image"
    )


def _with_image_items(prompt: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """TRL's rule for prompts without image items: ``n`` of them open the first user message."""
    out, done = [], False
    for message in prompt:
        if not done and message.get("role") == "user":
            content = message.get("content")
            text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            message = {**message, "content": [{"type": "image"}] * n + text}
            done = True
        out.append(message)
    return out


class ImagePromptEncoder:
    """Turns a prompt and its images into :class:`~grpo_plugins.multimodal.PromptIds` with the
    processor.

    Args:
        processor: the model's processor (chat template, tokenizer and image processor).
        max_prompt_length: prompts over this many tokens (images included) are an error; they
            are never cut, since a cut would split an image's tokens.
        chat_template_kwargs: passed to the chat template.
    """

    def __init__(
        self, processor: Any, max_prompt_length: int | None, chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        self.processor, self.max_prompt_length = processor, max_prompt_length
        self.template_kwargs = dict(chat_template_kwargs or {})

    def encode(self, prompt: Any, images: list[Any], where: str = "prompt") -> PromptIds:
        """The token ids of one prompt with its image inputs attached."""
        if isinstance(prompt, str):
            text = prompt
        else:
            items = _image_items(prompt)
            if items == 0 and images:
                prompt, items = _with_image_items(list(prompt), len(images)), len(images)
            if items != len(images):
                raise DataError(
                    f"{where} has {items} image item(s) ({{'type': 'image'}}) but {len(images)} image(s) in its "
                    "image/images column; give one image per image item"
                )
            text = self.processor.apply_chat_template(
                list(prompt), tokenize=False, add_generation_prompt=True, **self.template_kwargs
            )
        encoded = self.processor(text=[text], images=[images] if images else None, return_tensors="pt")
        ids = encoded["input_ids"][0].tolist()
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            raise PromptTooLongError(
                f"{where} is {len(ids)} tokens long with its images, over max_prompt_length={self.max_prompt_length}; "
                "raise max_prompt_length (prompts with images are never cut)"
            )
        return PromptIds(ids, MultimodalInputs.from_processor(encoded))


class MultimodalCache:
    """The encoded prompts of recent prompt indices, encoded again from the data when evicted
    (or after a resume): encoding is deterministic, so every pass sees the same tensors.

    Args:
        encode: a prompt index -> its :class:`~grpo_plugins.multimodal.PromptIds`.
        size: the most prompts kept.
    """

    def __init__(self, encode: Callable[[int], PromptIds], size: int = 4096) -> None:
        self.encode, self.size = encode, size
        self._kept: OrderedDict[int, PromptIds] = OrderedDict()

    def __call__(self, index: int) -> PromptIds:
        found = self._kept.get(index)
        if found is None:
            found = self._kept[index] = self.encode(index)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(index)
        return found

    def inputs(self, indices: Sequence[int]) -> list[MultimodalInputs | None]:
        """The image inputs of each prompt index (None for a negative index: no prompt)."""
        return [self(i).multimodal if i >= 0 else None for i in indices]
