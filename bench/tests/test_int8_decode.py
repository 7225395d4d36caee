"""bench/int8_decode.py: the int8-weight product computes ``(x @ w8^T) * scale`` (its Triton
kernel under Triton's CPU interpreter where Triton is installed), and a decoder whose merged
copies were swapped for int8 ones samples log-probs close to the 16-bit decoder's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.int8_decode import Int8WeightLinear, int8_weight_mm, quantize_int8, reference_mm, use_int8_weights
from grpo_plugins.generators.static_decode import StaticDecoder
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model
from grpo_plugins.testing.tiny import tiny_model_spec

ROOT = Path(__file__).resolve().parents[2]


def test_int8_quantisation_is_per_channel_and_close() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.linspace(0.01, 3.0, 40)[:, None]  # rows of very different size
    w8, scale = quantize_int8(w)
    assert w8.dtype == torch.int8 and scale.shape == (40,)
    assert int(w8.abs().amax(dim=1).min()) == 127  # every row uses the full range
    err = (w8.float() * scale[:, None] - w).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-7)  # rounding: half a step per row at most


KERNEL_CHECK = """
import os, sys
sys.path.insert(0, sys.argv[1])
import torch
from bench.int8_decode import int8_weight_mm, quantize_int8, reference_mm
torch.manual_seed(0)
# float32 inputs: the interpreter has no bfloat16 (the GPU runs the same code in bf16)
for M, N, K, programs in [(5, 48, 64, 1), (64, 200, 512, 64), (3, 70, 1000, 8)]:
    x = torch.randn(M, K)
    w8, scale = quantize_int8(torch.randn(N, K))
    got, want = int8_weight_mm(x, w8, scale, programs=programs), reference_mm(x, w8, scale)
    assert got.shape == (M, N)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
x, (w8, scale) = torch.randn(4, 256), quantize_int8(torch.randn(96, 256))
for config in [{"block_n": 32, "block_k": 64, "split": 2}, {"block_n": 128, "block_k": 128, "split": 1}]:  # the sweep's
    torch.testing.assert_close(int8_weight_mm(x, w8, scale, config=config), reference_mm(x, w8, scale), rtol=1e-5, atol=1e-4)
print("ok")
"""


def test_the_triton_kernel_under_the_interpreter_equals_the_reference() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (CPU-only torch); the GPU benchmark runs the kernel")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK, str(ROOT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_decoder_on_int8_copies_samples_near_the_16_bit_log_probs(tmp_path: Path) -> None:
    model, _ = load_model(tiny_model_spec(tmp_path / "qwen2", "qwen2"), dtype="float32", seed=0)
    sampling = SamplingSettings(max_completion_length=6, temperature=1.0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    exact = StaticDecoder(model, sampling, [], 0, prompt_multiple=4, merge_weights=True)
    int8 = StaticDecoder(model, sampling, [], 0, prompt_multiple=4, merge_weights=True)
    int8._decode_parts()
    use_int8_weights(int8._merged)
    assert all(isinstance(layer.mlp.down_proj, Int8WeightLinear) for layer in int8._merged)
    torch.manual_seed(3)
    ids_exact, _, _, logps_exact = exact.generate(prompts)
    torch.manual_seed(3)
    ids_int8, _, _, logps_int8 = int8.generate(prompts)
    same = ids_exact == ids_int8
    assert same[:, 0].all()  # the prefill reads the int8 copies too, and still samples alike
    gap = (logps_exact - logps_int8)[same].abs()
    assert 0 < gap.max() < 0.05  # int8, not a copy of the weights, and close to them
    x = torch.randn(4, model.config.hidden_size)
    layer = int8._merged[0].self_attn.o_proj
    torch.testing.assert_close(layer(x), reference_mm(x, layer.weight, layer.scale) + (0 if layer.bias is None else layer.bias))
    assert int8_weight_mm(x, layer.weight, layer.scale).shape == (4, layer.weight.shape[0])
