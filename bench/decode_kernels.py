"""A decode layer as seven Triton kernels launched back to back, with and without programmatic
dependent launch (PDL): an experiment on the static generator's decode step (a negative result,
bench/RESULTS.md; profile_decode's ``kernels`` variants and pdl_chain's ``--kernels`` run it).

At 64 rows a decode step is a chain of ~10 kernels per layer, each of which streams a little
memory after a fixed start-up and ramp-down of a few microseconds. This path cuts the chain to
seven kernels per layer and can launch each with PDL, so that a kernel's programs start - and
load their first blocks of weights - while the one before it finishes:

1. :func:`run_add_rms_norm`: the residual addition (the previous product's split-K partial sums
   added in a fixed order, rounded to the model's dtype) and the RMSNorm;
2. the q/k/v product with its bias (:func:`product`, operands swapped: a tile of weight rows
   times all the batch's rows);
3. the static generator's decode attention kernel;
4. the o product, its partial sums left for 5.;
5. :func:`run_add_rms_norm` again;
6. the gate/up product with SiLU(gate) * up in its epilogue;
7. the down product, its partial sums left for the next layer's 1. (or the final norm).

Every intermediate is rounded to the model's dtype where the torch layer rounds it, so the path
computes the layer's own arithmetic up to the order of float32 additions.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from grpo_plugins.generators.persistent_layer import norm_eps, pending_parts

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without programmatic dependent launch
    gdc_launch_dependents = gdc_wait = None

#: The most rows (decode batch) the kernels take: all of them are one tile of the products.
MAX_ROWS = 128

if triton is not None:
    from grpo_plugins.generators.persistent_kernels import add_norm_store, silu_times

    @triton.jit
    def _peeled(w_rows, u_rows, x_rows, rows, k_per_split, BLOCK_K: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr, PRE: tl.constexpr):
        """The K loop with its first PRE weight blocks loaded before the wait (PDL): the weights
        do not depend on the kernel before, so they load while that kernel finishes."""
        w0 = tl.load(w_rows)
        u0 = tl.load(u_rows) if GATED else w0
        if PRE > 1:
            w1 = tl.load(w_rows + BLOCK_K)
            u1 = tl.load(u_rows + BLOCK_K) if GATED else w1
        if PRE > 2:
            w2 = tl.load(w_rows + 2 * BLOCK_K)
            u2 = tl.load(u_rows + 2 * BLOCK_K) if GATED else w2
        if PRE > 3:
            w3 = tl.load(w_rows + 3 * BLOCK_K)
            u3 = tl.load(u_rows + 3 * BLOCK_K) if GATED else w3
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        x = tl.trans(tl.load(x_rows, mask=rows, other=0.0))  # (BLOCK_K, BLOCK_M)
        acc = tl.dot(w0, x)  # (BLOCK_N, BLOCK_M) float32
        acc_u = tl.dot(u0, x) if GATED else acc
        if PRE > 1:
            x = tl.trans(tl.load(x_rows + BLOCK_K, mask=rows, other=0.0))
            acc = tl.dot(w1, x, acc)
            acc_u = tl.dot(u1, x, acc_u) if GATED else acc
        if PRE > 2:
            x = tl.trans(tl.load(x_rows + 2 * BLOCK_K, mask=rows, other=0.0))
            acc = tl.dot(w2, x, acc)
            acc_u = tl.dot(u2, x, acc_u) if GATED else acc
        if PRE > 3:
            x = tl.trans(tl.load(x_rows + 3 * BLOCK_K, mask=rows, other=0.0))
            acc = tl.dot(w3, x, acc)
            acc_u = tl.dot(u3, x, acc_u) if GATED else acc
        for k in range(PRE * BLOCK_K, k_per_split, BLOCK_K):
            x = tl.trans(tl.load(x_rows + k, mask=rows, other=0.0))
            acc = tl.dot(tl.load(w_rows + k), x, acc)
            if GATED:
                acc_u = tl.dot(tl.load(u_rows + k), x, acc_u)
        return acc, acc_u

    @triton.jit
    def _product_kernel(
        w_ptr, x_ptr, out_ptr, bias_ptr, M, N, K, k_per_split, stride_x, stride_out,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT: tl.constexpr, BIAS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr, PRE: tl.constexpr,
        PEEL: tl.constexpr,
    ):
        """x (M, K) @ w (N, K).T for BLOCK_N output columns and this program's part of K.
        GATED: w is (2N, K), gate rows over up rows; stores SiLU(x @ gate.T) * (x @ up.T).
        SPLIT > 1: stores float32 partial sums (SPLIT, M, N) (no bias) for add_rms_norm.
        PEEL: the first PRE (1-4) blocks of weights are loaded outside the K loop, before the
        wait for the kernel before (PDL); else one loop, which Triton pipelines from its start
        (the wait, with PDL, before it)."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = tl.program_id(1) * k_per_split
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + rn[:, None].to(tl.int64) * K + k_start + rk[None, :]
        u_rows = w_rows + N * K
        x_rows = x_ptr + rm[:, None] * stride_x + k_start + rk[None, :]
        rows = rm[:, None] < M
        if not PEEL:
            if PDL:
                gdc_launch_dependents()
                gdc_wait()
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for k in range(0, k_per_split, BLOCK_K):
                x = tl.trans(tl.load(x_rows + k, mask=rows, other=0.0))
                acc = tl.dot(tl.load(w_rows + k), x, acc)
                if GATED:
                    acc_u = tl.dot(tl.load(u_rows + k), x, acc_u)
        else:
            acc, acc_u = _peeled(w_rows, u_rows, x_rows, rows, k_per_split, BLOCK_K, GATED, PDL, PRE)
        dtype = x_ptr.dtype.element_ty
        stored = rm[None, :] < M
        if SPLIT > 1:
            tl.store(out_ptr + (tl.program_id(1) * M + rm[None, :]) * N + rn[:, None], acc, mask=stored)
        else:
            if BIAS:
                acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
                if GATED:
                    acc_u += tl.load(bias_ptr + N + rn).to(tl.float32)[:, None]
            if GATED:
                acc = silu_times(acc, acc_u, dtype)
            tl.store(out_ptr + rm[None, :] * stride_out + rn[:, None], acc.to(dtype), mask=stored)

    @triton.jit
    def _add_rms_norm_kernel(
        h_ptr, parts_ptr, bias_ptr, w_ptr, h_out_ptr, x_out_ptr, N, eps, stride_h, stride_parts, stride_part_row,
        SPLIT: tl.constexpr, BLOCK: tl.constexpr, BIAS: tl.constexpr, PDL: tl.constexpr,
    ):
        """Row m: h' = h + round(sum of the SPLIT parts (+ bias)), rounded; x = RMSNorm(h') * w."""
        m = tl.program_id(0)
        rn = tl.arange(0, BLOCK)
        inside = rn < N
        weight = tl.load(w_ptr + rn, mask=inside, other=0.0).to(tl.float32)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        total = tl.zeros((BLOCK,), tl.float32)
        for s in tl.static_range(SPLIT):
            total += tl.load(parts_ptr + s * stride_parts + m * stride_part_row + rn, mask=inside, other=0.0).to(tl.float32)
        if BIAS:
            total += tl.load(bias_ptr + rn, mask=inside, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + m * stride_h + rn, mask=inside, other=0.0).to(tl.float32)
        add_norm_store(h, total, weight, eps, N, h_out_ptr + m * N + rn, x_out_ptr + m * N + rn, inside)


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


#: Shared memory per multiprocessor that the programs' pipelines may fill (Hopper: 227 KiB).
SHARED_MEMORY = 227 * 1024
STAGES = 4
#: Blocks of weights each product loads before it waits for the kernel before (1-4), where
#: PEEL: the K loop's first blocks outside the loop (measured at 43d9c22 / ade5388, always so).
PRE_BLOCKS = 1
PEEL = False


#: "waves" (:func:`plan`'s model) or "wide" (:func:`wide_plan`)
PLAN = "waves"


def wide_plan(M: int, N: int, K: int, sms: int, gated: bool = False, whole: bool = False) -> dict[str, int]:
    """64-row weight tiles wherever they give every multiprocessor a program, K split into the
    fewest whole-block parts (at most 8) that do; products that are not split (``gated``,
    ``whole``) take the widest tile that gives every multiprocessor a program (16 rows at least)."""
    sizes = [b for b in (64, 32, 16) if N % b == 0]
    block_k = 128 if K % 128 == 0 else 64
    blocks = K // block_k
    if gated or whole:  # three stages: a gated 64-row tile's four would overflow shared memory
        block_n = next((b for b in sizes if N // b >= sms), sizes[-1])
        return {"block_n": block_n, "block_k": block_k, "split": 1, "num_warps": 4, "num_stages": 3, "pre": PRE_BLOCKS, "peel": PEEL}
    fits = [s for s in range(1, 9) if blocks % s == 0]
    split = next((s for s in fits if (N // sizes[0]) * s >= sms), fits[-1])
    return {"block_n": sizes[0], "block_k": block_k, "split": split, "num_warps": 4, "num_stages": 4, "pre": PRE_BLOCKS, "peel": PEEL}


def plan(M: int, N: int, K: int, sms: int, gated: bool = False, whole: bool = False) -> dict[str, int]:
    """Launch settings of an (M, K) x (N, K).T product: weight tiles of 64, 32 or 16 rows, K in
    128-deep blocks, split into equal parts (at most 8; not for ``gated`` products, whose
    epilogue needs whole sums, nor where the caller wants ``whole`` sums). Chosen to give the busiest multiprocessor the fewest weight bytes: a
    program's tile times its part of K, times the waves its programs come in (as many at once
    per multiprocessor as their pipelines fit its shared memory); ties go to larger tiles
    (fewer re-reads of the input), then to fewer parts."""
    block_k = 128 if K % 128 == 0 else 64
    block_m = max(16, 1 << (M - 1).bit_length())
    blocks = K // block_k
    best: tuple[tuple[float, int, int], int, int] | None = None
    for block_n in (b for b in (64, 32, 16) if N % b == 0):
        shared = STAGES * block_k * 2 * (block_n * (2 if gated else 1) + block_m)
        at_once = sms * max(1, SHARED_MEMORY // shared)
        for split in [1] if gated or whole else [s for s in range(1, 9) if blocks % s == 0]:
            waves = -(-(N // block_n) * split // at_once)
            cost = (waves * block_n * (2 if gated else 1) * K / split, -block_n, split)
            if best is None or cost < best[0]:
                best = (cost, block_n, split)
    assert best is not None, f"no tile divides {N} rows"
    return {"block_n": best[1], "block_k": block_k, "split": best[2], "num_warps": 4, "num_stages": STAGES, "pre": PRE_BLOCKS, "peel": PEEL}


def product(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, gated: bool = False, split_out: bool = False,
    pdl: bool = True, config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``x`` (M, K) @ ``w`` (N, K).T (+ ``bias``) in ``x``'s dtype, M <= :data:`MAX_ROWS`.
    ``gated``: ``w`` is gate over up rows (2I, K); returns SiLU(gate) * up (M, I).
    ``split_out``: returns the (S, M, N) float32 partial sums over K (the bias left to the
    consumer) wherever :func:`plan` splits K, else (1, M, N) in x's dtype with the bias.
    ``config``: launch settings instead of :func:`plan`'s (benchmarks)."""
    M, K = x.shape
    N = w.shape[0] // 2 if gated else w.shape[0]
    chosen = wide_plan if PLAN == "wide" else plan
    settings = chosen(M, N, K, _sms(x.device), gated, whole=not split_out) | (config or {})
    split = settings["split"] if split_out and not gated else 1
    if N % settings["block_n"] or K % (split * settings["block_k"]):
        raise ValueError(f"launch settings {settings} do not divide an ({N}, {K}) weight")
    if split == 1:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _product_kernel[(N // settings["block_n"], split)](
        w, x, out, w if bias is None else bias, M, N, K, K // split, x.stride(0), N,
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=settings["block_n"], BLOCK_K=settings["block_k"],
        SPLIT=split, BIAS=bias is not None and split == 1, GATED=gated, PDL=pdl, PRE=min(settings["pre"], K // split // settings["block_k"]), PEEL=bool(settings["peel"]),
        num_warps=settings["num_warps"], num_stages=settings["num_stages"], **({"launch_pdl": True} if pdl else {}),
    )
    return out if split > 1 or not split_out else out[None]


def run_add_rms_norm(
    h: torch.Tensor, parts: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor, eps: float, pdl: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h`` (M, N) plus the sum of ``parts`` (S, M, N) (+ ``bias``), each rounded to ``h``'s
    dtype as a product's output and a residual addition are, and that sum's RMSNorm times
    ``weight``: returns (h', RMSNorm(h') * weight)."""
    M, N = h.shape
    h_out = torch.empty_like(h)
    x_out = torch.empty_like(h)
    _add_rms_norm_kernel[(M,)](
        h, parts, weight if bias is None else bias, weight, h_out, x_out, N, eps, h.stride(0), parts.stride(0), parts.stride(1),
        SPLIT=parts.shape[0], BLOCK=triton.next_power_of_2(N), BIAS=bias is not None, PDL=pdl,
        num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )
    return h_out, x_out


@torch.library.custom_op("grpo_bench::add_rms_norm", mutates_args=())
def add_rms_norm(h: torch.Tensor, parts: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool) -> torch.Tensor:
    """:func:`run_add_rms_norm`'s normed output, as an op ``torch.compile`` can call (the final
    norm before the LM head)."""
    return run_add_rms_norm(h, parts, None, weight, eps, pdl)[1]


@add_rms_norm.register_fake
def _(h: torch.Tensor, parts: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool) -> torch.Tensor:
    return torch.empty_like(h)


def kernel_decode_layer(
    parts: Any, layer: Any, h: torch.Tensor, pending: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_all: torch.Tensor, v_all: torch.Tensor, bias: torch.Tensor, index: torch.Tensor, pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The static decode loop's ``decode_layer`` as the seven kernels of this module (a merged
    16-bit layer with RMSNorms and SiLU, no query/key norms, no o or down bias, at most
    :data:`MAX_ROWS` rows): the same arguments and residual hand-over, except that the returned
    pending addend is the down product's (S, B, H) partial sums."""
    from grpo_plugins.generators.decode_attention import run_rope_kernel

    B = h.shape[0]
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    h2, x = run_add_rms_norm(h.reshape(B, -1), pending_parts(pending, B), None, norm1.weight, norm_eps(norm1), pdl)
    qkv = product(x, attn.qkv_proj.weight, attn.qkv_proj.bias, pdl=pdl)
    nq, nk = parts.num_heads * parts.head_dim, parts.num_kv_heads * parts.head_dim
    q = qkv[:, :nq].view(B, parts.num_heads, parts.head_dim)
    k = qkv[:, nq : nq + nk].view(B, parts.num_kv_heads, parts.head_dim)
    v = qkv[:, nq + nk :].view(B, parts.num_kv_heads, parts.head_dim)
    o = run_rope_kernel(q, k, v, cos[:, 0], sin[:, 0], k_all, v_all, index, bias, parts.scaling, pdl=pdl)
    o_parts = product(o.reshape(B, -1), attn.o_proj.weight, split_out=True, pdl=pdl)
    h2, x = run_add_rms_norm(h2, o_parts, None, norm2.weight, norm_eps(norm2), pdl)
    act = product(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, gated=True, pdl=pdl)
    return h2.view(B, 1, -1), product(act, mlp.down_proj.weight, split_out=True, pdl=pdl)


def kernel_final_norm(parts: Any, h: torch.Tensor, pending: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """The final norm of ``h`` plus the last :func:`kernel_decode_layer`'s pending partial sums (B, 1, H)."""
    B = h.shape[0]
    return add_rms_norm(h.reshape(B, -1), pending_parts(pending, B), parts.norm.weight, norm_eps(parts.norm), pdl).view(B, 1, -1)


def kernel_decode_head(
    parts: Any, st: Any, s: Any, pad_id: int, stop_at_eos: bool, h: torch.Tensor, pending: torch.Tensor, pdl: bool = True
) -> None:
    """The static loop's ``decode_head`` after :func:`kernel_decode_layer` layers."""
    from grpo_plugins.generators.static_steps import sample_and_record

    sample_and_record(parts, st, s, pad_id, stop_at_eos, kernel_final_norm(parts, h, pending, pdl))
