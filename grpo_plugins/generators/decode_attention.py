"""Attention for one new token per row over a window of the static KV cache.

Two implementations of the decode layer's attention:

- torch operations (:func:`rope_window_attention`): RoPE on the new query and key, the key and
  value written into the cache, then :func:`window_attention`, two batched products and a
  softmax; runs anywhere;
- one Triton kernel (:func:`fused_rope_window_attention`) doing all of it: one program per
  (row, key/value head) rotates the new query heads and key, writes the key and value, and
  holds the G query heads as G rows of one tile (padded to 16, the smallest ``tl.dot`` tile)
  while it keeps an online softmax over blocks of the window, reading each key and value once.
  It never reads back the slot it writes: the new token's score and value enter from
  registers, so no load waits on a store. At 7B on an H200 the attention alone as one kernel
  took 5.7 instead of 6.7 ms per token; the RoPE and cache writes it took over were three more
  kernels per layer (~5.8 us per layer at 1.5B). A long window is split over several programs
  per (row, head) (:func:`window_splits`), each keeping its own softmax sums, which a second
  kernel combines: one program's chain of block loads grows with the window, and at 64 rows
  there are only rows x key/value heads programs to begin with (128 at 1.5B).

The kernel computes the scores in float32 where the products compute them in the model's
dtype; the probabilities enter the value product in the model's dtype in both. Because a GPU
kernel cannot be checked on the machines that build this project, the decoder checks it against
the torch operations once per device before using it (:func:`use_fused_attention`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from grpo_plugins.errors import GRPOPluginsError

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without programmatic dependent launch (pdl=True then fails)
    gdc_launch_dependents = gdc_wait = None

#: Keys per block of the kernel's loop over the window.
BLOCK_W = 64
#: Windows of at most this many blocks stay in one program; longer ones may be split over several
#: programs (flash-decoding), each walking at least MIN_BLOCKS_PER_SPLIT blocks, at most
#: MAX_SPLITS programs per (row, key/value head).
BLOCKS_PER_SPLIT = 4
MIN_BLOCKS_PER_SPLIT = 2
MAX_SPLITS = 16
#: Head-dimension lanes (programs x head_dim) per streaming multiprocessor that keep the cache
#: reads at full speed. Measured on an H100 (bench/decode_attention.py): 128 programs of head
#: dim 128 read a long window fastest unsplit; 128 programs of head dim 64, or 64 of 128, read
#: it fastest in two parts; further splits only add the combine's cost.
LANES_PER_SM = 120


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation of the last dimension's halves: (a, b) -> (-b, a)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def window_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of ``q`` (B, Hkv, G, D) - the G query heads that share a key/value head - over
    ``keys``/``values`` (B, Hkv, W, D) with the additive mask ``bias`` (B, W) -> (B, Hkv, G, D).
    Grouped-query attention without repeating the cache: G rows of one (G, D) x (D, W) product."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale + bias[:, None, None, :].to(q.dtype)
    probs = scores.float().softmax(dim=-1).to(values.dtype)
    return torch.matmul(probs, values)


def fused_attention_unsupported(device: torch.device, head_dim: int, groups: int, dtype: torch.dtype) -> str | None:
    """Why :func:`fused_rope_window_attention` cannot run for these heads on ``device`` (None: it can)."""
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
    run when None; asking for it where it cannot run is an error naming the setting. Where it
    could run, the kernel is first checked once per device against the torch operations."""
    groups = parts.num_heads // parts.num_kv_heads
    weight = parts.embed.weight
    unsupported = fused_attention_unsupported(weight.device, parts.head_dim, groups, weight.dtype)
    if unsupported is None and wanted is not False:
        unsupported = _kernel_fault(weight.device, parts.head_dim, groups, weight.dtype)
        if unsupported is None:  # checked here, before any graph capture: run_rope_kernel reads it
            _split_fault(weight.device, parts.head_dim, groups, weight.dtype)
    if wanted and unsupported is not None:
        raise GRPOPluginsError(f"generator 'static': fused_attention cannot run here: {unsupported}; set fused_attention: false")
    return unsupported is None if wanted is None else wanted


@functools.cache
def _kernel_fault(device: torch.device, head_dim: int, groups: int, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot be trusted for these heads on ``device`` (None: it agrees with
    the torch operations on a small case with a window of several blocks); checked once."""
    fault = check_kernel(device, head_dim, groups, dtype)
    if fault is not None:
        logger.warning("the fused decode attention is off on %s: %s", device, fault)
    return fault


@functools.cache
def _split_fault(device: torch.device, head_dim: int, groups: int, dtype: torch.dtype) -> str | None:
    """Why a window split over several programs cannot be trusted (None: it agrees with the
    torch operations); without it every window stays in one program. Checked once."""
    fault = check_kernel(device, head_dim, groups, dtype, splits=3)
    if fault is not None:
        logger.warning("the fused decode attention keeps each window in one program on %s: %s", device, fault)
    return fault


def check_kernel(device: torch.device, head_dim: int, groups: int, dtype: torch.dtype, splits: int = 1) -> str | None:
    """Run the kernel (the window in ``splits`` parts) and the torch operations on the same
    inputs; a message if they differ."""
    B, Hkv, S, W = 3, 2, 200, 150
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, k, v = rand(B, Hkv * groups, head_dim), rand(B, Hkv, head_dim), rand(B, Hkv, head_dim)
    angles = torch.rand(B, head_dim // 2, generator=g) * 6.3
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(device=device, dtype=dtype) for f in (torch.cos, torch.sin))
    caches = [rand(B, Hkv, S, head_dim) for _ in range(2)]
    index = torch.tensor([W - 20], device=device)
    bias = torch.zeros(B, W, device=device)
    bias[:, W - 19 :] = float("-inf")  # slots after the new token
    bias[0, :70] = float("-inf")  # a left-padded row
    want_k, want_v = (c.clone() for c in caches)
    want = rope_window_attention(q, k, v, cos, sin, want_k, want_v, index, bias, head_dim**-0.5)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    others = torch.arange(S, device=device) != index
    # Fused multiply-adds may round the rotated key once where torch rounds twice: one step of
    # the cache's precision at most.
    step = 1e-5 if dtype == torch.float32 else 2**-7
    try:
        got_k, got_v = (c.clone() for c in caches)
        got = run_rope_kernel(q, k, v, cos, sin, got_k, got_v, index, bias, head_dim**-0.5, splits=splits)
    except Exception as error:  # a Triton or driver that cannot build the kernel
        return f"the kernel does not run ({type(error).__name__}: {error})"
    if not (torch.equal(got_k[:, :, others], want_k[:, :, others]) and torch.equal(got_v, want_v)):
        return "the kernel changed other cache slots or values than the torch operations"
    if not torch.allclose(got_k[:, :, index].float(), want_k[:, :, index].float(), rtol=step, atol=step):
        return "the kernel wrote other keys into the cache than the torch operations"
    if not torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance):
        difference = (got.float() - want.float()).abs().max().item()
        return f"its attention ({splits} part(s) of the window) differs from the torch operations' by {difference:.3g}"
    return None


if triton is not None:

    @triton.jit
    def rope_window_attend(
        b, h, split, pid, cos, sin, cur,
        q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, bias_ptr, o_ptr, part_ptr, stat_ptr,
        W, per_split, splits, scale,
        stride_qb, stride_kb, stride_vb,
        stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, stride_bb,
        HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
        PARTIAL: tl.constexpr, EARLY: tl.constexpr, QKV_LOADS: tl.constexpr,
    ):
        """The attention of row ``b``'s key/value head ``h`` over part ``split`` of the window
        (``pid``: the (row, head) pair's index), given the new token's rotation (``cos``, ``sin``,
        sign folded in) and slot ``cur``. QKV_LOADS: the cache modifier of the q, k and v loads,
        "" where the kernel before wrote them, ".cg" where other programs of the same launch did
        (a persistent kernel's: the loads bypass the multiprocessor's L1 cache)."""
        rg = tl.arange(0, GP)
        rd = tl.arange(0, D)
        turn = (rd + D // 2) % D  # rotate_half: x[d + D/2] (negated) in the first half, x[d - D/2] in the second
        dtype = kc_ptr.dtype.element_ty
        heads = q_ptr + b * stride_qb + (h * G + rg)[:, None] * D
        live = rg[:, None] < G
        q = tl.load(heads + rd[None, :], mask=live, other=0.0, cache_modifier=QKV_LOADS).to(tl.float32)
        q = (q * cos[None, :] + tl.load(heads + turn[None, :], mask=live, other=0.0, cache_modifier=QKV_LOADS).to(tl.float32) * sin[None, :]).to(dtype)  # (GP, D)
        key = k_ptr + b * stride_kb + h * D
        k_new = (tl.load(key + rd, cache_modifier=QKV_LOADS).to(tl.float32) * cos + tl.load(key + turn, cache_modifier=QKV_LOADS).to(tl.float32) * sin).to(dtype)  # (D,)
        v_new = tl.load(v_ptr + b * stride_vb + h * D + rd, cache_modifier=QKV_LOADS).to(dtype)
        k_base = kc_ptr + b * stride_kcb + h * stride_kch
        v_base = vc_ptr + b * stride_vcb + h * stride_vch
        if split == 0:  # one program per (row, head) writes; no program reads the slot back
            tl.store(k_base + cur * stride_kcs + rd, k_new)
            tl.store(v_base + cur * stride_vcs + rd, v_new)
        score_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale  # (GP,)
        m = tl.full((GP,), float("-inf"), tl.float32)
        total = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        start = split * per_split
        for w0 in range(start, tl.minimum(start + per_split, W), BLOCK):
            rw = w0 + tl.arange(0, BLOCK)
            inside = rw < W
            # The slot written above is not read back; or (EARLY) it is read, old or new value
            # alike, and not used, so that no load waits for the index.
            stored = inside if EARLY else inside & (rw != cur)
            k = tl.load(k_base + rw[:, None] * stride_kcs + rd[None, :], mask=stored[:, None], other=0.0)  # (BLOCK, D)
            s = tl.dot(q, tl.trans(k)) * scale  # (GP, BLOCK) float32
            s = tl.where((rw == cur)[None, :], score_new[:, None], s)
            s += tl.load(bias_ptr + b * stride_bb + rw, mask=inside, other=float("-inf"))[None, :]
            m_new = tl.maximum(m, tl.max(s, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of masked slots only
            alpha = tl.exp(m - shift)
            p = tl.exp(s - shift[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + rw[:, None] * stride_vcs + rd[None, :], mask=stored[:, None], other=0.0)  # (BLOCK, D)
            if EARLY:
                v = tl.where((rw == cur)[:, None], 0.0, v)
            p16 = p.to(dtype)
            p_new = tl.sum(tl.where((rw == cur)[None, :], p16.to(tl.float32), 0.0), 1)  # (GP,)
            acc = acc * alpha[:, None] + tl.dot(p16, v) + p_new[:, None] * v_new.to(tl.float32)[None, :]
            m = m_new
        if not PARTIAL:
            tl.store(o_ptr + (b * HKV + h) * G * D + rg[:, None] * D + rd[None, :], acc / total[:, None], mask=live)
        else:  # this part of the window's running max, sum and weighted values, for _combine_kernel
            row = (pid * splits + split) * GP + rg
            tl.store(part_ptr + row[:, None] * D + rd[None, :], acc, mask=live)
            tl.store(stat_ptr + 2 * row, m, mask=rg < G)
            tl.store(stat_ptr + 2 * row + 1, total, mask=rg < G)

    @triton.jit
    def rotation(cos_ptr, sin_ptr, b, stride_cb, stride_sb, D: tl.constexpr):
        """Row ``b``'s RoPE cos and sin (the sin with rotate_half's sign folded in), float32 (D,)."""
        rd = tl.arange(0, D)
        sign = tl.where(rd < D // 2, -1.0, 1.0)
        return tl.load(cos_ptr + b * stride_cb + rd).to(tl.float32), tl.load(sin_ptr + b * stride_sb + rd).to(tl.float32) * sign

    @triton.jit
    def _rope_window_attention_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, index_ptr, bias_ptr, o_ptr, part_ptr, stat_ptr,
        W, per_split, splits, scale,
        stride_qb, stride_kb, stride_vb, stride_cb, stride_sb,
        stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, stride_bb,
        HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
        PARTIAL: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    ):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // HKV
        cos, sin = rotation(cos_ptr, sin_ptr, b, stride_cb, stride_sb, D)
        cur = tl.load(index_ptr)
        if PDL:  # launched early (programmatic dependent launch): q, k and v are the kernel before's
            # output; the rotation and the index were written before the step's first PDL launch,
            # the cache's other slots by earlier steps.
            gdc_launch_dependents()
            gdc_wait()
        rope_window_attend(
            b, pid % HKV, split, pid, cos, sin, cur, q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, bias_ptr, o_ptr, part_ptr, stat_ptr,
            W, per_split, splits, scale, stride_qb, stride_kb, stride_vb,
            stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, stride_bb,
            HKV, G, GP, D, BLOCK, PARTIAL, EARLY, "",
        )

    @triton.jit
    def _combine_kernel(o_ptr, part_ptr, stat_ptr, splits, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        pid = tl.program_id(0)
        rg = tl.arange(0, GP)
        rd = tl.arange(0, D)
        live = rg < G
        top = tl.full((GP,), float("-inf"), tl.float32)
        for part in range(splits):
            top = tl.maximum(top, tl.load(stat_ptr + 2 * ((pid * splits + part) * GP + rg), mask=live, other=float("-inf")))
        top = tl.where(top == float("-inf"), 0.0, top)  # padding lanes only: the new token keeps a live row finite
        total = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        for part in range(splits):
            row = (pid * splits + part) * GP + rg
            weight = tl.exp(tl.load(stat_ptr + 2 * row, mask=live, other=float("-inf")) - top)  # 0 for an all-masked part
            total += weight * tl.load(stat_ptr + 2 * row + 1, mask=live, other=0.0)
            acc += weight[:, None] * tl.load(part_ptr + row[:, None] * D + rd[None, :], mask=live[:, None], other=0.0)
        tl.store(o_ptr + pid * G * D + rg[:, None] * D + rd[None, :], acc / total[:, None], mask=live[:, None])


def window_splits(W: int, lanes: int, sms: int) -> int:
    """Programs per (row, key/value head) for a window of W slots, where ``lanes`` is rows x
    key/value heads x head dim and the GPU has ``sms`` multiprocessors: a window longer than
    :data:`BLOCKS_PER_SPLIT` blocks is split until the programs fill the GPU
    (:data:`LANES_PER_SM`), so that few (row, head) pairs still read their windows at once,
    each part at least :data:`MIN_BLOCKS_PER_SPLIT` blocks."""
    blocks = -(-W // BLOCK_W)
    if blocks <= BLOCKS_PER_SPLIT:
        return 1
    wanted = -(-sms * LANES_PER_SM // max(1, lanes))
    return max(1, min(MAX_SPLITS, blocks // MIN_BLOCKS_PER_SPLIT, wanted))


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors (an H100's 132 where there is no CUDA device:
    the CPU tests, through Triton's interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def run_rope_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, bias: torch.Tensor, scale: float,
    splits: int | None = None, block: int = BLOCK_W, warps: int | None = None, stages: int | None = None,
    pdl: bool = False, early: bool = False,
) -> torch.Tensor:
    """:func:`fused_rope_window_attention`'s work by the Triton kernel (see there); ``splits``:
    programs per (row, key/value head), each over its own part of the window, their partial
    softmax sums then combined by a second kernel (None: :func:`window_splits`, where the split
    form passed its check on this device). ``block``, ``warps``, ``stages``: the kernel's keys
    per block and launch settings (None: Triton's defaults), ``pdl`` programmatic dependent
    launch, ``early`` the cache loads without waiting for the new token's index (its slot read
    and discarded), for benchmarks (``bench/pdl_chain.py``, ``bench/decode_attention.py``)."""
    if triton is None:
        raise RuntimeError("the fused decode attention needs Triton")
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    GP = max(16, triton.next_power_of_2(G))
    # Heads may sit inside a wider row (a view of the fused q/k/v product): one row stride each.
    q, k, v = (t if t.stride(2) == 1 and t.stride(1) == D else t.contiguous() for t in (q, k, v))
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's last dimension must be contiguous")
    bias = bias.float().contiguous()
    W = bias.shape[1]
    blocks = -(-W // block)
    if splits is None:
        splits = window_splits(W, B * Hkv * D, multiprocessors(q.device))
        if splits > 1 and _split_fault(q.device, D, G, q.dtype) is not None:
            splits = 1
    splits = min(splits, blocks)
    per_split = -(-blocks // splits) * block
    splits = -(-W // per_split)  # no program without slots
    out = torch.empty(B, Hkv, G, D, dtype=q.dtype, device=q.device)
    if splits > 1:
        parts = torch.empty(B * Hkv * splits * GP, D, dtype=torch.float32, device=q.device)
        stats = torch.empty(B * Hkv * splits * GP, 2, dtype=torch.float32, device=q.device)
    else:
        parts = stats = out  # not read
    _rope_window_attention_kernel[(B * Hkv, splits)](
        q, k, v, cos, sin, k_cache, v_cache, index, bias, out, parts, stats, W, per_split, splits, scale,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bias.stride(0), HKV=Hkv, G=G, GP=GP, D=D, BLOCK=block, PARTIAL=splits > 1, PDL=pdl, EARLY=early,
        **({} if warps is None else {"num_warps": warps}), **({} if stages is None else {"num_stages": stages}),
        **({"launch_pdl": True} if pdl else {}),
    )
    if splits > 1:  # the split count is a runtime argument: one compiled kernel for every window
        _combine_kernel[(B * Hkv,)](out, parts, stats, splits, G=G, GP=GP, D=D, PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    return out


def rope_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, bias: torch.Tensor, scale: float,
) -> torch.Tensor:
    """The torch form of :func:`fused_rope_window_attention`: RoPE on the new token's query and
    key, key and value written at cache slot ``index``, then :func:`window_attention`."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]

    def rope(x: torch.Tensor) -> torch.Tensor:  # in float32, rounded once (as the compiled step does)
        x = x.float()
        return (x * cos[:, None].float() + rotate_half(x) * sin[:, None].float()).to(k_cache.dtype)

    k_cache.index_copy_(2, index, rope(k)[:, :, None])
    v_cache.index_copy_(2, index, v[:, :, None].to(v_cache.dtype))
    W = bias.shape[-1]
    return window_attention(rope(q).view(B, Hkv, Hq // Hkv, D), k_cache[:, :, :W], v_cache[:, :, :W], bias, scale)


@torch.library.custom_op("grpo_plugins::rope_window_attention", mutates_args=("k_cache", "v_cache"))
def fused_rope_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, bias: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One decode layer's attention for one new token per row as one Triton kernel: the rotary
    embedding (``cos``/``sin`` (B, D), rotate-half form) on the new query heads ``q`` (B, Hq, D)
    and key heads ``k`` (B, Hkv, D), the key and value ``v`` (B, Hkv, D) written into
    ``k_cache``/``v_cache`` (B, Hkv, S, D) at slot ``index`` (1,), and attention over the first
    W slots under ``bias`` (B, W) -> (B, Hkv, G, D). An opaque op to ``torch.compile`` that
    updates the caches in place."""
    return run_rope_kernel(q, k, v, cos, sin, k_cache, v_cache, index, bias, scale)


@fused_rope_window_attention.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, index, bias, scale):  # type: ignore[no-untyped-def]
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    return q.new_empty(B, Hkv, Hq // Hkv, D)
