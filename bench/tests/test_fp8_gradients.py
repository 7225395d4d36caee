"""bench/fp8_gradients.py on a tiny random model: float32 arithmetic leaves the gradient of a
float32 model as it is, a float8 base turns it, and leaving layers 16-bit brings it back."""

from __future__ import annotations

from pathlib import Path

from bench import fp8_gradients
from grpo_plugins.models import load_model, load_tokenizer
from grpo_plugins.testing import tiny_model_spec


def test_a_float8_base_turns_the_lora_gradient_and_16_bit_layers_undo_it(tmp_path: Path) -> None:
    spec = tiny_model_spec(tmp_path, "qwen2")
    model, _ = load_model(spec, dtype="float32", lora={"r": 4, "target_modules": "all-linear"}, seed=0)
    tokenizer = load_tokenizer(spec["tokenizer"])
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(std=0.05)
    texts = ["abcde", "abc", "abcdabcd", "ab"]
    results = fp8_gradients.measure(model, tokenizer, texts, list(fp8_gradients.VARIANTS), seed=0)
    assert results["float32"]["cosine"] > 0.99999  # the model is float32 already
    assert 0.5 < results["fp8"]["cosine"] < 0.9999 and 0.5 < results["fp8"]["norm_ratio"] < 2.0
    assert results["fp8-mlp16"]["cosine"] > results["fp8"]["cosine"]
    blocks = results["fp8"]["mean_cosine_per_parameter"]
    assert blocks and all(-1.0 <= v <= 1.0 for v in blocks.values())
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())  # untouched
