"""A decode layer as one persistent Triton kernel: an experiment on the static generator's decode
step (profile_decode's ``persistent`` variants; bench/RESULTS.md).

At 64 rows every kernel of a decode step pays a fixed few microseconds (launch, the ramp until
its first loads return, the tail while its last programs finish) besides streaming its bytes;
at 1.5B that is ~0.8 of 2.44 ms per token. Here one program per multiprocessor runs the whole
layer, the phases of bench/decode_kernels.py one after another, with a grid-wide barrier
between them instead of a kernel boundary:

0. the residual addition (the layer before's down partial sums) and the first RMSNorm;
1. the q/k/v product with its bias;
2. the decode attention (:func:`grpo_plugins.generators.decode_attention.rope_window_attend`,
   the shipped kernel's body);
3. the o product as partial sums over K;
4. their residual addition and the second RMSNorm;
5. the gate/up product with SiLU(gate) * up in its epilogue;
6. the down product as partial sums over K, left for the next layer's phase 0.

Each phase's work items (row ranges of a weight, times parts of K) are sized so that there are
at most as many as programs: a row range need not be a power of two (the tile is, and masks the
rest), so e.g. gate/up's 8,960 rows split into 132 equal ranges instead of 140 64-row tiles in
two waves. ``ONLY=k`` runs phase k alone, without barriers: seven launches of the same kernel
per layer (Triton's interpreter runs programs one after another, where a barrier would wait
forever, so the CPU tests run this form; on a GPU it is the comparison without barriers).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from bench.decode_kernels import _eps, _pending_parts

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]

#: Keys per block of the attention's loop, deep blocks of the products' K loop, launch settings.
BLOCK_W = 64
BLOCK_K = 64
NUM_WARPS = 8
NUM_STAGES = 4
#: Programs per launch (None: one per multiprocessor); the CPU tests use a few to make programs
#: take several items.
PROGRAMS: int | None = None
#: Largest weight tile (rows): its accumulator (two for gate/up) lives in registers.
MAX_TILE = 128
#: q/k/v as partial sums over two or more parts of K (like o and down: wider tiles, fewer
#: re-reads of the normed input), added with the bias by each attention item for its own heads.
QKV_SPLIT = False
#: Record each program's time at the start, at every barrier (arriving, leaving) and at the end
#: of every layer's kernel (:func:`phase_times` reads the last step's).
TIMES = False
STAMPS = 16
#: Bytes of each weight row (and 8x as many of the attention's keys and values) that a program
#: asks L2 to fetch for its first item of the next phase before it waits at a barrier (0: none;
#: a power of two of at least 16 x the program's threads / its smallest tile's rows).
PREFETCH = 0

if triton is not None:
    from bench.decode_kernels import add_norm_store, silu_times
    from grpo_plugins.generators.decode_attention import rope_window_attend, rotation

    @triton.jit
    def _grid_sync(sync_ptr, NPROG: tl.constexpr):
        """Every program arrives, then waits for all NPROG; what each stored before arriving is
        visible to all after. ``sync_ptr``: an int64 count of arrivals, zero at first and never
        reset (consecutive launches go on counting): a round is complete at the next multiple of
        NPROG. One atomic per program and round, then loads until the round is complete."""
        tl.debug_barrier()  # this program's threads have all stored
        arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
        target = (arrived // NPROG + 1) * NPROG
        if arrived != target - 1:  # the last to arrive has seen everyone's arrival already
            while tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < target:
                pass
        tl.debug_barrier()

    @triton.jit
    def _stamp(times_ptr, pid, k: tl.constexpr):
        """Program ``pid``'s stamp ``k``: the GPU's global nanosecond timer."""
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(times_ptr + pid * 16 + k, now)  # STAMPS per program

    @triton.jit
    def _barrier(sync_ptr, times_ptr, pid, k: tl.constexpr, NPROG: tl.constexpr, ONLY: tl.constexpr, TIMES: tl.constexpr):
        """Barrier k (0-5) between the phases (none where one phase runs alone); TIMES: stamps
        2k + 1 on arriving and 2k + 2 on leaving."""
        if ONLY < 0:
            if TIMES:
                _stamp(times_ptr, pid, 2 * k + 1)
            _grid_sync(sync_ptr, NPROG)
            if TIMES:
                _stamp(times_ptr, pid, 2 * k + 2)

    @triton.jit
    def _prefetch(ptrs, nbytes):
        """Ask L2 to fetch ``nbytes`` (a multiple of 16) from each 16-byte aligned address of
        ``ptrs`` (Hopper's bulk prefetch; nothing waits for it)."""
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r", [ptrs, nbytes],
            dtype=tl.int32, is_pure=False, pack=1,
        )

    @triton.jit
    def _prefetch_item(
        pid, w_ptr, N, K, rows, k_per_split, groups, items,
        GATED: tl.constexpr, BLOCK_N: tl.constexpr, BYTES: tl.constexpr, LANES: tl.constexpr,
    ):
        """The first BYTES (at most to the part's end) of each weight row of this program's first
        item (see :func:`_products`), asked for by its LANES threads in as many separate pieces:
        thread e takes row e % BLOCK_N's piece e // BLOCK_N (a tensor smaller than the program's
        threads would repeat each request on several threads)."""
        if pid < items:
            PIECE: tl.constexpr = BYTES * BLOCK_N // LANES
            e = tl.arange(0, LANES)
            rn = tl.minimum((pid % groups) * rows + tl.minimum(e % BLOCK_N, rows - 1), N - 1)
            k0 = (pid // groups) * k_per_split
            base = w_ptr + rn.to(tl.int64) * K + k0
            offset = (e // BLOCK_N) * PIECE  # bytes into the part
            left = (K - k0) * 2 - offset
            ptrs = tl.where(left > 0, base + offset // 2, base)
            nbytes = tl.where(left > 0, tl.minimum(left, PIECE), 16)
            _prefetch(ptrs, nbytes)
            if GATED:
                _prefetch(ptrs + N * K, nbytes)

    @triton.jit
    def _norm_rows(
        pid, h_ptr, parts_ptr, w_ptr, h_out_ptr, x_out_ptr, M, N, eps, stride_h, stride_parts, stride_part_row,
        NPROG: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
    ):
        """Rows m = pid, pid + NPROG, ...: h' = h + round(sum of the SPLITS parts), rounded; x =
        RMSNorm(h') * w. (SPLITS is a constant so that the parts' loads are all issued at once.)"""
        rn = tl.arange(0, BLOCK)
        inside = rn < N
        weight = tl.load(w_ptr + rn, mask=inside, other=0.0).to(tl.float32)
        for m in range(pid, M, NPROG):
            total = tl.zeros((BLOCK,), tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(parts_ptr + s * stride_parts + m * stride_part_row + rn, mask=inside, other=0.0, cache_modifier=".cg").to(tl.float32)
            h = tl.load(h_ptr + m * stride_h + rn, mask=inside, other=0.0, cache_modifier=".cg").to(tl.float32)
            add_norm_store(h, total, weight, eps, N, h_out_ptr + m * N + rn, x_out_ptr + m * N + rn, inside)

    @triton.jit
    def _sum_columns(parts_ptr, out_ptr, bias_ptr, row, col0, ncols, M, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr, BIAS: tl.constexpr):
        """Row ``row``'s columns [col0, col0 + ncols) of SPLITS (S, M, N) float32 partial sums,
        added in order, plus the bias, rounded into ``out`` (M, N)."""
        rc = tl.arange(0, BLOCK)
        inside = rc < ncols
        cols = col0 + rc
        total = tl.zeros((BLOCK,), tl.float32)
        for s in tl.static_range(SPLITS):
            total += tl.load(parts_ptr + (s * M + row) * N + cols, mask=inside, other=0.0, cache_modifier=".cg")
        if BIAS:
            total += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, total.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _products(
        pid, w_ptr, x_ptr, out_ptr, bias_ptr, M, N, K, rows, k_per_split, groups, items, stride_x, stride_out,
        NPROG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PARTS: tl.constexpr, BIAS: tl.constexpr, GATED: tl.constexpr,
    ):
        """Items pid, pid + NPROG, ...: item i is rows [g * rows, (g + 1) * rows) of the (N, K)
        weight (g = i % groups) times part s = i // groups of K, x (M, K) @ w.T. PARTS: stores
        float32 partial sums (S, M, N); else whole sums (+ bias), GATED: w is (2N, K), gate rows
        over up rows, and the store is SiLU(gate) * up, rounded as the torch layer rounds."""
        rm = tl.arange(0, BLOCK_M)
        rb = tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        live = rm < M
        dtype = x_ptr.dtype.element_ty
        for item in range(pid, items, NPROG):
            g = item % groups
            s = item // groups
            rn = g * rows + rb
            mine = (rb < rows) & (rn < N)
            k0 = s * k_per_split
            w_rows = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
            u_rows = w_rows + N * K
            x_rows = x_ptr + rm[:, None] * stride_x + rk[None, :]
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for k in range(k0, tl.minimum(K, k0 + k_per_split), BLOCK_K):
                x = tl.trans(tl.load(x_rows + k, mask=live[:, None], other=0.0, cache_modifier=".cg"))  # (BLOCK_K, BLOCK_M)
                acc = tl.dot(tl.load(w_rows + k, mask=mine[:, None], other=0.0), x, acc)
                if GATED:
                    acc_u = tl.dot(tl.load(u_rows + k, mask=mine[:, None], other=0.0), x, acc_u)
            stored = mine[:, None] & live[None, :]
            if PARTS:
                tl.store(out_ptr + (s * M + rm[None, :]) * N + rn[:, None], acc, mask=stored)
            else:
                if BIAS:
                    acc += tl.load(bias_ptr + rn, mask=mine, other=0.0).to(tl.float32)[:, None]
                    if GATED:
                        acc_u += tl.load(bias_ptr + N + rn, mask=mine, other=0.0).to(tl.float32)[:, None]
                if GATED:
                    acc = silu_times(acc, acc_u, dtype)
                tl.store(out_ptr + rm[None, :] * stride_out + rn[:, None], acc.to(dtype), mask=stored)

    @triton.jit
    def _layer_kernel(
        h_ptr, pending_ptr, stride_h, stride_pending, stride_pending_row,
        norm1_ptr, norm2_ptr, eps1, eps2,
        h2_ptr, x_ptr, qkv_ptr, qkv_parts_ptr, o_ptr, o_parts_ptr, h3_ptr, x2_ptr, act_ptr, down_parts_ptr,
        wqkv_ptr, bqkv_ptr, wo_ptr, wgu_ptr, bgu_ptr, wd_ptr,
        cos_ptr, sin_ptr, kc_ptr, vc_ptr, index_ptr, bias_ptr, W, window, scale,
        stride_cb, stride_sb, stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, stride_bb,
        M, H, NQKV, I,
        qkv_rows, qkv_kps, qkv_groups, qkv_items,
        o_rows, o_kps, o_groups, o_items,
        gu_rows, gu_groups, gu_items,
        d_rows, d_kps, d_groups, d_items,
        sync_ptr, times_ptr,
        NPROG: tl.constexpr, ONLY: tl.constexpr, TIMES: tl.constexpr, LANES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
        BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr, BLOCK_K: tl.constexpr,
        HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr,
        QKV_BIAS: tl.constexpr, GU_BIAS: tl.constexpr, PREFETCH: tl.constexpr, PENDING_SPLITS: tl.constexpr, O_SPLITS: tl.constexpr,
        QKV_SPLITS: tl.constexpr, BLOCK_QG: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if TIMES:
            _stamp(times_ptr, pid, 0)
        if PREFETCH > 0 and ONLY < 0:
            _prefetch_item(pid, wqkv_ptr, NQKV, H, qkv_rows, H, qkv_groups, qkv_items, False, BN_QKV, PREFETCH, LANES)
        if ONLY < 0 or ONLY == 0:
            _norm_rows(pid, h_ptr, pending_ptr, norm1_ptr, h2_ptr, x_ptr, M, H, eps1, stride_h,
                       stride_pending, stride_pending_row, NPROG, BLOCK_H, PENDING_SPLITS)
        _barrier(sync_ptr, times_ptr, pid, 0, NPROG, ONLY, TIMES)
        if ONLY < 0 or ONLY == 1:
            if QKV_SPLITS > 1:  # partial sums over K, added (with the bias) in the attention phase
                _products(pid, wqkv_ptr, x_ptr, qkv_parts_ptr, bqkv_ptr, M, NQKV, H, qkv_rows, qkv_kps, qkv_groups, qkv_items, H, NQKV,
                          NPROG, BLOCK_M, BN_QKV, BLOCK_K, True, False, False)
            else:
                _products(pid, wqkv_ptr, x_ptr, qkv_ptr, bqkv_ptr, M, NQKV, H, qkv_rows, H, qkv_groups, qkv_items, H, NQKV,
                          NPROG, BLOCK_M, BN_QKV, BLOCK_K, False, QKV_BIAS, False)
        if PREFETCH > 0 and ONLY < 0:
            if pid < M * HKV:  # this program's first (row, head): its keys' and values' first 8 x PREFETCH bytes
                PIECE: tl.constexpr = PREFETCH * 8 // LANES
                offset = tl.arange(0, LANES) * PIECE
                inside = offset < W * D * 2
                kv = pid // HKV * stride_kcb + pid % HKV * stride_kch + tl.where(inside, offset // 2, 0)
                nbytes = tl.where(inside, tl.minimum(W * D * 2 - offset, PIECE), 16)
                _prefetch(kc_ptr + kv, nbytes)
                _prefetch(vc_ptr + kv, nbytes)
        _barrier(sync_ptr, times_ptr, pid, 1, NPROG, ONLY, TIMES)
        if ONLY < 0 or ONLY == 2:
            cur = tl.load(index_ptr)
            for item in range(pid, M * HKV, NPROG):
                b = item // HKV
                if QKV_SPLITS > 1:  # this (row, head)'s q, k and v from the partial sums, by this program for itself
                    hk = item % HKV
                    _sum_columns(qkv_parts_ptr, qkv_ptr, bqkv_ptr, b, hk * G * D, G * D, M, NQKV, QKV_SPLITS, BLOCK_QG, QKV_BIAS)
                    _sum_columns(qkv_parts_ptr, qkv_ptr, bqkv_ptr, b, (HKV * G + hk) * D, D, M, NQKV, QKV_SPLITS, D, QKV_BIAS)
                    _sum_columns(qkv_parts_ptr, qkv_ptr, bqkv_ptr, b, (HKV * G + HKV + hk) * D, D, M, NQKV, QKV_SPLITS, D, QKV_BIAS)
                    tl.debug_barrier()  # the stores above before this program's threads load them
                cos, sin = rotation(cos_ptr, sin_ptr, b, stride_cb, stride_sb, D)
                rope_window_attend(
                    b, item % HKV, 0, item, cos, sin, cur,
                    qkv_ptr, qkv_ptr + HKV * G * D, qkv_ptr + (HKV * G + HKV) * D, kc_ptr, vc_ptr, bias_ptr, o_ptr, o_ptr, o_ptr,
                    W, window, 1, scale, NQKV, NQKV, NQKV,
                    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, stride_bb,
                    HKV, G, GP, D, BLOCK_W, False, False, ".cg",
                )
        if PREFETCH > 0 and ONLY < 0:
            _prefetch_item(pid, wo_ptr, H, HKV * G * D, o_rows, o_kps, o_groups, o_items, False, BN_O, PREFETCH, LANES)
        _barrier(sync_ptr, times_ptr, pid, 2, NPROG, ONLY, TIMES)
        if ONLY < 0 or ONLY == 3:
            _products(pid, wo_ptr, o_ptr, o_parts_ptr, wo_ptr, M, H, HKV * G * D, o_rows, o_kps, o_groups, o_items, HKV * G * D, H,
                      NPROG, BLOCK_M, BN_O, BLOCK_K, True, False, False)
        if PREFETCH > 0 and ONLY < 0:
            _prefetch_item(pid, wgu_ptr, I, H, gu_rows, H, gu_groups, gu_items, True, BN_GU, PREFETCH, LANES)
        _barrier(sync_ptr, times_ptr, pid, 3, NPROG, ONLY, TIMES)
        if ONLY < 0 or ONLY == 4:
            _norm_rows(pid, h2_ptr, o_parts_ptr, norm2_ptr, h3_ptr, x2_ptr, M, H, eps2, H, M * H, H, NPROG, BLOCK_H, O_SPLITS)
        _barrier(sync_ptr, times_ptr, pid, 4, NPROG, ONLY, TIMES)
        if ONLY < 0 or ONLY == 5:
            _products(pid, wgu_ptr, x2_ptr, act_ptr, bgu_ptr, M, I, H, gu_rows, H, gu_groups, gu_items, H, I,
                      NPROG, BLOCK_M, BN_GU, BLOCK_K, False, GU_BIAS, True)
        if PREFETCH > 0 and ONLY < 0:
            _prefetch_item(pid, wd_ptr, H, I, d_rows, d_kps, d_groups, d_items, False, BN_D, PREFETCH, LANES)
        _barrier(sync_ptr, times_ptr, pid, 5, NPROG, ONLY, TIMES)
        if ONLY < 0 or ONLY == 6:
            _products(pid, wd_ptr, act_ptr, down_parts_ptr, wd_ptr, M, H, I, d_rows, d_kps, d_groups, d_items, I, H,
                      NPROG, BLOCK_M, BN_D, BLOCK_K, True, False, False)
        if TIMES:
            _stamp(times_ptr, pid, 13)


def _tile(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def whole_items(N: int, programs: int) -> dict[str, int]:
    """Row ranges of an (N, K) weight whose sums stay whole (one part of K): as many equal
    ranges as programs, each in the smallest power-of-two tile that holds it."""
    rows = -(-N // programs)
    return {"rows": rows, "k_per_split": 0, "groups": -(-N // rows), "splits": 1, "block_n": _tile(rows)}


def split_items(M: int, N: int, K: int, programs: int, block_k: int | None = None, min_parts: int = 1) -> dict[str, int]:
    """Row ranges times parts of K for a product stored as partial sums, at most ``programs``
    items: the split that loads the fewest bytes per program, counting the weight's rows, half
    of the input's (it comes from L2, not memory) and the partial sums' writing and reading;
    at least ``min_parts`` parts of K where K has as many blocks."""
    block_k = block_k or BLOCK_K
    blocks = K // block_k
    best: tuple[float, dict[str, int]] | None = None
    for parts in range(min(min_parts, blocks), min(16, blocks) + 1):
        per_part = -(-blocks // parts)
        splits = -(-blocks // per_part)
        if splits > programs:
            break
        rows = -(-N * splits // programs)
        while -(-N // rows) * splits > programs:
            rows += 1
        if _tile(rows) > MAX_TILE:
            continue
        depth = per_part * block_k
        cost = rows * depth * 2 + 0.5 * max(16, M) * depth * 2 + splits * M * N * 4 * 2 / programs
        if best is None or cost < best[0]:
            best = (cost, {"rows": rows, "k_per_split": depth, "groups": -(-N // rows), "splits": splits, "block_n": _tile(rows)})
    assert best is not None, f"no split of a ({N}, {K}) weight fits {programs} programs"
    return best[1]


@functools.lru_cache(maxsize=None)
def layer_plan(M: int, H: int, QD: int, NQKV: int, I: int, programs: int, qkv_split: bool = False, block_k: int = 64) -> dict[str, dict[str, int]]:
    """Every product's items for a layer of hidden size H, query width QD (heads x head dim),
    q/k/v width NQKV and MLP width I (``qkv_split``: q/k/v as partial sums, see
    :data:`QKV_SPLIT`; ``block_k``: the K loop's block)."""
    if H % block_k or I % block_k or QD % block_k:
        raise ValueError(f"the persistent layer needs hidden, query and MLP sizes that are multiples of {block_k}")
    plan = {
        "qkv": split_items(M, NQKV, H, programs, block_k, min_parts=2) if qkv_split else whole_items(NQKV, programs),
        "o": split_items(M, H, QD, programs, block_k),
        "gate_up": whole_items(I, programs),
        "down": split_items(M, H, I, programs, block_k),
    }
    if max(items["block_n"] for items in plan.values()) > MAX_TILE:
        raise ValueError(f"the persistent layer's tiles hold at most {MAX_TILE} rows: too few programs for this layer")
    return plan


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    if PROGRAMS is not None:
        return PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


_SYNC: dict[torch.device, torch.Tensor] = {}
_TIMES: dict[torch.device, torch.Tensor] = {}
_LAYER_SLOTS: dict[int, int] = {}
PHASES = ("norm1", "qkv", "attention", "o", "norm2", "gate_up", "down")


def _times_buffer(device: torch.device, layer: Any, programs: int) -> torch.Tensor:
    """The stamps of ``layer``'s kernel: a row of a (layers, programs, STAMPS) buffer."""
    slot = _LAYER_SLOTS.setdefault(id(layer), len(_LAYER_SLOTS))
    if device not in _TIMES or _TIMES[device].shape[0] <= slot:
        old = _TIMES.get(device)
        _TIMES[device] = torch.zeros(max(64, 2 * slot + 2), programs, STAMPS, dtype=torch.int64, device=device)
        if old is not None:
            _TIMES[device][: old.shape[0]] = old
    return _TIMES[device][slot]


def phase_times() -> dict[str, dict[str, float]]:
    """From the last recorded step, averaged over the layers, in microseconds: each phase's
    ``work`` (the median program's time from leaving the barrier before to arriving at the one
    after) and ``span`` (first program in to last program out of it, so work + imbalance), and
    each barrier's ``release`` (last arrival to last departure)."""
    if not _TIMES:
        return {}
    t = next(iter(_TIMES.values()))[: len(_LAYER_SLOTS)].double() / 1000.0  # (layers, programs, stamps) us
    out: dict[str, dict[str, float]] = {}
    for p, name in enumerate(PHASES):
        start, end = t[:, :, 2 * p], t[:, :, 2 * p + 1] if p < 6 else t[:, :, 13]
        row = {"work": float((end - start).median(dim=1).values.mean()), "span": float((end.max(1).values - start.min(1).values).mean())}
        if p < 6:
            row["release"] = float((t[:, :, 2 * p + 2].max(1).values - end.max(1).values).mean())
        out[name] = row
    out["layer"] = {"span": float((t[:, :, 13].max(1).values - t[:, :, 0].min(1).values).mean())}
    return out


def _sync_counters(device: torch.device) -> torch.Tensor:
    if device not in _SYNC:
        _SYNC[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return _SYNC[device]


def persistent_decode_layer(
    parts: Any, layer: Any, h: torch.Tensor, pending: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_all: torch.Tensor, v_all: torch.Tensor, bias: torch.Tensor, index: torch.Tensor, phases: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The static decode loop's ``decode_layer`` as one persistent kernel (see the module
    docstring; the same layers as ``bench.decode_kernels.kernel_decode_layer`` take, the same
    residual hand-over). ``phases``: the seven phases as seven launches, without barriers."""
    B = h.shape[0]
    if B > 64:  # the rows are one 64-wide tile of every product
        raise ValueError("the persistent layer takes at most 64 rows")
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    H = h.shape[-1]
    Hq, Hkv, D = parts.num_heads, parts.num_kv_heads, parts.head_dim
    NQKV, I = attn.qkv_proj.weight.shape[0], mlp.down_proj.weight.shape[1]
    programs = _programs(h.device)
    plan = layer_plan(B, H, Hq * D, NQKV, I, programs, QKV_SPLIT, BLOCK_K)
    h2d = h.reshape(B, H)
    pend = _pending_parts(pending, B)
    dtype, dev = h.dtype, h.device
    h2, x, h3, x2 = (torch.empty(B, H, dtype=dtype, device=dev) for _ in range(4))
    qkv = torch.empty(B, NQKV, dtype=dtype, device=dev)
    qkv_parts = torch.empty(plan["qkv"]["splits"], B, NQKV, dtype=torch.float32, device=dev) if plan["qkv"]["splits"] > 1 else qkv
    o = torch.empty(B, Hq * D, dtype=dtype, device=dev)
    act = torch.empty(B, I, dtype=dtype, device=dev)
    o_parts = torch.empty(plan["o"]["splits"], B, H, dtype=torch.float32, device=dev)
    down_parts = torch.empty(plan["down"]["splits"], B, H, dtype=torch.float32, device=dev)
    attn_bias = bias.float().contiguous()
    W = attn_bias.shape[1]
    cos2, sin2 = (t[:, 0] for t in (cos, sin))
    cos2, sin2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos2, sin2))
    qkv_b, gu_b = attn.qkv_proj.bias, mlp.gate_up_proj.bias
    p_qkv, p_o, p_gu, p_d = plan["qkv"], plan["o"], plan["gate_up"], plan["down"]
    args = (
        h2d, pend, h2d.stride(0), pend.stride(0), pend.stride(1),
        norm1.weight, norm2.weight, _eps(norm1), _eps(norm2),
        h2, x, qkv, qkv_parts, o, o_parts, h3, x2, act, down_parts,
        attn.qkv_proj.weight, attn.qkv_proj.weight if qkv_b is None else qkv_b, attn.o_proj.weight,
        mlp.gate_up_proj.weight, mlp.gate_up_proj.weight if gu_b is None else gu_b, mlp.down_proj.weight,
        cos2, sin2, k_all, v_all, index, attn_bias, W, -(-W // BLOCK_W) * BLOCK_W, parts.scaling,
        cos2.stride(0), sin2.stride(0), k_all.stride(0), k_all.stride(1), k_all.stride(2),
        v_all.stride(0), v_all.stride(1), v_all.stride(2), attn_bias.stride(0),
        B, H, NQKV, I,
        p_qkv["rows"], p_qkv["k_per_split"] or H, p_qkv["groups"], p_qkv["groups"] * p_qkv["splits"],
        p_o["rows"], p_o["k_per_split"], p_o["groups"], p_o["groups"] * p_o["splits"],
        p_gu["rows"], p_gu["groups"], p_gu["groups"],
        p_d["rows"], p_d["k_per_split"], p_d["groups"], p_d["groups"] * p_d["splits"],
        _sync_counters(dev), _times_buffer(dev, layer, programs) if TIMES else _sync_counters(dev),
    )
    G = Hq // Hkv
    constants = dict(
        NPROG=programs, TIMES=TIMES and not phases, LANES=32 * NUM_WARPS, BLOCK_M=max(16, triton.next_power_of_2(B)), BLOCK_H=triton.next_power_of_2(H),
        BN_QKV=p_qkv["block_n"], BN_O=p_o["block_n"], BN_GU=p_gu["block_n"], BN_D=p_d["block_n"], BLOCK_K=BLOCK_K,
        HKV=Hkv, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BLOCK_W=BLOCK_W,
        QKV_BIAS=qkv_b is not None, GU_BIAS=gu_b is not None, PREFETCH=0 if phases else PREFETCH,
        PENDING_SPLITS=pend.shape[0], O_SPLITS=p_o["splits"], QKV_SPLITS=p_qkv["splits"], BLOCK_QG=triton.next_power_of_2(Hq * D // Hkv),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    for only in range(7) if phases else (-1,):
        _layer_kernel[(programs,)](*args, ONLY=only, **constants)
    return h3.view(B, 1, H), down_parts
