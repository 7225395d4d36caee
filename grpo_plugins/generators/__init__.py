"""Generation backends shipped with the core, registered through the grpo_plugins entry point
(``builtin_generators``), exactly as a third party registers its own.

Kept free of top-level torch/transformers imports: the registry imports this module when it
loads plugins, and ``grpo-plugins validate`` must start fast.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Any

from grpo_plugins.config import ComponentRef, GRPOConfig, component_ref
from grpo_plugins.errors import GRPOPluginsError
from grpo_plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from grpo_plugins.kinds import Generator
    from grpo_plugins.registry import Registry

logger = logging.getLogger(__name__)


class GeneratorUnavailableError(GRPOPluginsError):
    """The generation backend a run asks for cannot be used on this machine."""


def vllm_available() -> bool:
    """Whether vLLM is installed (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def generator_ref(config: GRPOConfig, *, vision: bool = False) -> ComponentRef:
    """The generator a run uses: ``config.generator`` when set, else ``vllm`` with
    ``fast_inference`` (which needs vLLM installed), else ``static`` (on a GPU about 12x faster
    than ``model.generate``, on a 2-core CPU about 1.6x; see bench/RESULTS.md and
    docs/quickstart.md) -- but ``transformers`` for a vision-language model (``vision``) and
    with ``generation_kwargs``, which only it takes."""
    if config.generator is None and config.fast_inference and not vllm_available():
        raise GeneratorUnavailableError(
            "fast_inference: true selects the vllm generator, but vLLM is not installed here; "
            "install it (pip install 'grpo-plugins[vllm]', GPU only) or set fast_inference: false"
        )
    if config.generator is None and not config.fast_inference and not vision and not config.generation_kwargs:
        return ComponentRef(name="static")
    ref = component_ref(config.resolved_generator)  # the config's own choice, in one place
    assert ref is not None
    return ref


def build_generator(
    config: GRPOConfig, registry: Registry, model: Any, tokenizer: Any, device: Any, vision: bool = False
) -> Generator:
    """The run's generator (:func:`generator_ref`), built from ``registry`` and set up with the
    model being trained and the config's sampling parameters. ``vision``: the model is a
    vision-language model, so the generator must accept prompts with images
    (``accepts_images``)."""
    from grpo_plugins.kinds import SamplingSettings

    ref = generator_ref(config, vision=vision)
    if config.generator is None and not config.fast_inference and not vision and config.generation_kwargs:
        logger.warning(
            "generation_kwargs are set, so this run generates with 'transformers' (model.generate) "
            "instead of the faster 'static' generator, which takes none; drop them for speed"
        )
    generator = registry.build("generator", ref.name, ref.params)
    if vision and not getattr(generator, "accepts_images", False):
        raise GRPOPluginsError(image_generator_problem(ref.name))
    if config.generation_kwargs and not getattr(generator, "accepts_generation_kwargs", False):
        raise GRPOPluginsError(
            f"generation_kwargs are not supported by the '{ref.name}' generator; use generator: transformers "
            "or vllm, or remove generation_kwargs"
        )
    generator.registry = registry  # a backend that falls back to another builds it from here
    generator.setup(
        model,
        tokenizer,
        SamplingSettings(
            max_completion_length=config.max_completion_length,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            min_p=config.min_p,
            repetition_penalty=config.repetition_penalty,
            seed=None,  # sampling uses the global RNG, which checkpoints save and restore
            extra=dict(config.generation_kwargs or {}),
        ),
    )
    return generator


def image_generator_problem(name: str) -> str:
    """Why the generator ``name`` cannot run a vision-language model's prompts."""
    return (
        f"generator '{name}' does not support prompts with images yet (a vision-language model); "
        "use generator: transformers (the default for these models) and fast_inference: false"
    )


@hookimpl
def register_generators(register: Any) -> None:
    from grpo_plugins.generators.transformers_backend import TransformersGenerator
    from grpo_plugins.generators.vllm_backend import VLLMGenerator
    from grpo_plugins.generators.static_cache import StaticCacheGenerator

    register(TransformersGenerator, name="transformers")
    register(VLLMGenerator, name="vllm")
    register(StaticCacheGenerator, name="static")
