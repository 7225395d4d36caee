"""The Triton code of the persistent decode layer (:mod:`~grpo_plugins.generators.persistent_layer`):
one kernel runs a whole decoder layer for one new token per row, a program per multiprocessor,
its seven phases separated by grid-wide barriers instead of kernel boundaries.

0. the residual addition (the layer before's down partial sums) and the first RMSNorm;
1. the q/k/v product as partial sums over K (or whole, with its bias);
2. the decode attention (:func:`~grpo_plugins.generators.decode_attention.rope_window_attend`,
   the attention kernel's body), each (row, key/value head) item first adding up its own q/k/v
   partial sums and bias;
3. the o product as partial sums over K;
4. their residual addition and the second RMSNorm;
5. the gate/up product with SiLU(gate) * up in its epilogue;
6. the down product as partial sums over K, left for the next layer's phase 0.

Every intermediate is rounded to the model's dtype where the torch layer rounds it, so the layer
computes the torch layer's arithmetic up to the order of float32 additions. ``ONLY=k`` runs
phase k alone, without barriers (seven launches per layer): Triton's interpreter runs programs
one after another, where a barrier would wait forever, so the CPU tests run this form.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship without Triton
    triton = None  # type: ignore[assignment]

#: Stamps per program with TIMES: the start, arriving at and leaving each of the six barriers, the end.
STAMPS = 16
#: Polls of the arrival count before a barrier gives up (~1 s): a GPU that cannot hold every
#: program at once (shared through MPS, say) would otherwise wait forever. A program that gives
#: up raises the flag next to the count, which the decoder reads after each generation.
SPIN_LIMIT = 1 << 21

if triton is not None:
    from grpo_plugins.generators.decode_attention import rope_window_attend, rotation

    @triton.jit
    def silu_times(gate, up, dtype: tl.constexpr):
        """SiLU(gate) * up from float32 sums, rounded to ``dtype`` as the torch layer rounds:
        gate, SiLU(gate), up, then (by the caller's store) their product."""
        gate = gate.to(dtype).to(tl.float32)
        return (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)

    @triton.jit
    def add_norm_store(h, total, weight, eps, N, h_out, x_out, inside):
        """A row: h' = h + round(total), rounded, stored at ``h_out``; RMSNorm(h') * ``weight``
        stored at ``x_out`` (float32 ``h``, ``total`` and ``weight``; ``inside`` masks the row)."""
        dtype = h_out.dtype.element_ty
        h = (h + total.to(dtype).to(tl.float32)).to(dtype)
        tl.store(h_out, h, mask=inside)
        hf = h.to(tl.float32)
        variance = tl.sum(hf * hf, 0) / N
        normed = (hf * tl.rsqrt(variance + eps)).to(dtype).to(tl.float32)
        tl.store(x_out, (normed * weight).to(dtype), mask=inside)

    @triton.jit
    def _grid_sync(sync_ptr, NPROG: tl.constexpr, LIMIT: tl.constexpr):
        """Every program arrives, then waits for all NPROG; what each stored before arriving is
        visible to all after. ``sync_ptr``: an int64 count of arrivals, zero at first and never
        reset (consecutive launches go on counting): a round is complete at the next multiple of
        NPROG; ``sync_ptr + 1``: set to 1 by a program that gave up after LIMIT polls."""
        tl.debug_barrier()  # this program's threads have all stored
        arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
        target = (arrived // NPROG + 1) * NPROG
        if arrived != target - 1:  # the last to arrive has seen everyone's arrival already
            polls = 0
            while (tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < target) & (polls < LIMIT):
                polls += 1
            if polls >= LIMIT:
                tl.atomic_max(sync_ptr + 1, 1)
        tl.debug_barrier()

    @triton.jit
    def _stamp(times_ptr, pid, k: tl.constexpr):
        """Program ``pid``'s stamp ``k``: the GPU's global nanosecond timer."""
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(times_ptr + pid * 16 + k, now)  # STAMPS per program

    @triton.jit
    def _barrier(
        sync_ptr, times_ptr, pid, k: tl.constexpr, NPROG: tl.constexpr, ONLY: tl.constexpr, TIMES: tl.constexpr, SPIN: tl.constexpr,
    ):
        """Barrier k (0-5) between the phases (none where one phase runs alone); TIMES: stamps
        2k + 1 on arriving and 2k + 2 on leaving; SPIN: :data:`SPIN_LIMIT`."""
        if ONLY < 0:
            if TIMES:
                _stamp(times_ptr, pid, 2 * k + 1)
            _grid_sync(sync_ptr, NPROG, SPIN)
            if TIMES:
                _stamp(times_ptr, pid, 2 * k + 2)

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
    def layer_kernel(
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
        NPROG: tl.constexpr, ONLY: tl.constexpr, TIMES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
        BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr, BLOCK_K: tl.constexpr,
        HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_W: tl.constexpr,
        QKV_BIAS: tl.constexpr, GU_BIAS: tl.constexpr, PENDING_SPLITS: tl.constexpr, O_SPLITS: tl.constexpr,
        QKV_SPLITS: tl.constexpr, BLOCK_QG: tl.constexpr, SPIN: tl.constexpr,
    ):
        """One decoder layer (the module docstring's phases) for the M rows' new tokens."""
        pid = tl.program_id(0)
        if TIMES:
            _stamp(times_ptr, pid, 0)
        if ONLY < 0 or ONLY == 0:
            _norm_rows(pid, h_ptr, pending_ptr, norm1_ptr, h2_ptr, x_ptr, M, H, eps1, stride_h,
                       stride_pending, stride_pending_row, NPROG, BLOCK_H, PENDING_SPLITS)
        _barrier(sync_ptr, times_ptr, pid, 0, NPROG, ONLY, TIMES, SPIN)
        if ONLY < 0 or ONLY == 1:
            if QKV_SPLITS > 1:  # partial sums over K, added (with the bias) in the attention phase
                _products(pid, wqkv_ptr, x_ptr, qkv_parts_ptr, bqkv_ptr, M, NQKV, H, qkv_rows, qkv_kps, qkv_groups, qkv_items, H, NQKV,
                          NPROG, BLOCK_M, BN_QKV, BLOCK_K, True, False, False)
            else:
                _products(pid, wqkv_ptr, x_ptr, qkv_ptr, bqkv_ptr, M, NQKV, H, qkv_rows, H, qkv_groups, qkv_items, H, NQKV,
                          NPROG, BLOCK_M, BN_QKV, BLOCK_K, False, QKV_BIAS, False)
        _barrier(sync_ptr, times_ptr, pid, 1, NPROG, ONLY, TIMES, SPIN)
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
        _barrier(sync_ptr, times_ptr, pid, 2, NPROG, ONLY, TIMES, SPIN)
        if ONLY < 0 or ONLY == 3:
            _products(pid, wo_ptr, o_ptr, o_parts_ptr, wo_ptr, M, H, HKV * G * D, o_rows, o_kps, o_groups, o_items, HKV * G * D, H,
                      NPROG, BLOCK_M, BN_O, BLOCK_K, True, False, False)
        _barrier(sync_ptr, times_ptr, pid, 3, NPROG, ONLY, TIMES, SPIN)
        if ONLY < 0 or ONLY == 4:
            _norm_rows(pid, h2_ptr, o_parts_ptr, norm2_ptr, h3_ptr, x2_ptr, M, H, eps2, H, M * H, H, NPROG, BLOCK_H, O_SPLITS)
        _barrier(sync_ptr, times_ptr, pid, 4, NPROG, ONLY, TIMES, SPIN)
        if ONLY < 0 or ONLY == 5:
            _products(pid, wgu_ptr, x2_ptr, act_ptr, bgu_ptr, M, I, H, gu_rows, H, gu_groups, gu_items, H, I,
                      NPROG, BLOCK_M, BN_GU, BLOCK_K, False, GU_BIAS, True)
        _barrier(sync_ptr, times_ptr, pid, 5, NPROG, ONLY, TIMES, SPIN)
        if ONLY < 0 or ONLY == 6:
            _products(pid, wd_ptr, act_ptr, down_parts_ptr, wd_ptr, M, H, I, d_rows, d_kps, d_groups, d_items, I, H,
                      NPROG, BLOCK_M, BN_D, BLOCK_K, True, False, False)
        if TIMES:
            _stamp(times_ptr, pid, 13)
