"""Vision-language (image-text-to-text) models: telling them from text models, loading them
with their processor (``AutoModelForImageTextToText`` + ``AutoProcessor``), and which of their
modules train.

A model is a vision-language model when its config has a ``vision_config``. By default only its
language model trains: LoRA adapters go on the language model's layers, and full fine-tuning
freezes the vision encoder and its projector; ``train_vision_tower: true`` trains them too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "config_is_vision",
    "is_processor",
    "is_vision_model",
    "load_processor",
    "local_config_is_vision",
    "split_processor",
    "vision_module_names",
    "vision_module_pattern",
]


def config_is_vision(config: Any) -> bool:
    """Whether a transformers config (or its dict) is a vision-language model's."""
    if isinstance(config, Mapping):
        return config.get("vision_config") is not None
    return getattr(config, "vision_config", None) is not None


def is_vision_model(model: Any) -> bool:
    """Whether ``model`` (peft-wrapped or not) is a vision-language model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return config_is_vision(getattr(base, "config", None))


def local_config_is_vision(source: str) -> bool | None:
    """Whether the model at ``source`` (a local directory, or a hub id in the local cache) is a
    vision-language model, read from its ``config.json`` without loading it; None when unknown."""
    path = Path(source).expanduser() / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(source, "config.json")
        except Exception:  # noqa: BLE001 - not a valid hub id either: unknown
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        return config_is_vision(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError):
        return None


def is_processor(obj: Any) -> bool:
    """Whether ``obj`` is a multimodal processor (a tokenizer plus an image processor)."""
    return hasattr(obj, "tokenizer") and hasattr(obj, "image_processor")


def split_processor(obj: Any) -> tuple[Any, Any]:
    """(tokenizer, processor or None) of a tokenizer or a processor."""
    return (obj.tokenizer, obj) if is_processor(obj) else (obj, None)


def load_processor(source: str, *, local: bool, trust_remote_code: bool = False) -> Any:
    """The processor of a vision-language model (its tokenizer's padding goes left)."""
    from transformers import AutoProcessor

    from grpo_plugins.errors import ModelLoadError

    try:
        processor = AutoProcessor.from_pretrained(source, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"cannot load the processor of the vision-language model '{source}': {exc}") from exc
    if not is_processor(processor):
        raise ModelLoadError(
            f"'{source}' is a vision-language model but its folder has no image processor "
            "(preprocessor_config.json); copy the model's full processor files there"
        )
    return processor


def vision_module_names(model: Any) -> list[str]:
    """Qualified names of a vision-language model's vision side: the children of its multimodal
    body other than the language model (the vision encoder and the projector)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder()
    prefix = {id(m): n for n, m in model.named_modules()}
    body = base.model
    return [prefix[id(child)] for _, child in body.named_children() if child is not decoder and id(child) in prefix]


def vision_module_pattern(model: Any) -> str:
    """A regular expression matching the names of every module of the vision side (for peft's
    ``exclude_modules``)."""
    import re

    names = vision_module_names(model)
    return r"^(" + "|".join(re.escape(n) for n in names) + r")(\..*)?$"


def freeze_vision(model: Any) -> int:
    """Freeze the vision side's parameters; returns how many were frozen."""
    frozen = 0
    modules = dict(model.named_modules())
    for name in vision_module_names(model):
        for p in modules[name].parameters():
            if p.requires_grad:
                p.requires_grad_(False)
                frozen += 1
    return frozen
