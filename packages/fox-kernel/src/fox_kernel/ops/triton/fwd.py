"""The Triton forward: output and log-sum-exp, FlashAttention-2 with the FoX bias ``c_i - c_j``.

* Scores are kept in log2 units (``sm_scale * log2(e)`` folded into one multiply, ``exp2``).
* The prefix sums ``c`` are float64; each tile measures the bias from an anchor (``c`` at its first
  row), the keys' side through float32 tile-local sums plus one float64 offset per tile
  (``sums.local_sums``), so the bias is exact to the size of the local sum at any length.
* The row term ``c_i`` is constant along a softmax row: it is left out of the tiles and folded into the
  log-sum-exp (one tile op less per block).
* The softmax runs without a running maximum where it can: ``|q_i| max_j |k_j| s`` bounds every score
  and ``c`` never increases, so one number per query tile bounds every exponent of the tile; when each
  row's own largest term lies within ``FIXED_BOUND_GAP`` (log2) of it, the tile skips the row maxima and
  the rescaling of the accumulator (10-15% of the forward on an H200). The other tiles (large norms, or
  gates that decay much across a tile) are marked and run by a second, online launch.
* Key blocks left of the diagonal run unmasked; padded, windowed-out and (with ``adaptive_threshold``)
  negligibly decayed blocks are never visited; the heaviest (last) query blocks are launched first.
* On Hopper, K and V tiles come through TMA tensor descriptors.

Layouts: q (B, Tq, H, D), k/v (B, Tk, Hkv, D), any strides with a unit last stride; c (B, H, Tk) float64;
lse (B, H, Tq) float32. Packed varlen inputs have B = 1 and ``cu_seqlens``; the grid then runs over
sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_kernel.ops.call import AttentionCall
from fox_kernel.ops.constants import (
    BOUND_PER_ROW,
    BOUND_PER_TILE,
    BOUND_PER_TILE_OR_ROW,
    FIXED_BOUND_GAP,
    LN2,
    LOG2E,
)
from fox_kernel.ops.triton import launch
from fox_kernel.ops.triton.common import block_and_head, kv_tiles, sequence_bounds, tile_bias
from fox_kernel.ops.triton.norms import key_sq_norms
from fox_kernel.ops.triton.ranges import (
    first_kept_key_block,
    first_keys,
    key_range,
    last_zero_gate,
    lower_split,
    window_split,
)
from fox_kernel.ops.triton.sums import local_sums
from fox_kernel.options import FixedRows, KernelOptions
from fox_kernel.pruning import tile_threshold


@triton.jit
def _fwd_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k, start_n,
               stride_kt, stride_vt, sm_scale2, offs_n, mask_d, k_desc, v_desc, row, bos, hk, bound,
               CAUSAL: tl.constexpr, HAS_SEQ_START: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
               USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FIXED: tl.constexpr,
               ROWS: tl.constexpr, rowwise, lower_m, LOWER: tl.constexpr):
    """One key block of the softmax (LOWER: keys before each row's ``lower_m`` hidden); FIXED: ``bound``
    bounds every exponent of the tile and is subtracted with the column term, so there is no row maximum and no rescaling; with ``rowwise``
    (ROWS per row: always, per tile or row: a run-time choice per tile) each row subtracts its own bound
    ``m_i``."""
    kn = start_n + offs_n
    mask_n = kn < t_k
    k, v = kv_tiles(k_ptrs, v_ptrs, kn, mask_n, mask_d, stride_kt, stride_vt, k_desc, v_desc, row, bos, start_n, hk,
                     CAUSAL or not EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)
    c_k2 = tile_bias(c_ptr, cl_ptr, anchor, kn, mask_n, start_n)
    if FIXED:
        c_k2 += bound
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale2 - c_k2[None, :]
    if FIXED:
        if ROWS == BOUND_PER_ROW:
            s = s - m_i[:, None]
        elif ROWS == BOUND_PER_TILE_OR_ROW:  # noqa: SIM102 (a compile-time test, then a run-time one)
            if rowwise:
                s = s - m_i[:, None]
    if CAUSAL:
        s = tl.where((kn[None, :] <= pos_m[:, None]) & mask_n[None, :], s, float("-inf"))
    if LOWER:
        s = tl.where(kn[None, :] >= lower_m[:, None], s, float("-inf"))
    if HAS_SEQ_START:
        s = tl.where(kn[None, :] >= s0, s, float("-inf"))
    if FIXED:
        p = tl.math.exp2(s)
        if CAUSAL:
            # diagonal block: the sum of the rounded weights the dot uses, so a row with a few keys is
            # as exact as in the online form (whose largest weight, 1, rounds to itself)
            p = p.to(v.dtype)
            l_i += tl.sum(p.to(tl.float32), 1)
        else:
            l_i += tl.sum(p, 1)
        acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, l_i, m_i
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fixed_bound(q_sq, c_q2, mask_m, kmax2, sm_scale2, GAP: tl.constexpr):
    """(bound, tile_ok, row_bound, rows_ok) for a query tile with squared row norms ``q_sq``:
    ``row_bound_i >= s_ij * sm_scale2 - c2_j`` for every key j visible to row i (log2 units, ``c2``
    measured from the tile's anchor; ``|q_i| max|k| |s| log2(e)`` bounds the score and ``c_j >= c_i``
    for every visible key) and ``bound`` is their maximum. ``tile_ok``: every row's diagonal term, the
    least its largest term can be, lies within GAP of ``bound``; ``rows_ok``: of its own row's bound.
    Then the terms that matter stay far above float32's smallest numbers (terms 2^-GAP below the bound
    are still 2^(126 - GAP) above them)."""
    u = tl.sqrt(q_sq * kmax2) * tl.abs(sm_scale2)
    row_bound = u - c_q2
    bound = tl.max(tl.where(mask_m, row_bound, float("-inf")), 0)
    # the diagonal term of row i is at least 2^(-2 u_i) of the row's own bound
    gap = tl.max(tl.where(mask_m, 2.0 * u + (bound - row_bound), 0.0), 0)
    row_gap = tl.max(tl.where(mask_m, 2.0 * u, 0.0), 0)
    return bound, gap <= GAP, row_bound, row_gap <= GAP


@triton.jit
def _fwd_loops(q, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k, lo, split, mid, hi, bound, row_bound,
               rowwise, stride_kt, stride_vt, sm_scale2, offs_n, mask_d, k_desc, v_desc, row, bos, hk, lower_m,
               HAS_SEQ_START: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FIXED: tl.constexpr,
               ROWS: tl.constexpr, HAS_LOWER: tl.constexpr):
    """[mid, hi) diagonal, [split, mid) whole, [lo, split) at the rows' first visible keys ``lower_m`` (a
    window's edge, gates of 0; split = lo without them)."""
    if FIXED:
        # the bound each row's weights are measured from (it enters the log-sum-exp)
        if ROWS == BOUND_PER_ROW:
            m_i = row_bound
            bound = 0.0  # folded into the column term only for the tile bound
        elif ROWS == BOUND_PER_TILE_OR_ROW:
            m_i = tl.where(rowwise, row_bound, bound)
            bound = tl.where(rowwise, 0.0, bound)
        else:
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + bound
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # the diagonal blocks first, then the fully visible ones from right to left (nearest keys first:
    # 3-7% faster on an H200 than left to right)
    for start_n in range(mid, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k,
                                   start_n, stride_kt, stride_vt, sm_scale2, offs_n, mask_d, k_desc, v_desc,
                                   row, bos, hk, bound, True, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA,
                                   BLOCK_N, BLOCK_D, FIXED, ROWS, rowwise, lower_m, HAS_LOWER)
    for jj in range(0, (mid - split) // BLOCK_N):
        start_n = mid - BLOCK_N - jj * BLOCK_N
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k,
                                   start_n, stride_kt, stride_vt, sm_scale2, offs_n, mask_d, k_desc, v_desc,
                                   row, bos, hk, bound, False, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA,
                                   BLOCK_N, BLOCK_D, FIXED, ROWS, rowwise, lower_m, False)
    if HAS_LOWER:
        for jj in range(0, (split - lo) // BLOCK_N):
            start_n = split - BLOCK_N - jj * BLOCK_N
            acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k,
                                       start_n, stride_kt, stride_vt, sm_scale2, offs_n, mask_d, k_desc, v_desc,
                                       row, bos, hk, bound, False, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA,
                                       BLOCK_N, BLOCK_D, FIXED, ROWS, rowwise, lower_m, True)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, C, CL, Z, SEQ_START, CU, THRESH, O, LSE, K_DESC, V_DESC, KMAX2, MARKS,
    q_strides, k_strides, v_strides, o_strides, c_strides, lse_strides,
    H, Tq, Tk, D, sm_scale2, WINDOW,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr, HAS_THRESH: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SCAN: tl.constexpr,
    HEADS_FIRST: tl.constexpr, FIXED: tl.constexpr, MARKED: tl.constexpr, GAP: tl.constexpr, ROWS: tl.constexpr,
    AUTO: tl.constexpr, LOG_EPS: tl.constexpr, HAS_WINDOW: tl.constexpr, ZEROS: tl.constexpr,
    HAS_LOWER: tl.constexpr,
):
    """Output and log-sum-exp of one query tile. Neither FIXED nor MARKED: every tile with the online
    softmax. FIXED: the tiles whose fixed softmax bound is tight enough, the others marked in MARKS;
    MARKED: the marked tiles, online (one kernel holding both loops needed twice the shared memory).

    AUTO (with HAS_THRESH): the pruning bound of each query tile comes from its own rows' norms
    (``pruning.tile_threshold``), and THRESH receives the least over the tiles of each (row, head): the
    per-head "auto" bound, which the backward uses.

    ZEROS (``ops/dispatch.py``): only the query tiles with a gate of exactly 0 at or before a row (``Z``), online
    and without pruning, each row hiding the keys before its last such gate."""
    stride_qb, stride_qt, stride_qh = q_strides
    stride_kb, stride_kt, stride_kh = k_strides
    stride_vb, stride_vt, stride_vh = v_strides
    stride_ob, stride_ot, stride_oh = o_strides
    stride_cb, stride_ch = c_strides
    stride_lb, stride_lh = lse_strides
    pid_m, pid_bh, n_blk = block_and_head(HEADS_FIRST, True)
    b = pid_bh // H
    h = pid_bh % H
    row, bos, t_q, t_k, s0 = sequence_bounds(CU, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    if pid_m * BLOCK_M >= t_q:
        return
    tile = pid_bh.to(tl.int64) * n_blk + pid_m
    if MARKED:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if tl.load(MARKS + tile) == 0:
            return
    shift = t_k - t_q
    z_base = row * stride_cb + h * stride_ch + bos
    if ZEROS:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if last_zero_gate(Z, z_base, bos, tl.minimum(pid_m * BLOCK_M + BLOCK_M, t_q) - 1 + shift) <= 0:
            return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < t_q
    mask_d = offs_d < D
    pos_m = offs_m + shift

    q_ptrs = Q + row * stride_qb + h * stride_qh + (bos + offs_m)[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    hk = h // GROUP
    k_ptrs = K + row * stride_kb + hk * stride_kh + bos * stride_kt + offs_d[None, :]
    v_ptrs = V + row * stride_vb + hk * stride_vh + bos * stride_vt + offs_d[None, :]
    c_ptr = C + row * stride_cb + h * stride_ch + bos
    first = pid_m * BLOCK_M + shift
    anchor = tl.load(c_ptr + first)
    c_q = tl.load(c_ptr + pos_m, mask=mask_m, other=0.0)
    c_q2 = (c_q - anchor).to(tl.float32) * LOG2E

    lo, mid, hi = key_range(first, s0, t_k, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    lower_m = first_keys(Z, z_base, bos, pos_m, mask_m, WINDOW, HAS_WINDOW, ZEROS)
    if ZEROS:
        lo, split = lower_split(lower_m, mask_m, lo, mid, t_k, BLOCK_N)
    q_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    kmax2 = 0.0
    if FIXED or AUTO:
        qf = q.to(tl.float32)
        q_sq = tl.sum(qf * qf, 1)
        kmax2 = tl.load(KMAX2 + b * (H // GROUP) + hk)  # per batch row or packed sequence
    if HAS_THRESH:  # one vector load decides when nothing prunes: searched in place
        if AUTO:
            u = tl.sqrt(tl.max(tl.where(mask_m, q_sq, 0.0), 0) * kmax2) * tl.abs(sm_scale2) * LN2
            delta = tile_threshold(u, t_k, LOG_EPS)
            if not MARKED:  # every tile passes once through a launch that is not MARKED
                tl.atomic_min(THRESH + b * H + h, delta, sem="relaxed")
        else:
            delta = tl.load(THRESH + b * H + h)
        lo = first_kept_key_block(c_ptr, anchor, delta, lo, mid, BLOCK_N, SCAN)
    if not ZEROS:
        split = lo
        if HAS_WINDOW:
            split = window_split(lo, mid, first, WINDOW, BLOCK_M, BLOCK_N)

    if CL is None:
        cl_ptr = None
    else:
        cl_ptr = CL + row * stride_cb + h * stride_ch + bos
    bound = 0.0
    row_bound = tl.zeros([BLOCK_M], dtype=tl.float32)
    rowwise = False
    if FIXED:
        bound, tile_ok, row_bound, rows_ok = _fixed_bound(q_sq, c_q2, mask_m, kmax2, sm_scale2, GAP)
        if ROWS == BOUND_PER_TILE:
            usable = tile_ok
        elif ROWS == BOUND_PER_ROW:
            usable = rows_ok
        else:
            usable = tile_ok | rows_ok
            rowwise = tile_ok == 0
        tl.store(MARKS + tile, tl.where(usable, 0, 1).to(tl.int8))
        if not usable:
            return
    acc, l_i, m_i = _fwd_loops(q, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k, lo, split, mid, hi, bound,
                               row_bound, rowwise, stride_kt, stride_vt, sm_scale2, offs_n, mask_d, K_DESC, V_DESC,
                               row.to(tl.int32), bos, hk, lower_m, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA,
                               BLOCK_M, BLOCK_N, BLOCK_D, FIXED, ROWS, HAS_LOWER)

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = O + row * stride_ob + h * stride_oh + (bos + offs_m)[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    # The row term c_i of the bias is constant along the softmax axis: it was left out of the tiles and
    # only enters the log-sum-exp.
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0)) + c_q2) * LN2, float("inf"))
    tl.store(LSE + row * stride_lb + h * stride_lh + bos + offs_m, lse, mask=mask_m)


def fixed_rows(head_dim: int, options: KernelOptions) -> FixedRows:
    """How the forward takes its fixed softmax bound (``options.fixed_rows``, else by head dim). A
    tile-wide bound fails when the gates decay by more than the gap across the tile; a row's own bound
    only when its norms are large. Measured on an H200 (T=16k, bf16, vs cuDNN, mean log f -0.03 / -0.24 /
    -0.58): D=128 tile 0.853 / 0.709 / 0.776, per row 0.798 / 0.799 / 0.802, both 0.865 / 0.867 / 0.873;
    D=64 tile 0.856 / 0.902 / 0.900, both 0.811 / 0.872 / 0.975 (the branch costs D=64's 4-warp tiles 5%
    when not taken)."""
    if options.fixed_rows is not None:
        return options.fixed_rows
    return FixedRows.TILE_OR_ROW if head_dim > 64 else FixedRows.TILE


def forward(q, k, v, c, call: AttentionCall, fixed: bool):
    """(out, lse, threshold) from the prefix sums ``c`` (``sums.prefix_sums``). ``fixed``: take the fixed
    softmax bound where it is tight enough. With ``call.auto_log_eps`` the pruning bound is taken per query
    tile from the tile's own query norms and the returned (rows, H) threshold is the per-head "auto" bound
    for the backward; otherwise ``call.threshold`` is returned as given."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    seq_start, cu_seqlens, threshold, window, options = (call.seq_start, call.cu_seqlens, call.threshold, call.window,
                                                         call.options)
    auto = call.auto_log_eps is not None
    kmax2 = key_sq_norms(k, cu_seqlens) if fixed or auto else None
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    n_rows, t_max = launch.grid_rows(cu_seqlens, B, Tq)
    if auto:
        threshold = torch.full((n_rows, H), float("inf"), dtype=torch.float32, device=q.device)
    cfg = launch.config("fwd", D, q.dtype, q.device)
    grid, heads_first = launch.grid("fwd", n_rows * H, launch.cdiv(t_max, cfg["BLOCK_M"]), options.order_fwd, D,
                                    H // Hkv)
    tma = cu_seqlens is None and launch.use_tma(options, k, v)
    k_desc, v_desc = launch.descriptors((k, v), cfg["BLOCK_N"], cfg, tma)
    # per query tile: 1 where the fixed bound was too loose and the online launch must run it
    marks = torch.empty(grid[0] * grid[1], dtype=torch.int8, device=q.device) if fixed else None
    args = (q, k, v, c, local_sums(c, cu_seqlens, n_rows, t_max, cfg["BLOCK_N"]), None, seq_start, cu_seqlens,
            threshold, out, lse, k_desc, v_desc, kmax2, marks,
            launch.strides(q), launch.strides(k), launch.strides(v), launch.strides(out), launch.strides(c, 2),
            launch.strides(lse, 2), H, Tq, Tk, D, call.sm_scale * LOG2E.value, window)
    flags = dict(HAS_WINDOW=call.has_window, ZEROS=False, HAS_LOWER=call.has_window, GROUP=H // Hkv,
                 IS_VARLEN=call.varlen, HAS_SEQ_START=seq_start is not None, HAS_THRESH=threshold is not None,
                 EVEN_D=cfg["BLOCK_D"] == D, PRECISION=launch.precision(q.dtype), USE_TMA=tma, SCAN=launch.scan(),
                 HEADS_FIRST=heads_first, GAP=FIXED_BOUND_GAP, ROWS=int(fixed_rows(D, options)), AUTO=auto,
                 LOG_EPS=float(call.auto_log_eps or 0.0), **cfg)
    kernel = launch.any_length(_fwd_kernel, Tq, Tk)
    if fixed:
        launch.run(kernel, grid, *args, FIXED=True, MARKED=False, **flags)
        launch.run(kernel, grid, *args, FIXED=False, MARKED=True, **flags)
    else:
        launch.run(kernel, grid, *args, FIXED=False, MARKED=False, **flags)
    return out, lse, threshold


def forward_zero_gates(q, k, v, c, z, call: AttentionCall, out, lse):
    """Rewrites ``out`` and ``lse`` of the query tiles with a gate of exactly 0 at or before a row (``z`` from
    ``sums.prefix_sums(..., zeros=True)``), after a forward of any backend on the same ``c``: online softmax,
    no pruning (the call's threshold is not read), each row hiding the keys before its last such gate. The
    other tiles' programs only read ``z`` and return."""
    B, Tq, H, D = q.shape
    seq_start, cu_seqlens, window = call.seq_start, call.cu_seqlens, call.window
    Tk, Hkv = k.shape[1], k.shape[2]
    n_rows, t_max = launch.grid_rows(cu_seqlens, B, Tq)
    cfg = launch.rerun_config("fwd", D, q.dtype, q.device)
    grid, heads_first = launch.grid("fwd", n_rows * H, launch.cdiv(t_max, cfg["BLOCK_M"]), None, D, H // Hkv)
    launch.run(launch.any_length(_fwd_kernel, Tq, Tk), grid,
        q, k, v, c, None, z, seq_start, cu_seqlens, None,
        out, lse, None, None, None, None,
        launch.strides(q), launch.strides(k), launch.strides(v), launch.strides(out), launch.strides(c, 2),
        launch.strides(lse, 2), H, Tq, Tk, D, call.sm_scale * LOG2E.value, window,
        GROUP=H // Hkv, IS_VARLEN=call.varlen, HAS_SEQ_START=seq_start is not None, HAS_THRESH=False,
        EVEN_D=cfg["BLOCK_D"] == D, PRECISION=launch.precision(q.dtype), USE_TMA=False, SCAN=launch.scan(),
        HEADS_FIRST=heads_first, FIXED=False, MARKED=False, GAP=FIXED_BOUND_GAP, ROWS=int(FixedRows.TILE), AUTO=False,
        LOG_EPS=0.0, HAS_WINDOW=call.has_window, ZEROS=True, HAS_LOWER=True, **cfg,
    )
