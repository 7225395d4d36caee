"""Merging an update into float8 weights: the hash noise is uniform and reproducible, the merge
does not depend on how its rows are chunked, and the Triton kernel (run by Triton's interpreter
on the CPU) builds the same bits as the torch operations."""

from __future__ import annotations


import torch

from grpo_plugins.fp8_base import quantize_rows
from grpo_plugins.fp8_rounding import merge_rows_reference, uniform_noise



def test_the_noise_is_uniform_reproducible_and_differs_by_seed() -> None:
    index = torch.arange(200_000, dtype=torch.int64)
    noise = uniform_noise(index, seed=5)
    assert noise.dtype == torch.float32 and float(noise.min()) >= 0.0 and float(noise.max()) < 1.0
    counts = torch.histc(noise, bins=20, min=0.0, max=1.0)
    assert float((counts / 10_000 - 1).abs().max()) < 0.05  # each twentieth holds its share
    assert abs(float(noise[1:] @ noise[:-1]) / (len(noise) - 1) - 0.25) < 0.005  # neighbours uncorrelated
    assert torch.equal(noise, uniform_noise(index, seed=5))
    other = uniform_noise(index, seed=6)
    assert float((noise == other).float().mean()) < 0.001
    assert torch.equal(uniform_noise(index[1000:2000], seed=5), noise[1000:2000])  # a function of the index


def test_the_merge_does_not_depend_on_how_rows_are_chunked() -> None:
    torch.manual_seed(0)
    weight8, scale = quantize_rows(torch.randn(37, 80))
    delta = torch.randn(37, 80) * 0.02 * scale
    whole = merge_rows_reference(weight8, scale[:, 0], delta, seed=3, rows=4096)
    chunked = merge_rows_reference(weight8, scale[:, 0], delta, seed=3, rows=5)
    assert torch.equal(whole[0].view(torch.uint8), chunked[0].view(torch.uint8)) and torch.equal(whole[1], chunked[1])
    # no update and no growth: the weights come back bit for bit
    same, same_scale = merge_rows_reference(weight8, scale[:, 0], None, seed=3)
    assert torch.equal(same.view(torch.uint8), weight8.view(torch.uint8)) and torch.equal(same_scale, scale)


KERNEL_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from grpo_plugins.fp8_base import quantize_rows
from grpo_plugins.fp8_rounding import merge_rows_reference, run_kernel
torch.manual_seed(0)
cases = [
    (7, 100, True, {}),                                   # rows not a multiple of the block, K of the block
    (16, 1030, True, {"block_k": 256}),                  # several K blocks, the last one short
    (5, 64, False, {}),                                  # no update
    (9, 48, True, {"block_rows": 2, "block_k": 16}),
]
for N, K, with_delta, config in cases:
    w = torch.randn(N, K) * torch.logspace(-3, 1, N)[:, None]
    w[0, :3] = torch.tensor([0.0, -0.0, 1e-9])  # zeros and float8 subnormals
    w8, s = quantize_rows(w)
    delta = None
    if with_delta:
        delta = (torch.randn(N, K) * 0.05 * s).to(torch.bfloat16)
        delta[1, 3] = 1000 * s[1, 0]  # a row that outgrows its range
    got, got_scale = run_kernel(w8, s[:, 0], delta, seed=11, **config)
    want, want_scale = merge_rows_reference(w8, s[:, 0], delta, seed=11, rows=3)
    assert torch.equal(got_scale, want_scale), (got_scale - want_scale).abs().max()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (got.view(torch.uint8) != want.view(torch.uint8)).sum()
    if with_delta:
        assert got_scale[1, 0] > s[1, 0] * 2 and bool((got_scale[2:, 0] <= s[2:, 0] * 1.01).all())
# The once-per-device check that decides between the kernel and the torch operations.
from grpo_plugins import fp8_rounding
assert fp8_rounding._check_kernel(torch.device("cpu"))
reference = fp8_rounding.merge_rows_reference
fp8_rounding.merge_rows_reference = lambda w8, s, d, seed, rows=4096: reference(w8, s, d, seed + 1, rows)
assert not fp8_rounding._check_kernel(torch.device("cpu"))  # a kernel rounding with other noise is refused
print("ok")
"""


def test_the_kernel_builds_the_same_bits_as_the_torch_operations() -> None:
    from triton_compile import run_interpreted

    run_interpreted(KERNEL_CHECK)
