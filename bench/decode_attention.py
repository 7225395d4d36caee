"""A candidate decode attention (bench only, until timed on a GPU): one Triton kernel per decode
step and layer that reads the window's keys and values once, with the G query heads of a
key/value head as G rows of one tile and an online softmax (flash-decoding without the split).

The shipped decode layer runs two batched products and a softmax (3-4 kernels a layer); cuDNN's
fused attention (``sdpa``) and ``flex_attention`` were no faster on the H200 (bench/RESULTS.md):
cuDNN pads the G query rows of a head to a 64-row tile. Here one program handles one (row,
key/value head) and pads G only to 16, the smallest tile of ``tl.dot``.

``python bench/profile_decode.py --shape qwen2.5-1.5b --tokens 256 --variants fused triton``
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` (B, Hkv, G, D), ``keys``/``values`` (B, Hkv, W, D), ``bias`` (B, W) additive ->
    (B, Hkv, G, D): what the shipped decode layer computes."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale + bias[:, None, None, :].to(q.dtype)
    probs = scores.float().softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values)


if triton is not None:

    @triton.jit
    def _decode_attention(
        q_ptr, k_ptr, v_ptr, bias_ptr, o_ptr, W, scale,
        stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_bb,
        HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr,
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
        for w0 in range(0, W, BLOCK_W):
            rw = w0 + tl.arange(0, BLOCK_W)
            inside = rw < W
            k = tl.load(k_base + rw[:, None] * stride_ks + rd[None, :], mask=inside[:, None], other=0.0)  # (BW, D)
            s = tl.dot(q, tl.trans(k)) * scale  # (GP, BW), float32
            s += tl.load(bias_ptr + b * stride_bb + rw, mask=inside, other=float("-inf"))[None, :]
            m_new = tl.maximum(m, tl.max(s, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of masked slots only
            alpha = tl.exp(m - shift)
            p = tl.exp(s - shift[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + rw[:, None] * stride_vs + rd[None, :], mask=inside[:, None], other=0.0)  # (BW, D)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / total[:, None]
        tl.store(o_ptr + rows[:, None] * D + rd[None, :], out, mask=rg[:, None] < G)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`reference_attention`'s result from one Triton kernel (the reference without Triton).
    ``keys``/``values`` may be windows (views) of a larger cache: only their last stride must be 1."""
    if triton is None:
        return reference_attention(q, keys, values, bias, scale)
    B, Hkv, G, D = q.shape
    W = keys.shape[2]
    q = q.contiguous()
    bias = bias.float().contiguous()
    out = torch.empty_like(q)
    _decode_attention[(B * Hkv,)](
        q, keys, values, bias, out, W, scale,
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2), bias.stride(0),
        HKV=Hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BLOCK_W=64,
    )
    return out


@torch.library.custom_op("grpo_bench::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`decode_attention` as an opaque op, so ``torch.compile`` calls the kernel as it is."""
    return decode_attention(q, keys, values, bias, scale)


@decode_attention_op.register_fake
def _(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


def decode_layer_triton(parts: Any, layer: Any, h: Any, cos: Any, sin: Any, k_all: Any, v_all: Any, bias: Any, index: Any) -> Any:
    """``decode_layer`` with the attention as :func:`decode_attention_op` (one kernel)."""
    from grpo_plugins.generators.static_steps import _qkv

    B, G, W = h.shape[0], parts.num_heads // parts.num_kv_heads, bias.shape[-1]
    q, k, v = _qkv(layer, layer.input_layernorm(h), cos, sin, parts)
    k_all.index_copy_(2, index, k)
    v_all.index_copy_(2, index, v)
    q = q.reshape(B, parts.num_kv_heads, G, parts.head_dim)
    o = decode_attention_op(q, k_all[:, :, :W], v_all[:, :, :W], bias[:, 0, 0, :], parts.scaling)  # (B, Hkv, G, D)
    h = h + layer.self_attn.o_proj(o.reshape(B, 1, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))
