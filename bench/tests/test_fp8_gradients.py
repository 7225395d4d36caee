"""bench/fp8_gradients.py on a tiny random model: a float32 model's gradient is unchanged by
float32 arithmetic and changed by a float8 base; putting 16-bit layers back restores it."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from bench import fp8_gradients
from grpo_plugins.fp8_base import Float8Linear, float8_base
from grpo_plugins.models import load_model, load_tokenizer
from grpo_plugins.testing import tiny_model_spec


def test_a_float8_base_changes_the_lora_gradient_and_16_bit_layers_restore_it(tmp_path: Path) -> None:
    spec = tiny_model_spec(tmp_path, "qwen2")
    model, _ = load_model(spec, dtype="float32", lora={"r": 4, "target_modules": "all-linear"}, seed=0)
    tokenizer = load_tokenizer(spec["tokenizer"])
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(std=0.05)
    texts = ["abcde", "abc", "abcdabcd", "ab"]
    results = fp8_gradients.measure(model, tokenizer, texts, list(fp8_gradients.VARIANTS), seed=0)
    assert results["float32"]["cosine"] > 1 - 1e-6 and abs(results["float32"]["norm_ratio"] - 1) < 1e-5  # float32 already
    for variant in ("fp8", "fp8-mlp16"):  # (the tiny model has fewer than four layers: fp8-first4 is all 16-bit)
        assert 0.5 < results[variant]["cosine"] < 1 - 1e-6, variant  # float8 products change it, a little here
    assert all(-1.0 <= v <= 1.0 for v in results["fp8"]["mean_cosine_per_parameter"].values())
    assert not any(isinstance(m, Float8Linear) for m in model.modules())  # the measured model is untouched

    # keep_16_bit puts back exactly the layers asked for, and all of them give the 16-bit gradient
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    reference = fp8_gradients.lora_gradient(model, batch, advantages)
    mixed = copy.deepcopy(model)
    float8_base(mixed)
    fp8_gradients.keep_16_bit(mixed, model, lambda name: ".mlp." in name)
    kinds = {name: isinstance(m, Float8Linear) for name, m in mixed.named_modules() if isinstance(m, Float8Linear) or type(m) is torch.nn.Linear}
    assert any(kinds.values()) and not any(v for name, v in kinds.items() if ".mlp." in name)
    fp8_gradients.keep_16_bit(mixed, model, lambda name: True)
    restored = fp8_gradients.compare(reference, fp8_gradients.lora_gradient(mixed, batch, advantages))
    assert restored["cosine"] > 1 - 1e-6 and abs(restored["norm_ratio"] - 1) < 1e-5
