"""Vision-language models, below the engine: prompts with images are encoded by the processor,
sampled by the transformers generator with their images, and the training pass's log-probs of
the sampled tokens equal an independent forward of each row alone, the sampler's own log-probs,
and themselves when the rows are split into passes by length (tiny random Qwen2-VL and Idefics3,
float32 on CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from grpo_plugins.data import left_pad
from grpo_plugins.generators.transformers_backend import TransformersGenerator
from grpo_plugins.image_prompts import ImagePromptEncoder
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.logprobs import completion_logps
from grpo_plugins.multimodal import collate, multimodal_of, placeholder_token_ids
from grpo_plugins.objective import compute_loss
from grpo_plugins.policy import plan_passes
from grpo_plugins.testing.tiny_vision import VISION_ARCHS, build_tiny_vlm, tiny_image

#: Prompts of different lengths, with images of different sizes (Qwen2-VL: different token counts).
PROMPTS = [
    ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}], [tiny_image(0)]),
    ([{"role": "user", "content": "Colour?"}], [tiny_image(1, side=24)]),  # TRL adds the image item
    ([{"role": "user", "content": [{"type": "text", "text": "Two:"}, {"type": "image"}, {"type": "image"}]}],
     [tiny_image(2), tiny_image(3, side=12)]),
]


@pytest.fixture(scope="module", params=VISION_ARCHS)
def sampled(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A tiny VLM, its encoded prompts and one sampled completion per prompt."""
    model, processor = build_tiny_vlm(request.param, seed=1)
    encoder = ImagePromptEncoder(processor, max_prompt_length=None)
    prompt_ids = [encoder.encode(p, images) for p, images in PROMPTS]
    generator = TransformersGenerator()
    generator.setup(model, processor.tokenizer, SamplingSettings(max_completion_length=8, seed=5))
    out = generator.generate(prompt_ids)
    pad = processor.tokenizer.pad_token_id
    prompt_tensor, prompt_mask = left_pad(prompt_ids, pad)
    return {
        "arch": request.param, "model": model, "processor": processor, "prompt_ids": prompt_ids, "out": out,
        "input_ids": torch.cat([prompt_tensor, out.completion_ids], dim=1),
        "attention_mask": torch.cat([prompt_mask, out.completion_mask], dim=1),
    }


def _row_reference(model: Any, prompt_ids: Any, completion: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``completion`` after one prompt alone, from the model's own full forward
    (its logits, the image placeholders left out as the generator leaves them out)."""
    ids = torch.tensor([list(prompt_ids) + completion.tolist()])
    inputs = collate([multimodal_of(prompt_ids)], ids, len(prompt_ids))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits[0].float()
    logits[:, placeholder_token_ids(model.config)] = float("-inf")
    logps = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return logps.gather(-1, completion.unsqueeze(-1)).squeeze(-1)


def _pass_logps(s: dict[str, Any], ids: torch.Tensor, att: torch.Tensor, t: int, rows: list[int]) -> torch.Tensor:
    items = [multimodal_of(s["prompt_ids"][r]) for r in rows]
    with torch.no_grad():
        logps, _ = completion_logps(s["model"], ids, att, t, inputs=collate(items, ids, ids.shape[1] - t))
    return logps


def test_the_processor_makes_ids_and_image_tensors_for_each_prompt(sampled: dict[str, Any]) -> None:
    image_token = sampled["model"].config.image_token_id
    counts = [list(p).count(image_token) for p in sampled["prompt_ids"]]
    assert counts[0] > 0 and counts[2] > counts[0]  # two images cost more tokens than one
    inputs = multimodal_of(sampled["prompt_ids"][2])
    assert inputs is not None and "pixel_values" in inputs.images
    if sampled["arch"] == "qwen2_vl":
        assert inputs.images["image_grid_thw"].shape == (2, 3)
        assert inputs.tokens["mm_token_type_ids"].sum() == counts[2]  # one per image token
    else:
        assert inputs.images["pixel_values"].shape[:2] == (1, 2)  # (prompt, images, C, H, W)
        assert "pixel_attention_mask" in inputs.images


def test_training_pass_log_probs_equal_each_row_alone_and_the_sampler(sampled: dict[str, Any]) -> None:
    out, T = sampled["out"], sampled["out"].completion_ids.shape[1]
    assert not torch.isin(out.completion_ids, torch.tensor(placeholder_token_ids(sampled["model"].config))).any()
    logps = _pass_logps(sampled, sampled["input_ids"], sampled["attention_mask"], T, [0, 1, 2])  # (3, T)
    mask = out.completion_mask.bool()
    assert mask.sum() > 6
    for row, prompt_ids in enumerate(sampled["prompt_ids"]):
        n = int(mask[row].sum())
        reference = _row_reference(sampled["model"], prompt_ids, out.completion_ids[row, :n])
        torch.testing.assert_close(logps[row, :n], reference, rtol=0, atol=2e-5)
    torch.testing.assert_close(logps[mask], out.sampling_logps[mask], rtol=0, atol=5e-5)


def test_passes_split_by_length_see_the_same_log_probs(sampled: dict[str, Any]) -> None:
    ids, att, T = sampled["input_ids"], sampled["attention_mask"], sampled["out"].completion_ids.shape[1]
    whole = _pass_logps(sampled, ids, att, T, [0, 1, 2])
    passes = plan_passes(ids, att, T, multiple=1, chunk_rows=1, split=True)
    assert len(passes.chunks) == 3
    mask = sampled["out"].completion_mask.bool()
    for c in passes.chunks:
        chunk_ids, chunk_att, w = passes.pass_inputs(c, 1)
        rows = passes.rows_of([0, 1, 2], c)
        got = _pass_logps(sampled, chunk_ids, chunk_att, w, rows)
        for k, row in enumerate(rows):
            n = int(mask[row].sum())
            torch.testing.assert_close(got[k, :n], whole[row, :n], rtol=0, atol=2e-5)


def test_the_loss_is_compute_loss_of_the_pass_and_its_ratio_is_one(sampled: dict[str, Any]) -> None:
    model, T = sampled["model"], sampled["out"].completion_ids.shape[1]
    mask = sampled["out"].completion_mask.float()
    advantages = torch.tensor([1.0, -0.5, -0.5])
    items = [multimodal_of(p) for p in sampled["prompt_ids"]]
    ids, att = sampled["input_ids"], sampled["attention_mask"]
    old = _pass_logps(sampled, ids, att, T, [0, 1, 2])
    logps, _ = completion_logps(model, ids, att, T, inputs=collate(items, ids, ids.shape[1] - T))
    assert torch.equal(logps.detach(), old)  # the importance ratio is exactly 1 on-policy
    loss, metrics = compute_loss(logps, old, advantages, mask)
    references = [
        _row_reference(model, p, sampled["out"].completion_ids[r, : int(mask[r].sum())])
        for r, p in enumerate(sampled["prompt_ids"])
    ]
    ref_logps = torch.zeros_like(old)
    for r, values in enumerate(references):
        ref_logps[r, : values.shape[0]] = values
    expected, _ = compute_loss(ref_logps, ref_logps, advantages, mask)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)
    loss.backward()
    language = [p.grad for n, p in model.named_parameters() if "lm_head" in n]
    assert language and language[0] is not None and language[0].abs().sum() > 0
    model.zero_grad()
