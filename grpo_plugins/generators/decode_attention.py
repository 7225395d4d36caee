"""Attention for one new token per row over a window of the static KV cache.

Two implementations of the same function, :func:`window_attention`:

- two batched products and a softmax (``torch.matmul``), which runs anywhere;
- one Triton kernel (:func:`fused_window_attention`) that reads the window's keys and values
  once: one program per (row, key/value head) holds the G query heads of that head as G rows of
  one tile (padded to 16, the smallest ``tl.dot`` tile) and keeps an online softmax over blocks
  of the window. On an H200 at 7B it took 1 kernel instead of 3-4 per layer and 5.7 instead of
  6.7 ms per generated token (64 rows, 256 tokens).

The kernel computes the scores in float32 where the products compute them in the model's
dtype; the probabilities enter the value product in the model's dtype in both.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_plugins.errors import GRPOPluginsError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]

#: Keys per block of the kernel's loop over the window.
BLOCK_W = 64


def window_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``q`` (B, Hkv, G, D) - the G query heads that share a key/value head - over
    ``keys``/``values`` (B, Hkv, W, D) with the additive mask ``bias`` (B, W) -> (B, Hkv, G, D).
    Grouped-query attention without repeating the cache: G rows of one (G, D) x (D, W) product."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale + bias[:, None, None, :].to(q.dtype)
    probs = scores.float().softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values)


def fused_attention_unsupported(device: torch.device, head_dim: int, groups: int, dtype: torch.dtype) -> str | None:
    """Why :func:`fused_window_attention` cannot run for these heads on ``device`` (None: it can)."""
    if device.type != "cuda":
        return "it needs a CUDA device"
    if triton is None:
        return "Triton is not installed"
    if dtype not in (torch.bfloat16, torch.float16):
        # Triton's products would run float32 inputs in TF32: coarser than the model's own attention.
        return f"the kernel takes bfloat16 or float16 models, not {str(dtype).removeprefix('torch.')}"
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"the kernel takes head dimensions that are powers of two from 16 to 256, not {head_dim}"
    if groups > 64:
        return f"the kernel takes at most 64 query heads per key/value head, not {groups}"
    return None


def use_fused_attention(parts: Any, wanted: bool | None) -> bool:
    """The ``fused_attention`` setting for a model's decoder parts: ``wanted``, or where it can
    run when None; asking for it where it cannot run is an error naming the setting."""
    groups = parts.num_heads // parts.num_kv_heads
    weight = parts.embed.weight
    unsupported = fused_attention_unsupported(weight.device, parts.head_dim, groups, weight.dtype)
    if wanted and unsupported is not None:
        raise GRPOPluginsError(f"generator 'static': fused_attention cannot run here: {unsupported}; set fused_attention: false")
    return unsupported is None if wanted is None else wanted


if triton is not None:

    @triton.jit
    def _window_attention_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, o_ptr, W, scale,
        stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_bb,
        HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = pid // HKV
        h = pid % HKV
        rg = tl.arange(0, GP)
        rd = tl.arange(0, D)
        rows = (b * HKV + h) * G + rg
        q = tl.load(q_ptr + rows[:, None] * D + rd[None, :], mask=rg[:, None] < G, other=0.0)  # (GP, D)
        m = tl.full((GP,), float("-inf"), tl.float32)
        total = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh
        for w0 in range(0, W, BLOCK):
            rw = w0 + tl.arange(0, BLOCK)
            inside = rw < W
            k = tl.load(k_base + rw[:, None] * stride_ks + rd[None, :], mask=inside[:, None], other=0.0)  # (BLOCK, D)
            s = tl.dot(q, tl.trans(k)) * scale  # (GP, BLOCK) float32
            s += tl.load(bias_ptr + b * stride_bb + rw, mask=inside, other=float("-inf"))[None, :]
            m_new = tl.maximum(m, tl.max(s, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of masked slots only
            alpha = tl.exp(m - shift)
            p = tl.exp(s - shift[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + rw[:, None] * stride_vs + rd[None, :], mask=inside[:, None], other=0.0)  # (BLOCK, D)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        tl.store(o_ptr + rows[:, None] * D + rd[None, :], acc / total[:, None], mask=rg[:, None] < G)


def run_kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`window_attention`'s result from the Triton kernel. ``keys``/``values`` may be
    windows (views) of a larger cache: only their last stride must be 1."""
    if triton is None:
        raise RuntimeError("the fused decode attention needs Triton")
    B, Hkv, G, D = q.shape
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        keys, values = keys.contiguous(), values.contiguous()
    q = q.contiguous()
    bias = bias.float().contiguous()
    out = torch.empty_like(q)
    _window_attention_kernel[(B * Hkv,)](
        q, keys, values, bias, out, keys.shape[2], scale,
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2), bias.stride(0),
        HKV=Hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BLOCK=BLOCK_W,
    )
    return out


@torch.library.custom_op("grpo_plugins::window_attention", mutates_args=())
def fused_window_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`window_attention` as one Triton kernel, an opaque op to ``torch.compile`` (it
    calls the kernel as it is; its result has ``q``'s shape and dtype)."""
    return run_kernel(q, keys, values, bias, scale)


@fused_window_attention.register_fake
def _(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape)
