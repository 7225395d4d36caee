"""The static generator on prompts with images: the vision-language model's own forward fills
the static cache and the compiled-graph loop decodes with its language model. Greedy tokens equal
transformers' ``generate`` with the same images, the sampled tokens' log-probs equal the training
pass's, and image placeholders are never sampled (tiny random Qwen2-VL with sectioned M-RoPE
positions, and Idefics3 with a Llama decoder; float32 on CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from grpo_plugins.data import left_pad
from grpo_plugins.generators.static_cache import StaticCacheGenerator
from grpo_plugins.generators.transformers_backend import TransformersGenerator
from grpo_plugins.image_prompts import ImagePromptEncoder
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.logprobs import completion_logps
from grpo_plugins.multimodal import collate, multimodal_of, placeholder_token_ids
from grpo_plugins.testing.tiny_vision import VISION_ARCHS, build_tiny_vlm, tiny_image

PROMPTS = [
    ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}], [tiny_image(0)]),
    ([{"role": "user", "content": "Colour?"}], [tiny_image(1, side=24)]),
    ([{"role": "user", "content": [{"type": "text", "text": "Two:"}, {"type": "image"}, {"type": "image"}]}],
     [tiny_image(2), tiny_image(3, side=12)]),
    ([{"role": "user", "content": "No image here."}], []),
]


def _encoded(arch: str) -> tuple[Any, Any, list[Any]]:
    model, processor = build_tiny_vlm(arch, seed=1)
    encoder = ImagePromptEncoder(processor, max_prompt_length=None)
    return model, processor, [encoder.encode(p, images) for p, images in PROMPTS]


def _generate(generator: Any, model: Any, processor: Any, prompt_ids: list[Any], sampling: SamplingSettings) -> Any:
    generator.setup(model, processor.tokenizer, sampling)
    return generator.generate(prompt_ids)


@pytest.mark.parametrize("arch", VISION_ARCHS)
def test_greedy_tokens_equal_transformers_generate_with_the_images(arch: str) -> None:
    model, processor, prompt_ids = _encoded(arch)
    greedy = SamplingSettings(max_completion_length=12, top_k=1, seed=0)
    static = _generate(StaticCacheGenerator(StaticCacheGenerator.Params(compile=False)), model, processor, prompt_ids, greedy)
    reference = _generate(TransformersGenerator(), model, processor, prompt_ids, greedy)
    assert static.completion_ids.shape[1] >= 6
    torch.testing.assert_close(static.completion_mask, reference.completion_mask, rtol=0, atol=0)
    assert torch.equal(static.completion_ids, reference.completion_ids)
    # The same prompts without their images decode differently: the pictures are read.
    text_only = [list(p) for p in prompt_ids]
    blind = _generate(StaticCacheGenerator(StaticCacheGenerator.Params(compile=False)), model, processor, text_only, greedy)
    assert not torch.equal(blind.completion_ids[:3], static.completion_ids[:3])
    # A batch of text prompts only takes the static prefill (sectioned positions all equal).
    encoder = ImagePromptEncoder(processor, max_prompt_length=None)
    texts = [encoder.encode([{"role": "user", "content": t}], []) for t in ("No image here.", "Hi", "Count to three, please.")]
    static_text = _generate(StaticCacheGenerator(StaticCacheGenerator.Params(compile=False)), model, processor, texts, greedy)
    reference_text = _generate(TransformersGenerator(), model, processor, texts, greedy)
    assert torch.equal(static_text.completion_ids, reference_text.completion_ids)


@pytest.mark.parametrize("arch", VISION_ARCHS)
def test_sampled_log_probs_equal_the_training_pass_and_no_placeholder_is_sampled(arch: str) -> None:
    model, processor, prompt_ids = _encoded(arch)
    sampling = SamplingSettings(max_completion_length=10, temperature=1.0, seed=3)
    out = _generate(StaticCacheGenerator(StaticCacheGenerator.Params(compile=False)), model, processor, prompt_ids, sampling)
    placeholders = torch.tensor(placeholder_token_ids(model.config))
    assert not torch.isin(out.completion_ids, placeholders).any()
    prompt_tensor, prompt_mask = left_pad(prompt_ids, processor.tokenizer.pad_token_id)
    ids = torch.cat([prompt_tensor, out.completion_ids], dim=1)
    att = torch.cat([prompt_mask, out.completion_mask], dim=1)
    T = out.completion_ids.shape[1]
    inputs = collate([multimodal_of(p) for p in prompt_ids], ids, ids.shape[1] - T)
    with torch.no_grad():
        logps, _ = completion_logps(model, ids, att, T, inputs=inputs)
    mask = out.completion_mask.bool()
    assert mask.sum() > 10
    torch.testing.assert_close(logps[mask], out.sampling_logps[mask], rtol=0, atol=5e-5)


@pytest.mark.parametrize("arch", VISION_ARCHS)
def test_a_lora_model_decodes_from_merged_weights_with_the_training_pass_log_probs(arch: str) -> None:
    from peft import LoraConfig, get_peft_model

    model, processor, prompt_ids = _encoded(arch)
    targets = r".*(language_model|text_model)\.layers\.\d+\.(self_attn|mlp)\.\w+_proj"
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    generator = StaticCacheGenerator(StaticCacheGenerator.Params(compile=False))
    out = _generate(generator, model, processor, prompt_ids, SamplingSettings(max_completion_length=10, seed=4))
    assert generator._decoder is not None and generator._decoder.merge_weights  # merged copies, adapters folded in
    prompt_tensor, prompt_mask = left_pad(prompt_ids, processor.tokenizer.pad_token_id)
    ids = torch.cat([prompt_tensor, out.completion_ids], dim=1)
    att = torch.cat([prompt_mask, out.completion_mask], dim=1)
    T = out.completion_ids.shape[1]
    with torch.no_grad():
        logps, _ = completion_logps(model, ids, att, T, inputs=collate([multimodal_of(p) for p in prompt_ids], ids, ids.shape[1] - T))
    mask = out.completion_mask.bool()
    torch.testing.assert_close(logps[mask], out.sampling_logps[mask], rtol=0, atol=5e-5)
