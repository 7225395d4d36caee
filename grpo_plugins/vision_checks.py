"""What ``grpo-plugins validate`` checks about images, without loading a model: a dataset with
an ``image``/``images`` column needs a vision-language model, and a vision-language model needs
its processor files, a generator that takes images, a single-turn environment and no evaluation
during training (not supported for it yet). Nothing here imports torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_plugins.config import GRPOConfig, ModelSpec

__all__ = ["model_is_vision", "vision_problems"]

#: Files that hold a processor's image settings.
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _model_source(model: str | ModelSpec) -> tuple[str | None, str]:
    """(model folder or hub id, the config key naming it)."""
    if isinstance(model, str):
        return model, "model"
    return model.name_or_path, "model.name_or_path"


def model_is_vision(model: str | ModelSpec) -> bool | None:
    """Whether the run's model is a vision-language model (its config has a ``vision_config``);
    None when that cannot be told without loading it."""
    from grpo_plugins.gguf_import import BUILTIN_PREFIX
    from grpo_plugins.vision_models import config_is_vision, local_config_is_vision

    if isinstance(model, ModelSpec) and model.config is not None:
        data = model.config
        if isinstance(data, str):
            try:
                data = json.loads(Path(data).expanduser().read_text())
            except (OSError, json.JSONDecodeError):
                return None
        return config_is_vision(data)
    source, _ = _model_source(model)
    if source is None:
        return None
    if source.startswith(BUILTIN_PREFIX) or source.lower().endswith(".gguf"):
        return False
    return local_config_is_vision(source)


def _processor_problem(model: str | ModelSpec) -> tuple[str, str] | None:
    """A local vision-language model folder (or its ``model.tokenizer`` folder) without its image
    processor's settings."""
    source, key = _model_source(model)
    if isinstance(model, ModelSpec) and model.tokenizer is not None:
        source, key = model.tokenizer, "model.tokenizer"
    if source is None or not Path(source).expanduser().is_dir():
        return None
    folder = Path(source).expanduser()
    if any((folder / name).is_file() for name in _PROCESSOR_FILES):
        return None
    return (
        key,
        f"'{source}' is for a vision-language model but has no processor settings ({' or '.join(_PROCESSOR_FILES)}); "
        "copy the model's processor files there (AutoProcessor.save_pretrained)",
    )


def vision_problems(config: GRPOConfig, columns: list[str] | None, components: dict[str, Any]) -> list[tuple[str, str]]:
    """The image problems of ``config``: (field, message) pairs. ``columns``: the dataset's
    columns when known; ``components``: the resolved components by config field."""
    from grpo_plugins.generators import GeneratorUnavailableError, generator_ref, image_generator_problem
    from grpo_plugins.image_prompts import IMAGE_COLUMNS, has_image_column

    vision = model_is_vision(config.model)
    problems: list[tuple[str, str]] = []
    if vision is False and columns is not None and has_image_column(columns):
        column = next(c for c in IMAGE_COLUMNS if c in columns)
        source, key = _model_source(config.model)
        what = f"model '{source}'" if source else "the model"
        problems.append((
            "dataset",
            f"the dataset's '{column}' column holds images, but {what} is a text-only model (its config has no "
            f"vision_config); use a vision-language model ({key}) or drop the '{column}' column",
        ))
    if not vision:
        return problems
    processor = _processor_problem(config.model)
    if processor is not None:
        problems.append(processor)
    try:
        ref = generator_ref(config, vision=True)
    except GeneratorUnavailableError:
        ref = None  # reported as fast_inference's problem
    if ref is not None and ref.name != "transformers":
        generator = components.get("generator")
        if generator is None or not getattr(generator.obj, "accepts_images", False):
            key = "generator" if config.generator is not None else "fast_inference"
            problems.append((key, image_generator_problem(ref.name)))
    environment = components.get("environment")
    if environment is not None:
        from grpo_plugins.episodes import TurnBasedEnvironment

        if isinstance(environment.obj, type) and issubclass(environment.obj, TurnBasedEnvironment):
            problems.append((
                "environment",
                "multi-turn environments do not support vision-language models yet; use environment: single_turn",
            ))
    if config.eval_strategy != "no":
        problems.append(("eval_strategy", "evaluating a vision-language model is not supported yet; set eval_strategy: no"))
    return problems
