"""Tiny random vision-language models and their processors for tests: no network, no hub.

Two architectures, both built from transformers configs in code:

* ``qwen2_vl``: :class:`~transformers.Qwen2VLForConditionalGeneration` (a ViT over flattened
  patches, M-RoPE); its processor emits ``pixel_values`` (patches, D), ``image_grid_thw`` and
  ``mm_token_type_ids``.
* ``idefics3``: :class:`~transformers.Idefics3ForConditionalGeneration` (a SigLIP encoder and a
  Llama decoder, as SmolVLM); its processor emits ``pixel_values`` (B, images, C, H, W) and
  ``pixel_attention_mask``.

The tokenizer is the character-level one of :mod:`grpo_plugins.testing.tiny` with the image
tokens added; images are processed by the models' own (PIL) image processors at 16 x 16 pixels,
so an image costs 4 tokens. :func:`build_tiny_vlm` returns (model, processor);
:func:`save_tiny_vlm` writes both to a directory that ``model:`` can name (``idefics3`` only:
the Qwen2-VL processor saved by transformers needs torchvision's video processor to load).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from grpo_plugins.testing.tiny import build_tiny_tokenizer

__all__ = ["VISION_ARCHS", "build_tiny_processor", "build_tiny_vlm", "save_tiny_vlm", "tiny_image", "tiny_vlm_config"]

#: The architectures :func:`build_tiny_vlm` builds.
VISION_ARCHS = ("qwen2_vl", "idefics3")

#: Image pixels per side the tiny image processors resize to.
IMAGE_SIDE = 16

_QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
_IDEFICS_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]


def _template(image: str) -> str:
    """A chat template rendering string contents and TRL-style content lists (``{"type": "image"}``
    becomes ``image``)."""
    return (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for c in m['content'] %}{% if c['type'] == 'image' %}" + image + "{% elif c['type'] == 'text' %}"
        "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


def _tokenizer(extra: list[str]) -> Any:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(str(build_tiny_tokenizer(Path(tmp) / "tok")))
    tokenizer.add_tokens(extra, special_tokens=True)
    tokenizer.padding_side = "left"
    return tokenizer


def _qwen2_vl_processor_class() -> type:
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2-VL's processor without its video processor (which needs torchvision)."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2VLProcessor


def build_tiny_processor(arch: str = "qwen2_vl") -> Any:
    """The processor (tokenizer + image processor + chat template) of a tiny ``arch`` model."""
    if arch == "qwen2_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil(
            patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=IMAGE_SIDE**2, max_pixels=IMAGE_SIDE**2
        )
        tokenizer = _tokenizer(_QWEN_TOKENS)
        return _qwen2_vl_processor_class()(
            image_processor, tokenizer, chat_template=_template("<|vision_start|><|image_pad|><|vision_end|>")
        )
    if arch == "idefics3":
        from transformers import Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        image_processor = Idefics3ImageProcessorPil(
            do_image_splitting=False,
            size={"longest_edge": IMAGE_SIDE},
            max_image_size={"longest_edge": IMAGE_SIDE},
        )
        tokenizer = _tokenizer(_IDEFICS_TOKENS)
        return Idefics3Processor(image_processor, tokenizer, image_seq_len=4, chat_template=_template("<image>"))
    raise ValueError(f"unknown tiny vision architecture '{arch}' ({' or '.join(VISION_ARCHS)})")


def _text_config(vocab_size: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }


def tiny_vlm_config(arch: str, processor: Any) -> Any:
    """The transformers config of a tiny random ``arch`` model matching ``processor``'s tokens."""
    tok = processor.tokenizer
    text = _text_config(len(tok))
    if arch == "qwen2_vl":
        from transformers import Qwen2VLConfig

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
        return Qwen2VLConfig(
            text_config=text,
            vision_config={
                "depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2,
                "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
            },
            image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
            vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
            tie_word_embeddings=False,
        )
    if arch == "idefics3":
        from transformers import Idefics3Config

        text.update(model_type="llama")
        return Idefics3Config(
            text_config=text,
            vision_config={
                "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                "image_size": IMAGE_SIDE, "patch_size": 4,
            },
            image_token_id=tok.convert_tokens_to_ids("<image>"),
            scale_factor=2,
            pad_token_id=0,
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown tiny vision architecture '{arch}' ({' or '.join(VISION_ARCHS)})")


def build_tiny_vlm(arch: str = "qwen2_vl", seed: int = 0, dtype: Any = None) -> tuple[Any, Any]:
    """(model, processor) of a tiny random ``arch`` vision-language model, seeded, in eval mode."""
    import torch
    from transformers import AutoModelForImageTextToText

    processor = build_tiny_processor(arch)
    config = tiny_vlm_config(arch, processor)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype or torch.float32)
    return model.eval(), processor


def save_tiny_vlm(directory: str | Path, arch: str = "idefics3", seed: int = 0) -> Path:
    """Write a tiny random ``arch`` model and its processor to ``directory`` (a ``model:`` folder)."""
    if arch != "idefics3":
        raise ValueError("save_tiny_vlm writes idefics3 only (Qwen2-VL's saved processor needs torchvision)")
    model, processor = build_tiny_vlm(arch, seed)
    directory = Path(directory)
    model.save_pretrained(str(directory))
    processor.save_pretrained(str(directory))
    return directory


def tiny_image(seed: int, side: int = IMAGE_SIDE) -> Any:
    """A small seeded random RGB ``PIL.Image``."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")
