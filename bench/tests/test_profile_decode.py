"""bench/profile_decode.py's candidate decode attentions compute what the shipped decode layer
computes (tiny random Llama and Qwen2 layers, float32, eager on a CPU), so a timing of them on a
GPU compares like with like."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_plugins.generators.static_layers import check_supported
from grpo_plugins.generators.static_steps import decode_layer
from grpo_plugins.models import load_model
from grpo_plugins.testing.tiny import tiny_model_spec


@pytest.mark.parametrize("name", ["sdpa", "flex", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_candidate_layers_equal_the_shipped_decode_layer(name: str, arch: str, tmp_path: Path) -> None:
    import bench.profile_decode as profile

    model, _ = load_model(tiny_model_spec(tmp_path / arch, arch), dtype="float32", seed=0)
    parts = check_supported(model)
    layer = parts.layers[0]
    B, S, W, cur = 3, 24, 16, 11
    torch.manual_seed(0)
    h = torch.randn(B, 1, model.config.hidden_size)
    cos, sin = parts.rotary(h, torch.tensor([[cur], [cur - 2], [cur - 5]]))
    k_cache = torch.randn(B, parts.num_kv_heads, S, parts.head_dim)
    v_cache = torch.randn(B, parts.num_kv_heads, S, parts.head_dim)
    valid = (torch.arange(W) <= cur) & (torch.arange(W)[None] >= torch.tensor([[0], [2], [5]]))  # (B, W) left padding
    bias = torch.zeros(B, W).masked_fill(~valid, float("-inf"))[:, None, None, :]
    index = torch.tensor([cur])
    with torch.no_grad():
        expected = decode_layer(parts, layer, h, cos, sin, k_cache.clone(), v_cache.clone(), bias, index)
        k2, v2 = k_cache.clone(), v_cache.clone()
        got = profile.LAYERS[name](parts, layer, h, cos, sin, k2, v2, bias, index)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(k2[:, :, cur], k_cache[:, :, cur])  # the new key was written


def test_the_outside_decode_timing_splits_a_generate_and_restores_the_decoder(tmp_path: Path) -> None:
    import bench.profile_decode as profile
    import grpo_plugins.generators.static_decode as static_decode

    model, _ = load_model(tiny_model_spec(tmp_path / "qwen2", "qwen2"), dtype="float32", seed=0)
    dec = profile._decoder(model, 4, {"merge_weights": True})  # uncompiled on a CPU
    prefill, decode_parts = static_decode.prefill_distinct, dec._decode_parts
    spent = profile._time_outside_decode(dec, [[5, 6, 7], [8, 9]])
    assert 0 < spent["prefill_s"] < spent["generate_s"]
    assert 0 < spent["refresh_weights_s"] < spent["generate_s"]
    assert static_decode.prefill_distinct is prefill and dec._decode_parts == decode_parts


ATTENTION_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from bench.decode_attention import decode_attention, reference_attention
torch.manual_seed(0)
# float32 (the interpreter has no bfloat16); windows of a larger cache, as the decode layer passes them
for B, Hkv, G, D, S, W in [(3, 2, 6, 64, 200, 130), (2, 4, 7, 128, 80, 64), (1, 1, 16, 32, 40, 17)]:
    q = torch.randn(B, Hkv, G, D)
    k_all, v_all = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    bias = torch.zeros(B, W)
    bias[0, :70 % W] = float("-inf")  # a left-padded row: its first block can be all masked
    bias[:, -3:] = float("-inf")  # slots not written yet
    got = decode_attention(q, k_all[:, :, :W], v_all[:, :, :W], bias, 0.125)
    want = reference_attention(q, k_all[:, :, :W], v_all[:, :, :W], bias, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_the_triton_decode_attention_under_the_interpreter_equals_the_reference() -> None:
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="Triton is not installed (CPU-only torch); the GPU benchmark runs the kernel")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", ATTENTION_CHECK, str(root)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
