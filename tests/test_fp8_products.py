"""The float8 decode kernel: run by Triton's interpreter on the CPU it computes what
``torch._scaled_mm`` with row-wise scales computes, for every way it splits the product; a
float8 projection sends decode batches through it and longer inputs through ``_scaled_mm``;
its launch plan keeps every SM of a large GPU busy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from grpo_plugins.generators.fp8_products import fp8_kernel_unsupported, plan
from triton_compile import run_interpreted



def _interpret(script: str) -> None:
    run_interpreted(script)


KERNEL_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from grpo_plugins.generators.fp8_products import run_kernel
from grpo_plugins.generators.static_layers import quantize_rows
torch.manual_seed(0)
cases = [
    (5, 96, 256, {}),                                  # fewer rows than a tile, N not a multiple of 64
    (64, 256, 512, {"split": 2}),                      # a decode batch, K split in two
    (3, 64, 200, {"block_n": 64, "block_k": 64}),      # K not a multiple of the block
    (17, 128, 640, {"split": 4, "block_k": 64}),       # the last split shorter than the others
    (128, 64, 128, {}),                                # the most rows the kernel takes
]
for M, N, K, config in cases:
    x = torch.randn(M, K) * torch.logspace(-2, 2, M)[:, None]  # rows of very different sizes
    w = torch.randn(N, K) * 0.02
    x8, xs = quantize_rows(x)
    w8, ws = quantize_rows(w)
    ws = ws.reshape(1, -1)
    want = (x8.float() @ w8.float().t()) * xs * ws  # _scaled_mm's function with row-wise scales
    got = run_kernel(x8, xs, w8, ws, torch.float32, config)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    # A 16-bit result is the float32 one rounded once.
    low = run_kernel(x8, xs, w8, ws, torch.bfloat16, config)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), got.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6 * float(want.abs().max()))
# The op hands back partial sums over K (several splits: float32) whose sum is the product.
from grpo_plugins.generators.fp8_products import fp8_rows_mm, fp8_rows_product
x8, xs = quantize_rows(torch.randn(4, 512))
w8, ws = quantize_rows(torch.randn(32, 512))
ws = ws.reshape(1, -1)
parts = run_kernel(x8, xs, w8, ws, torch.float32, {"split": 4}, reduce=False)
assert parts.shape == (4, 4, 32) and parts.dtype == torch.float32
torch.testing.assert_close(parts.sum(0), run_kernel(x8, xs, w8, ws, torch.float32, {"split": 4}))
torch.testing.assert_close(fp8_rows_product(x8, xs, w8, ws, torch.float32), run_kernel(x8, xs, w8, ws, torch.float32))
from torch._subclasses.fake_tensor import FakeTensorMode
for M, N, K in [(4, 32, 512), (64, 96, 4096)]:  # what torch.compile traces with is what the op returns
    args = (quantize_rows(torch.randn(M, K))[0], torch.ones(M, 1), quantize_rows(torch.randn(N, K))[0], torch.ones(1, N))
    real = fp8_rows_mm(*args, torch.bfloat16)
    with FakeTensorMode() as mode:
        fake = fp8_rows_mm(*[mode.from_tensor(a) for a in args], torch.bfloat16)
    assert fake.shape == real.shape and fake.dtype == real.dtype, (fake.shape, real.shape)
try:
    run_kernel(torch.zeros(129, 32).to(torch.float8_e4m3fn), torch.ones(129, 1), w8[:, :32], ws, torch.float32)
except ValueError as e:
    assert "128 rows" in str(e)
else:
    raise AssertionError("129 rows were accepted")
print("ok")
"""


def test_the_kernel_computes_the_row_scaled_float8_product() -> None:
    _interpret(KERNEL_CHECK)


PROJECTION_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
import grpo_plugins.generators.static_layers as layers
from grpo_plugins.generators.static_layers import FusedLinear
torch.manual_seed(0)
q, k = torch.nn.Linear(64, 48, bias=True), torch.nn.Linear(64, 16, bias=False)
fp8 = FusedLinear([q, k], fp8=True)
assert fp8.rows_kernel is False  # no CUDA here: torch's product
calls = []
real = layers.fp8_rows_product
layers.fp8_rows_product = lambda *a: calls.append(a[0].shape[0]) or real(*a)
decode, prefill = torch.randn(6, 1, 64), torch.randn(2, 80, 64)  # 6 rows; 160 rows
want_decode, want_prefill = fp8(decode), fp8(prefill)
fp8.rows_kernel = True  # as on a GPU with Triton
got_decode, got_prefill = fp8(decode), fp8(prefill)
assert calls == [6], calls  # the decode batch went through the kernel, the prefill did not
torch.testing.assert_close(got_decode, want_decode, rtol=1e-5, atol=1e-5)
assert torch.equal(got_prefill, want_prefill)
print("ok")
"""


def test_float8_projections_send_decode_batches_through_the_kernel() -> None:
    _interpret(PROJECTION_CHECK)


def test_the_plan_keeps_the_sms_busy_at_7b_and_1_5b() -> None:
    sms = 132  # an H100/H200
    for N, K in [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (2048, 1536), (17920, 1536), (1536, 8960)]:
        p = plan(64, N, K, sms)
        programs = -(-N // p["block_n"]) * p["split"]
        blocks_per_split = K // (p["block_k"] * p["split"])
        assert programs >= sms // 2, (N, K, p)  # every SM has work
        assert p["split"] <= 4 and blocks_per_split >= 3, (N, K, p)  # each program streams a run of K
    # What the H200 sweep found fastest (bench/fp8_decode.py, float32 sum per K block):
    assert plan(64, 37888, 3584, sms) == {"block_n": 128, "block_k": 128, "split": 1, "num_warps": 4, "num_stages": 3}
    assert plan(64, 3584, 3584, sms)["split"] == plan(64, 2048, 1536, sms)["split"] == 4  # few tiles of short rows
    assert plan(64, 1536, 8960, sms)["block_k"] == 256  # 24 tiles of long rows
    assert plan(64, 17920, 1536, sms)["split"] == 1  # 280 tiles already fill the GPU


def test_the_kernel_says_where_it_cannot_run() -> None:
    assert "CUDA" in fp8_kernel_unsupported(torch.device("cpu"))


DECODE_CHECK = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
import grpo_plugins.generators.static_layers as layers
from grpo_plugins.generators.static_decode import StaticDecoder
from grpo_plugins.kinds import SamplingSettings
from grpo_plugins.models import load_model
from grpo_plugins.testing.tiny import tiny_model_spec

spec = tiny_model_spec(Path(sys.argv[2]), "qwen2")
model, _ = load_model(spec, dtype="float32", lora={"r": 4, "target_modules": "all-linear"}, seed=0)
prompts = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 5, 6, 7, 8], [1, 40]]
sampling = SamplingSettings(max_completion_length=12, temperature=0.8)
results, calls = [], []
real = layers.fp8_rows_product
layers.fp8_rows_product = lambda *a: calls.append(1) or real(*a)
for kernel in (False, True):
    layers.fp8_kernel_unsupported = lambda device, kernel=kernel: None if kernel else "off"  # as on a GPU with Triton
    dec = StaticDecoder(model.eval(), sampling, [2], 0, prompt_multiple=8, fp8=True, compile=False)
    torch.manual_seed(3)
    results.append(dec.generate(prompts))
(ids0, mask0, _, logps0), (ids1, mask1, _, logps1) = results
assert calls, "the kernel never ran"
assert torch.equal(ids0, ids1) and torch.equal(mask0, mask1)
torch.testing.assert_close(logps1, logps0, rtol=0, atol=1e-5)
print("ok")
"""


def test_a_float8_decode_through_the_kernel_samples_what_scaled_mm_samples(tmp_path: Path) -> None:
    run_interpreted(DECODE_CHECK, str(tmp_path))


def test_the_float8_kernels_compile_for_hopper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode product kernel and the float8-base merge kernel compile for sm_90 (float8
    tensor cores) on this CPU-only machine, for the launch settings the plan uses."""
    from triton_compile import compile_for_hopper

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a real compilation, not a cached one
    from grpo_plugins import fp8_rounding
    from grpo_plugins.generators import fp8_products

    rows = {"w_ptr": "*fp8e4nv", "x_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "xs_ptr": "*fp32", "out_ptr": "*bf16",
            "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32"}
    for block_n, block_k in [(128, 128), (64, 256)]:
        asm = compile_for_hopper(fp8_products._fp8_rows_kernel, rows, {"BLOCK_N": block_n, "BLOCK_M": 64, "BLOCK_K": block_k, "EVEN_K": True})
        assert "cubin" in asm and "e4m3" in str(asm["ptx"])  # float8 products on the tensor cores
    merge = {"w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "delta_ptr": "*fp32", "out_ptr": "*u8", "out_scale_ptr": "*fp32",
             "N": "i32", "K": "i32", "seed_mix": "i64"}
    for has_delta in (False, True):
        assert "cubin" in compile_for_hopper(fp8_rounding._merge_rows_kernel, merge, {"HAS_DELTA": has_delta, "BLOCK_R": 4, "BLOCK_K": 512})
