"""bench/fp8_mismatch.py on a tiny random model: the float8 samplers are measurably further from
the policy than the 16-bit decode copies, and the weight-only emulation is undone afterwards."""

from __future__ import annotations

from pathlib import Path

import torch

from bench import fp8_mismatch
from grpo_plugins.generators.static_layers import FusedLinear
from grpo_plugins.models import load_model, load_tokenizer
from grpo_plugins.testing import tiny_model_spec


def test_float8_samplers_are_further_from_the_policy_than_16_bit_copies(tmp_path: Path) -> None:
    spec = tiny_model_spec(tmp_path, "qwen2")
    model, _ = load_model(spec, dtype="float32", lora={"r": 4, "target_modules": "all-linear"}, seed=0)
    tokenizer = load_tokenizer(spec["tokenizer"])
    model.eval()
    prompts = [tokenizer("abcde"[: 2 + i % 3])["input_ids"] for i in range(6)]
    fp8_mismatch.set_lora_b(model, 0.05)
    exact = fp8_mismatch.mismatch(model, tokenizer, prompts, 8, fp8=False, seed=0)
    float8 = fp8_mismatch.mismatch(model, tokenizer, prompts, 8, fp8=True, seed=0)
    forward = FusedLinear.forward
    with fp8_mismatch.weight_only_float8():
        assert FusedLinear.forward is not forward
        weights_only = fp8_mismatch.mismatch(model, tokenizer, prompts, 8, fp8=True, seed=0)
    assert FusedLinear.forward is forward
    assert exact["tokens"] > 0 and exact["mean"] < 1e-4  # float32 copies: the policy itself
    assert float8["mean"] > 100 * max(exact["mean"], 1e-7) and weights_only["mean"] > 100 * max(exact["mean"], 1e-7)
    assert torch.isfinite(torch.tensor([float8["max"], weights_only["max"]])).all()
