"""Float8 projections for a decode batch: one Triton kernel made for few rows.

A decode step multiplies ~64 rows by every projection weight, so its time is the time to read
the weights. Float8 halves those bytes, but cuBLASLt's float8 kernels tile the rows by 128:
at 64 rows half of each tile idles and the product ran no faster than bf16 on an H200. This
kernel swaps the operands: the weight (N, K) is the product's left side, tiled by 64 or 128 of
its rows, and the batch (all M <= 128 rows in one tile) the right side, so no tile idles.
Projections with few weight tiles split K over several programs (float32 partial sums, then
one reduction in a fixed order, so results do not depend on scheduling) to keep every SM
streaming.

Both sides are float8 e4m3 with float32 scales (one per weight row, one per input row), the
products accumulate in float32 (promoted after every block of K: Hopper's float8 tensor cores
otherwise keep a shorter sum, which on an H200 put the result ~2e-3 off ``_scaled_mm``'s): the
same function as ``torch._scaled_mm`` with row-wise scales, up to the order of the float32 sums.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]

#: The most input rows the kernel takes (all in one tile); larger products go to torch.
MAX_ROWS = 128


def fp8_kernel_unsupported(device: torch.device) -> str | None:
    """Why :func:`fp8_rows_mm` cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return "it needs a CUDA device"
    if triton is None:
        return "Triton is not installed"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "it needs float8 tensor cores (compute capability 8.9+)"
    return None


if triton is not None:

    @triton.jit
    def _fp8_rows_kernel(
        w_ptr, x_ptr, ws_ptr, xs_ptr, out_ptr, M, N, K, k_per_split,
        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        k_start = pid_k * k_per_split
        w_rows = w_ptr + rn[:, None].to(tl.int64) * K
        x_rows = x_ptr + rm[:, None] * K
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_rows + (k0 + rk)[None, :], mask=rn[:, None] < N, other=0.0)
                x = tl.load(x_rows + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
            else:
                inside = (k0 + rk)[None, :] < K
                w = tl.load(w_rows + (k0 + rk)[None, :], mask=(rn[:, None] < N) & inside, other=0.0)
                x = tl.load(x_rows + (k0 + rk)[None, :], mask=(rm[:, None] < M) & inside, other=0.0)
            # Hopper's float8 tensor cores add in reduced precision; promoting the sum to float32
            # after each block (as cuBLASLt does unless told to accumulate fast) keeps it exact.
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)  # (BLOCK_N, BLOCK_M) float32
        acc = acc * tl.load(ws_ptr + rn, mask=rn < N, other=0.0)[:, None]
        acc = acc * tl.load(xs_ptr + rm, mask=rm < M, other=0.0)[None, :]
        out = out_ptr + pid_k * M * N + rm[None, :] * N + rn[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan(M: int, N: int, K: int, sms: int) -> dict[str, int]:
    """Launch settings for an (M, K) x (N, K)^T product on a GPU with ``sms`` multiprocessors,
    from a sweep on an H200 (``bench/fp8_decode.py``, the sum promoted to float32 per K block):
    128-row weight tiles where there are two per SM, 256-deep K blocks for very long rows, and
    K split (at most 4 ways) until there are about two programs per SM."""
    if N // 128 >= 2 * sms:
        return {"block_n": 128, "block_k": 128, "split": 1, "num_warps": 4, "num_stages": 3}
    block_k = 256 if K >= 8192 else 128
    tiles = -(-N // 64)
    split = 1
    while split < 4 and tiles * split < 2 * sms and K // (block_k * split * 2) >= 3:
        split *= 2
    return {"block_n": 64, "block_k": block_k, "split": split, "num_warps": 4, "num_stages": 6 if block_k == 256 else 4}


def run_kernel(
    x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
    config: dict[str, int] | None = None, reduce: bool = True,
) -> torch.Tensor:
    """``(x8 * x_scale) @ (w8 * w_scale)^T`` in ``out_dtype``: ``x8`` (M, K) and ``w8`` (N, K)
    float8 e4m3, ``x_scale`` (M,) or (M, 1) and ``w_scale`` (N,) or (1, N) float32, M <= 128.
    ``reduce=False``: the (splits, M, N) partial sums over K instead (float32 when several, in
    ``out_dtype`` when one), for the caller to add where it can fuse the sum. ``config``
    (benchmarks): launch settings instead of :func:`plan`'s."""
    if triton is None:
        raise RuntimeError("the float8 decode kernel needs Triton")
    M, K = x8.shape
    N = w8.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"the float8 decode kernel takes at most {MAX_ROWS} rows, not {M}")
    settings = plan(M, N, K, _sms(x8.device)) | (config or {})
    block_k, k_per_split, split = _split(K, settings)
    # One split stores in out_dtype (the store rounds once); several store float32 partials.
    out = torch.empty(split, M, N, dtype=out_dtype if split == 1 else torch.float32, device=x8.device)
    _fp8_rows_kernel[(triton.cdiv(N, settings["block_n"]), split)](
        w8, x8.contiguous(), w_scale.reshape(-1).contiguous(), x_scale.reshape(-1).contiguous(), out,
        M, N, K, k_per_split,
        BLOCK_N=settings["block_n"], BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_K=block_k,
        EVEN_K=K % k_per_split == 0,
        num_warps=settings["num_warps"], num_stages=settings["num_stages"],
    )
    if not reduce:
        return out
    return out[0] if split == 1 else out.sum(0).to(out_dtype)


def _sms(device: torch.device) -> int:
    return _sm_count(device.index or 0) if device.type == "cuda" else 1


def _split(K: int, settings: dict[str, int]) -> tuple[int, int, int]:
    """(block_k, K per program, programs along K) for ``settings``: no program without work."""
    block_k, split = settings["block_k"], settings["split"]
    k_per_split = -(-K // (split * block_k)) * block_k
    return block_k, k_per_split, -(-K // k_per_split)


@torch.library.custom_op("grpo_plugins::fp8_rows_mm", mutates_args=())
def fp8_rows_mm(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`run_kernel`'s partial sums (``reduce=False``) as an opaque op to ``torch.compile``:
    (splits, M, N), so that the compiled caller adds them inside the kernel that consumes them."""
    return run_kernel(x8, x_scale, w8, w_scale, out_dtype, reduce=False)


@fp8_rows_mm.register_fake
def _(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> Any:
    M, K = x8.shape
    N = w8.shape[0]
    split = _split(K, plan(M, N, K, _sms(x8.device)))[2]
    return x8.new_empty((split, M, N), dtype=out_dtype if split == 1 else torch.float32)


def fp8_rows_product(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The (M, N) product through :func:`fp8_rows_mm`, its partial sums added in ``out_dtype``."""
    parts = fp8_rows_mm(x8, x_scale, w8, w_scale, out_dtype)
    return parts[0] if parts.shape[0] == 1 else parts.sum(0).to(out_dtype)
