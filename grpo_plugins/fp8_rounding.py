"""A float8 weight plus an update, back on float8 without losing small updates: :func:`merge_rows`.

The ``static`` generator's decode copies over a float8 base (``load_in_fp8``) are the base's
float8 weights with the LoRA update added. Rounding the sum to the nearest float8 value would
return the base unchanged wherever the update is below half a grid step (all of a LoRA run's
early updates), so the values are rounded *stochastically*: up or down with the probabilities
that make the result exact in expectation. Each row keeps its scale unless the update outgrows
its range.

The random numbers are a hash of each element's position and a per-layer seed, not a generator's
stream: the same on every call (a run and its resumption build the same weights), the same for
any chunking of the rows, and cheap to make inside a kernel. On a CUDA GPU with Triton the whole
merge is one kernel that reads the float8 weight and the update twice and writes the result once
(the torch implementation before it made ~40 passes over float32 temporaries: +0.44 s per 7B
generation); elsewhere the same arithmetic runs as torch operations, bit for bit the same
function. The kernel is checked against the torch operations once per device before first use.
"""

from __future__ import annotations

import functools
import logging

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]

__all__ = ["FP8_MAX", "merge_agreement", "merge_rows", "merge_rows_reference", "round_stochastically", "uniform_noise"]

logger = logging.getLogger(__name__)

#: The largest magnitude float8 e4m3 represents.
FP8_MAX = 448.0

_MASK32 = 0xFFFFFFFF
_SEED_MIX = 0x9E3779B9


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for int64 ``x`` in [0, 2**32) without int64 overflow."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def uniform_noise(index: torch.Tensor, seed: int) -> torch.Tensor:
    """Numbers in [0, 1) (24 bits), one per int64 ``index``: murmur3's 32-bit finaliser of the
    index and ``seed``. Deterministic and the same on every device."""
    x = (index + ((seed * _SEED_MIX) & _MASK32)) & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    x = x ^ (x >> 16)
    return (x >> 8).to(torch.float32) * 2.0**-24


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` (int32, -126..127) exactly, from the float32 bit pattern."""
    return ((exponent + 127) << 23).to(torch.int32).view(torch.float32)


def round_stochastically(values: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``values`` (float32, clamped to +-:data:`FP8_MAX`) as float8 e4m3: each to one of the two
    float8 values bracketing it, the upper one with probability equal to the value's distance from
    the lower one over the spacing, decided by ``noise`` (uniform in [0, 1)): exact in expectation.
    Representable values stay as they are."""
    values = values.float().clamp(-FP8_MAX, FP8_MAX)
    magnitude = values.abs()
    exponent = ((magnitude.view(torch.int32) >> 23) & 0xFF) - 127
    spacing_exponent = exponent.clamp(min=-6) - 3  # e4m3: 3 mantissa bits; subnormals below 2**-6
    scaled = magnitude * _power_of_two(-spacing_exponent)  # exact: a power of two
    rounded = torch.floor(scaled + noise) * _power_of_two(spacing_exponent)
    return torch.copysign(rounded.clamp(max=FP8_MAX), values).to(torch.float8_e4m3fn)  # representable: exact


def merge_rows_reference(
    weight8: torch.Tensor, scale: torch.Tensor, delta: torch.Tensor | None, seed: int, rows: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_rows` as torch operations, ``rows`` rows at a time (bounded temporaries)."""
    out_rows, cols = weight8.shape
    w8 = torch.empty_like(weight8)
    new_scale = torch.empty(out_rows, 1, dtype=torch.float32, device=weight8.device)
    for start in range(0, out_rows, rows):
        part = slice(start, start + rows)
        base_scale = scale[part, None].float()
        values = weight8[part].float()  # in units of the base scale
        if delta is not None:
            values = values + delta[part].float() / base_scale
        grow = (values.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1.0)
        first = start * cols
        index = torch.arange(first, first + values.numel(), device=values.device, dtype=torch.int64).view(values.shape)
        w8[part] = round_stochastically(values / grow, uniform_noise(index, seed))
        new_scale[part] = base_scale * grow
    return w8, new_scale


def merge_rows(
    weight8: torch.Tensor, scale: torch.Tensor, delta: torch.Tensor | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float8 weights and per-row scales for ``weight8 * scale + delta``: ``(w8, new_scale)``.

    ``weight8`` (N, K) float8 e4m3, ``scale`` (N,) float32 (one per row), ``delta`` (N, K) or None.
    Each row's values ``weight8 + delta / scale`` keep the row's scale unless their largest
    magnitude exceeds :data:`FP8_MAX` (then the row's scale grows just enough), and are rounded
    stochastically with the noise of element ``row * K + column`` under ``seed``."""
    if triton is not None and weight8.is_cuda and _kernel_checked(weight8.device):
        return run_kernel(weight8, scale, delta, seed)
    return merge_rows_reference(weight8, scale, delta, seed)


@functools.cache
def _kernel_checked(device: torch.device) -> bool:
    """Whether the kernel runs on ``device`` and agrees with the torch operations there (checked
    once per device on a small case); if not, the merge runs as torch operations, with a warning."""
    return _check_kernel(device)


def merge_agreement(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """How far one merge ``(w8, scale)`` is from another: the share of float8 values with other
    bits, the largest distance in grid steps of ``want``, the largest relative scale error."""
    (w_got, s_got), (w_want, s_want) = got, want
    spacing = (w_want.float().abs() / 8).clamp(min=2**-9) * s_want
    apart = (w_got.float() * s_got - w_want.float() * s_want).abs() / spacing
    return {
        "bits_differ": float((w_got.view(torch.uint8) != w_want.view(torch.uint8)).float().mean()),
        "largest_grid_steps": float(apart.max()),
        "scale_rel_error": float(((s_got - s_want).abs() / s_want).max()),
    }


def _check_kernel(device: torch.device) -> bool:
    rows, cols = 24, 1000
    position = torch.arange(rows * cols, device=device, dtype=torch.float32).view(rows, cols)
    weight = torch.sin(position * 0.37) * torch.logspace(-3, 1, rows, device=device)[:, None]
    scale = weight.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    weight8 = (weight / scale[:, None]).to(torch.float8_e4m3fn)
    delta = (torch.cos(position * 0.11) * 0.3 * scale[:, None]).to(torch.bfloat16)
    delta[1, 3] = 1000 * scale[1]  # a row whose range grows
    try:
        got, got_scale = run_kernel(weight8, scale, delta, seed=1)
    except Exception as error:  # a Triton or driver that cannot build the kernel
        logger.warning("the float8 merge kernel does not run on %s (%s: %s); merging with torch operations", device, type(error).__name__, error)
        return False
    found = merge_agreement((got, got_scale), merge_rows_reference(weight8, scale, delta, seed=1))
    # The GPU's float32 division may differ from torch's in the last bit, moving a rare value
    # to the grid point next to torch's; anything more is a broken kernel.
    agrees = found["scale_rel_error"] <= 1e-6 and found["largest_grid_steps"] <= 2.01 and found["bits_differ"] < 0.01
    if not agrees:
        logger.warning("the float8 merge kernel disagrees with torch operations on %s; merging with torch operations", device)
    return agrees


if triton is not None:

    @triton.jit
    def _mul32_kernel(x, low, high):  # _mul32 with the constant's 16-bit halves
        return (x * low + (((x * high) & 0xFFFF) << 16)) & 0xFFFFFFFF

    @triton.jit
    def _merge_rows_kernel(
        w_ptr, scale_ptr, delta_ptr, out_ptr, out_scale_ptr, N, K, seed_mix,
        HAS_DELTA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        inside_rows = rows < N
        base_scale = tl.load(scale_ptr + rows, mask=inside_rows, other=1.0)
        row_start = rows.to(tl.int64)[:, None] * K
        largest = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # pass 1: each row's largest merged value
            cols = k0 + tl.arange(0, BLOCK_K)
            inside = inside_rows[:, None] & (cols[None, :] < K)
            values = tl.load(w_ptr + row_start + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            if HAS_DELTA:
                values += tl.load(delta_ptr + row_start + cols[None, :], mask=inside, other=0.0).to(tl.float32) / base_scale[:, None]
            largest = tl.maximum(largest, tl.max(tl.abs(values), axis=1))
        grow = tl.maximum(largest / 448.0, 1.0)
        for k0 in range(0, K, BLOCK_K):  # pass 2: round onto the (possibly widened) grid
            cols = k0 + tl.arange(0, BLOCK_K)
            inside = inside_rows[:, None] & (cols[None, :] < K)
            values = tl.load(w_ptr + row_start + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            if HAS_DELTA:
                values += tl.load(delta_ptr + row_start + cols[None, :], mask=inside, other=0.0).to(tl.float32) / base_scale[:, None]
            values = tl.minimum(tl.maximum(values / grow[:, None], -448.0), 448.0)
            # the noise: uniform_noise's hash of the element's index
            x = (row_start + cols[None, :] + seed_mix) & 0xFFFFFFFF
            x = x ^ (x >> 16)
            x = _mul32_kernel(x, 0xCA6B, 0x85EB)
            x = x ^ (x >> 13)
            x = _mul32_kernel(x, 0xAE35, 0xC2B2)
            x = x ^ (x >> 16)
            noise = (x >> 8).to(tl.float32) * (1.0 / 16777216.0)
            # round_stochastically, with the float8 bit pattern built by hand
            magnitude = tl.abs(values)
            exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            spacing_exponent = tl.maximum(exponent, -6) - 3
            up = ((127 - spacing_exponent) << 23).to(tl.float32, bitcast=True)
            down = ((127 + spacing_exponent) << 23).to(tl.float32, bitcast=True)
            rounded = tl.minimum(tl.floor(magnitude * up + noise) * down, 448.0)
            bits = rounded.to(tl.int32, bitcast=True)
            rounded_exponent = ((bits >> 23) & 0xFF) - 127
            normal = ((rounded_exponent + 7) << 3) | ((bits >> 20) & 7)
            subnormal = (rounded * 512.0).to(tl.int32)
            field = tl.where(rounded_exponent >= -6, normal, subnormal)
            negative = (values.to(tl.int32, bitcast=True) >> 31) & 1
            tl.store(out_ptr + row_start + cols[None, :], (field | (negative << 7)).to(tl.uint8), mask=inside)
        tl.store(out_scale_ptr + rows, base_scale * grow, mask=inside_rows)


def run_kernel(
    weight8: torch.Tensor, scale: torch.Tensor, delta: torch.Tensor | None, seed: int,
    block_rows: int = 4, block_k: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_rows` by the Triton kernel (a CUDA tensor, or any under ``TRITON_INTERPRET=1``)."""
    if triton is None:
        raise RuntimeError("the float8 merge kernel needs Triton")
    out_rows, cols = weight8.shape
    weight8, scale = weight8.contiguous(), scale.reshape(-1).float().contiguous()
    delta = None if delta is None else delta.contiguous()
    w8 = torch.empty(out_rows, cols, dtype=torch.uint8, device=weight8.device)
    new_scale = torch.empty(out_rows, 1, dtype=torch.float32, device=weight8.device)
    _merge_rows_kernel[(triton.cdiv(out_rows, block_rows),)](
        weight8, scale, weight8 if delta is None else delta, w8, new_scale, out_rows, cols,
        (seed * _SEED_MIX) & _MASK32, HAS_DELTA=delta is not None, BLOCK_R=block_rows, BLOCK_K=block_k,
    )
    return w8.view(torch.float8_e4m3fn), new_scale
