"""The training pass's log-prob chunk as two Triton kernels that each read the logits once: an
experiment on ``grpo_plugins.logprobs.chunk_logps`` (``profile_step.py --fused-logps``).

The compiled chunk (inductor) reads a chunk's (N, V) logits for the maximum, again for the sum
of exponentials (and the entropy metric in the same loop), and the whole chunk runs twice under
checkpointing: at 0.5B x 1024 the forward took 54 ms and the backward 26 ms of a 0.75 s
micro-step (H100, 2026-12-06). Here:

- forward: one program per row keeps a running maximum, sum of exponentials and (for the
  entropy) sum of exponentials times logits per lane over the vocabulary, then combines the
  lanes: one read of the row; stores the log-prob of the target, the log-sum-exp and the entropy;
- backward: one read of the row and one write of its gradient in the logits' dtype,
  ``(onehot(target) - softmax) * g / temperature``, from the saved log-sum-exp.

Logits are divided by the temperature as ``chunk_logps`` does; other logit transforms (scaling,
soft-capping, image placeholders) are not covered, nor the entropy bonus's gradient
(``with_entropy="grad"`` falls back to ``chunk_logps``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from grpo_plugins.logprobs import chunk_logps

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]

#: Vocabulary entries per lane block, and warps per row's program.
BLOCK = 4096
NUM_WARPS = 8

if triton is not None:

    @triton.jit
    def _forward_kernel(
        logits_ptr, stride, targets_ptr, logp_ptr, lse_ptr, ent_ptr, V, temperature,
        BLOCK: tl.constexpr, ENTROPY: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        r = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        t = tl.zeros((BLOCK,), tl.float32)
        for v0 in range(0, V, BLOCK):
            cols = v0 + r
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
            m_new = tl.maximum(m, x)
            empty = m_new == float("-inf")  # a lane that has seen only masked entries
            alpha = tl.where(empty, 0.0, tl.exp(m - m_new))
            p = tl.where(empty, 0.0, tl.exp(x - m_new))
            s = s * alpha + p
            if ENTROPY:
                t = t * alpha + tl.where(p > 0.0, p * x, 0.0)
            m = m_new
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        total = tl.sum(s * w, 0)
        lse = top + tl.log(total)
        target = tl.load(targets_ptr + row)
        tl.store(logp_ptr + row, tl.load(base + target).to(tl.float32) / temperature - lse)
        tl.store(lse_ptr + row, lse)
        if ENTROPY:
            tl.store(ent_ptr + row, lse - tl.sum(t * w, 0) / total)

    @triton.jit
    def _backward_kernel(
        logits_ptr, stride, targets_ptr, lse_ptr, g_ptr, grad_ptr, grad_stride, V, temperature, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        r = tl.arange(0, BLOCK)
        g = tl.load(g_ptr + row)
        lse = tl.load(lse_ptr + row)
        target = tl.load(targets_ptr + row)
        for v0 in range(0, V, BLOCK):
            cols = v0 + r
            inside = cols < V
            x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) / temperature
            grad = tl.where(cols == target, g, 0.0) - g * tl.exp(x - lse)
            tl.store(grad_ptr + row * grad_stride + cols, (grad / temperature).to(grad_ptr.dtype.element_ty), mask=inside)


class FusedLogps(torch.autograd.Function):
    """(logits (N, V), targets (N,)) -> (log-probs (N,), entropy (N,), not differentiable), float32."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, temperature: float, entropy: bool) -> tuple[Tensor, Tensor]:
        N, V = logits.shape
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        logp, lse, ent = (torch.empty(N, dtype=torch.float32, device=logits.device) for _ in range(3))
        _forward_kernel[(N,)](logits, logits.stride(0), targets, logp, lse, ent, V, float(temperature),
                              BLOCK=BLOCK, ENTROPY=entropy, num_warps=NUM_WARPS)
        if not entropy:
            ent.zero_()
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = float(temperature)
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor, g_ent: Tensor) -> tuple[Tensor | None, ...]:
        logits, targets, lse = ctx.saved_tensors
        N, V = logits.shape
        grad = torch.empty_like(logits)
        _backward_kernel[(N,)](logits, logits.stride(0), targets, lse, g_logp.contiguous().float(), grad, grad.stride(0), V,
                               ctx.temperature, BLOCK=BLOCK, num_warps=NUM_WARPS)
        return grad, None, None, None


def fused_chunk_logps(
    hidden: Tensor, targets: Tensor, head: torch.nn.Module, transform: Callable[[Tensor], Tensor],
    with_entropy: bool | str, temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """:func:`grpo_plugins.logprobs.chunk_logps` (a ``ChunkFn``) for logits that are only divided by
    ``temperature``: the head's product, then :class:`FusedLogps` on its logits as they are."""
    if with_entropy == "grad":
        return chunk_logps(hidden, targets, head, transform, with_entropy)
    return FusedLogps.apply(head(hidden), targets, temperature, bool(with_entropy))
