"""RMSNorms folded into the decode step's products.

A Llama-style layer normalises the residual stream ``x`` before its q/k/v and gate/up products:
``rmsnorm(x) @ W.T = ((x * r) * g) @ W.T = (x @ (W * g).T) * r`` with ``r = 1/rms(x)`` per row
and ``g`` the norm's weight. With ``g`` folded into the decode copies of ``W``
(:class:`~grpo_plugins.generators.static_layers.FoldedLayer`), the products read the residual
stream itself and the norm is no kernel of its own: the decode attention kernel scales q/k/v by
``r`` (and adds their bias) as it loads them, and :func:`rms_silu_mul` scales gate/up by ``r``
in the SiLU-multiply. With the residual additions inside the o and down products (``addmm``),
a decode layer is six kernels instead of ten; at 64 rows a decode step's time is largely its
kernels' fixed costs.

Each operation has a torch form (any device) and a Triton form (CUDA), checked against the torch
form once per device before use.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from grpo_plugins.generators.decode_attention import rope_window_attention, run_rope_kernel

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]

__all__ = ["inverse_rms", "normed_qkv", "normed_rope_window_attention", "rms_silu_mul", "rms_silu_mul_torch", "triton_norms_fault"]


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1/rms of each row of ``x`` (..., H) in float32, shaped (..., 1), as the RMSNorm computes it."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def normed_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor, qkv_bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, Hq, D), k/v (B, Hkv, D) products of the residual stream ``x`` (B, H) with the norm's
    weight folded in -> the layer's q/k/v: scaled by 1/rms(x), plus their bias, float32."""
    r = inverse_rms(x, eps)[:, :, None]  # (B, 1, 1)
    out = [t.float() * r for t in (q, k, v)]
    if qkv_bias is not None:
        sizes = [t.shape[1] * t.shape[2] for t in (q, k, v)]
        out = [t + b.float().view(t.shape[1:]) for t, b in zip(out, qkv_bias.split(sizes))]
    return out[0], out[1], out[2]


def normed_rope_window_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor, qkv_bias: torch.Tensor | None, eps: float,
    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
    bias: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The torch form of :func:`normed_rope_window_attention`."""
    q, k, v = normed_qkv(q, k, v, x, qkv_bias, eps)
    return rope_window_attention(q, k, v.to(v_cache.dtype), cos, sin, k_cache, v_cache, index, bias, scale).to(k_cache.dtype)


@torch.library.custom_op("grpo_plugins::normed_rope_window_attention", mutates_args=("k_cache", "v_cache"))
def normed_rope_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor, qkv_bias: torch.Tensor | None, eps: float,
    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
    bias: torch.Tensor, scale: float,
) -> torch.Tensor:
    """:func:`~grpo_plugins.generators.decode_attention.fused_rope_window_attention` for q/k/v
    that are products of the residual stream ``x`` (B, H) with the input norm's weight folded in:
    the kernel scales them by 1/rms(x) (``eps``) and adds ``qkv_bias`` before the RoPE."""
    return run_rope_kernel(q, k, v, cos, sin, k_cache, v_cache, index, bias, scale, x=x, qkv_bias=qkv_bias, eps=eps)


@normed_rope_window_attention.register_fake
def _(q, k, v, x, qkv_bias, eps, cos, sin, k_cache, v_cache, index, bias, scale):  # type: ignore[no-untyped-def]
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    return q.new_empty(B, Hkv, Hq // Hkv, D)


def rms_silu_mul_torch(x: torch.Tensor, gate_up: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch form of :func:`rms_silu_mul`."""
    r = inverse_rms(x, eps)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate * r) * (up * r)).to(gate_up.dtype)


if triton is not None:

    @triton.jit
    def _rms_silu_mul_kernel(x_ptr, gu_ptr, out_ptr, H, I, eps, stride_x, stride_gu, stride_out, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        rh = tl.arange(0, BLOCK_H)
        squares = tl.zeros((BLOCK_H,), tl.float32)
        for c in range(0, H, BLOCK_H):
            xs = tl.load(x_ptr + row * stride_x + c + rh, mask=c + rh < H, other=0.0).to(tl.float32)
            squares += xs * xs
        r = 1.0 / tl.sqrt(tl.sum(squares, 0) / H + eps)
        inside = cols < I
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=inside, other=0.0).to(tl.float32) * r
        up = tl.load(gu_ptr + row * stride_gu + I + cols, mask=inside, other=0.0).to(tl.float32) * r
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def run_rms_silu_mul_kernel(x: torch.Tensor, gate_up: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_silu_mul` by its Triton kernel: a program per (row, block of 1024 columns)."""
    if triton is None:
        raise RuntimeError("rms_silu_mul's kernel needs Triton")
    x, gate_up = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, gate_up))
    B, H = x.shape
    I = gate_up.shape[1] // 2
    out = torch.empty(B, I, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _rms_silu_mul_kernel[(B, -(-I // block))](
        x, gate_up, out, H, I, eps, x.stride(0), gate_up.stride(0), out.stride(0), BLOCK_H=1024, BLOCK_I=block
    )
    return out


@torch.library.custom_op("grpo_plugins::rms_silu_mul", mutates_args=())
def rms_silu_mul(x: torch.Tensor, gate_up: torch.Tensor, eps: float) -> torch.Tensor:
    """The MLP's activation for a gate/up product ``gate_up`` (B, 2I) of the residual stream ``x``
    (B, H) with the post-attention norm's weight folded in: ``silu(gate * r) * (up * r)``,
    r = 1/rms(x) -> (B, I). One Triton kernel on a GPU (row norm and activation together)."""
    if x.device.type == "cuda" and triton is not None:
        return run_rms_silu_mul_kernel(x, gate_up, eps)
    return rms_silu_mul_torch(x, gate_up, eps)


@rms_silu_mul.register_fake
def _(x, gate_up, eps):  # type: ignore[no-untyped-def]
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@functools.cache
def triton_norms_fault(device: torch.device, head_dim: int, groups: int, dtype: torch.dtype) -> str | None:
    """Why the Triton forms cannot be trusted on ``device`` (None: on a small case they agree
    with the torch forms); checked once per device and head shape."""
    fault = check_norm_kernels(device, head_dim, groups, dtype)
    if fault is not None:
        logger.warning("the decode norms stay unfolded on %s: %s", device, fault)
    return fault


def check_norm_kernels(device: torch.device, head_dim: int, groups: int, dtype: torch.dtype) -> str | None:
    """Run both Triton forms and their torch forms on the same inputs; a message if they differ."""
    B, Hkv, S, W, H, I = 3, 2, 200, 150, 96, 80
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, k, v, x = rand(B, Hkv * groups, head_dim), rand(B, Hkv, head_dim), rand(B, Hkv, head_dim), rand(B, H)
    qkv_bias = rand((groups + 2) * Hkv * head_dim)
    angles = torch.rand(B, head_dim // 2, generator=g) * 6.3
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(device=device, dtype=dtype) for f in (torch.cos, torch.sin))
    caches = [rand(B, Hkv, S, head_dim) for _ in range(2)]
    index = torch.tensor([W - 20], device=device)
    bias = torch.zeros(B, W, device=device)
    bias[:, W - 19 :] = float("-inf")
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    try:
        want = normed_rope_window_attention_torch(q, k, v, x, qkv_bias, 1e-6, cos, sin, *(c.clone() for c in caches), index, bias, head_dim**-0.5)
        got = run_rope_kernel(q, k, v, cos, sin, *(c.clone() for c in caches), index, bias, head_dim**-0.5, x=x, qkv_bias=qkv_bias, eps=1e-6)
        gate_up = rand(B, 2 * I)
        want_mlp, got_mlp = rms_silu_mul_torch(x, gate_up, 1e-6), run_rms_silu_mul_kernel(x, gate_up, 1e-6)
    except Exception as error:  # a Triton or driver that cannot build the kernels
        return f"the kernels do not run ({type(error).__name__}: {error})"
    for name, a, b in (("attention", got, want), ("SiLU-multiply", got_mlp, want_mlp)):
        if not torch.allclose(a.float(), b.float(), atol=tolerance, rtol=tolerance):
            return f"the normed {name} differs from the torch form by {(a.float() - b.float()).abs().max().item():.3g}"
    return None
