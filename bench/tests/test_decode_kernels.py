"""bench/decode_kernels.py, the decode layer as Triton kernels: each kernel against the torch
arithmetic it replaces (Triton's interpreter), the whole layer against the static generator's own
layer (same tokens, same log-probs), the launch plan, and compilation for an sm_90 GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # the offline sm_90 compiler helper the core's tests use
from decode_scripts import SAME_SAMPLES, TINY_MODEL  # noqa: E402
from triton_compile import compile_for_hopper, run_interpreted  # noqa: E402


def _interpret(script: str, *args: str) -> str:
    return run_interpreted(script, *args)


KERNELS = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from bench import decode_kernels as dk
torch.manual_seed(0)
# float32 and float16 (the interpreter has no bfloat16): rows fewer than a tile, x a view
for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-3)):
    for M, N, K in ((64, 128, 256), (5, 48, 128), (16, 64, 64)):
        x = torch.randn(M, K + 8)[:, :K].to(dtype)
        w, b = (torch.randn(N, K) / K**0.5).to(dtype), torch.randn(N).to(dtype)
        want = F.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(dk.product(x, w, b, pdl=False).float(), want, rtol=tol, atol=tol)
        for pre in (1, 2, 4):  # the K loop's first weight blocks peeled off (at most K's)
            got = dk.product(x, w, b, pdl=False, config={"pre": pre, "peel": 1, "block_k": 64})
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        for split in (1, 2):  # partial sums over K, the bias left out
            if (K // 64) % split == 0:
                parts = dk.product(x, w, split_out=True, pdl=False, config={"split": split, "block_k": 64})
                assert parts.shape == (split, M, N)
                torch.testing.assert_close(parts.float().sum(0), want - b.float(), rtol=tol, atol=tol)
        gate_up, gate_up_bias = (torch.randn(2 * N, K) / K**0.5).to(dtype), torch.randn(2 * N).to(dtype)
        gate, up = F.linear(x.float(), gate_up.float(), gate_up_bias.float()).to(dtype).chunk(2, dim=-1)
        want = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
        for peel, pre in ((0, 1), (1, 1), (1, 3)):
            got = dk.product(x, gate_up, gate_up_bias, gated=True, pdl=False, config={"pre": pre, "peel": peel, "block_k": 64})
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    norm = Qwen2RMSNorm(96, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    h, parts = torch.randn(7, 96).to(dtype), torch.randn(3, 7, 96)
    h_new, normed = dk.run_add_rms_norm(h, parts, None, norm.weight, 1e-6, pdl=False)
    want_h = h + parts.sum(0).to(dtype)
    torch.testing.assert_close(h_new, want_h, rtol=0, atol=0 if dtype == torch.float32 else 1e-2)
    torch.testing.assert_close(normed.float(), norm(want_h).float(), rtol=tol, atol=tol)
print("ok")
"""


def test_the_kernels_compute_the_torch_layers_arithmetic() -> None:
    _interpret(KERNELS)


DECODE = """
import functools, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from bench.decode_kernels import kernel_decode_head, kernel_decode_layer
from grpo_plugins.generators.static_decode import StaticDecoder
from grpo_plugins.generators.static_steps import decode_step
from grpo_plugins.kinds import SamplingSettings

""" + TINY_MODEL + """
results = []
import bench.profile_decode as profile
# the decode layer, the kernel layers as wired here and as profile_decode wires them (both plans)
for variant in ({"merge_weights": True}, None, {"merge_weights": True, "kernels": True, "pdl": False},
                {"merge_weights": True, "kernels": True, "pdl": False, "plan": "wide"}):
    if variant is None:
        dec = StaticDecoder(model, SamplingSettings(max_completion_length=6, temperature=1.0), eos_ids=[0], pad_id=0,
                            compile=False, stop_at_eos=False, merge_weights=True)
        dec._compiled_step = functools.partial(
            decode_step, layer_fn=functools.partial(kernel_decode_layer, pdl=False), head_fn=functools.partial(kernel_decode_head, pdl=False))
    else:
        dec = profile._decoder(model, 6, variant)
    torch.manual_seed(4)
    results.append(dec.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]]))
""" + SAME_SAMPLES


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # q/k/v with and without a bias
def test_the_kernel_layers_sample_what_the_decode_layer_samples(arch: str) -> None:
    _interpret(DECODE, arch)


def test_the_plan_fills_the_multiprocessors() -> None:
    from bench.decode_kernels import plan

    # Qwen2.5-1.5B on 132 multiprocessors. q/k/v (2048 x 1536): 32-row tiles (two programs fit a
    # multiprocessor's shared memory), K in 4 parts: 256 programs in one wave; 6 parts of 64-row
    # tiles would take two. Down (1536 x 8960): parts divide K's 70 blocks. Gate/up (2 x 8960,
    # gated, never split): 16-row tiles, 560 programs in 3 waves of 264 programs with a quarter
    # of a 64-row tile's work each, against 140 64-row programs in 2 waves of 132.
    expect = [(2048, 1536, False, 32, 4), (1536, 1536, False, 32, 4), (1536, 8960, False, 32, 5), (8960, 1536, True, 16, 1)]
    for n, k, gated, block_n, split in expect:
        assert plan(64, n, k, 132, gated) == {"block_n": block_n, "block_k": 128, "split": split, "num_warps": 4, "num_stages": 4, "pre": 1, "peel": False}
    # q/k/v is not split (its sums go to the attention whole): 128 16-row programs
    assert plan(64, 2048, 1536, 132, whole=True) == {"block_n": 16, "block_k": 128, "split": 1, "num_warps": 4, "num_stages": 4, "pre": 1, "peel": False}
    assert plan(64, 48, 960, 132) == {"block_n": 16, "block_k": 64, "split": 5, "num_warps": 4, "num_stages": 4, "pre": 1, "peel": False}


def test_the_kernels_compile_for_hopper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from bench import decode_kernels as dk

    scalars = {"M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32", "stride_x": "i32", "stride_out": "i32"}
    for split, gated, pdl, pre, peel in ((1, False, False, 1, False), (4, False, True, 2, True), (1, True, True, 4, True), (2, False, True, 1, False)):
        signature = {"w_ptr": "*bf16", "x_ptr": "*bf16", "out_ptr": "*fp32" if split > 1 else "*bf16", "bias_ptr": "*bf16", **scalars}
        constants = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT": split, "BIAS": split == 1, "GATED": gated, "PDL": pdl, "PRE": pre, "PEEL": peel}
        asm = compile_for_hopper(dk._product_kernel, signature, constants)
        assert "cubin" in asm and ("griddepcontrol.wait" in str(asm["ptx"])) == pdl
    signature = {"h_ptr": "*bf16", "parts_ptr": "*fp32", "bias_ptr": "*bf16", "w_ptr": "*bf16", "h_out_ptr": "*bf16", "x_out_ptr": "*bf16",
                 "N": "i32", "eps": "fp32", "stride_h": "i32", "stride_parts": "i32", "stride_part_row": "i32"}
    asm = compile_for_hopper(dk._add_rms_norm_kernel, signature, {"SPLIT": 7, "BLOCK": 2048, "BIAS": False, "PDL": True})
    assert "cubin" in asm and "griddepcontrol.wait" in str(asm["ptx"])

