"""The Triton backward: dK/dV (with the column term of the gate gradient), then dQ (with the row term).

The gate gradient ``dc_j = sum_l ds_jl - sum_i ds_ij`` is a column sum taken in the dK/dV pass plus a row
sum taken in the dQ pass, each position owned by one program: no atomics, and gradients are
bit-reproducible. The one-pass form (``KernelOptions.backward="fused"``) instead adds dQ and the row sums
in from the dK/dV programs with atomics. The row term ``c_i`` of the bias is folded into the row vector
``lse - c_i`` (one tile op less per block), as in the forward. With ``adaptive_threshold`` the kept ranges
are found by a small kernel up front (``ranges.kept_ranges``). GQA: one dK/dV program per key/value head
loops over the query heads of its group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_kernel.ops.call import AttentionCall
from fox_kernel.ops.constants import LOG2E
from fox_kernel.ops.triton import launch
from fox_kernel.ops.triton.common import block_and_head, kv_tiles, sequence_bounds, tile_bias
from fox_kernel.ops.triton.ranges import (
    first_keys,
    kept_ranges,
    key_range,
    last_zero_gate,
    lower_split,
    query_range,
    query_window_split,
    window_split,
)
from fox_kernel.ops.triton.sums import local_sums


@triton.jit
def _dkdv_block(dk, dv, dc, k, v, c_k2, q_ptrs, do_ptrs, lse_ptr, delta_ptr, c_ptr, clq_ptr, anchor, offs_n,
                s0, t_q, shift, start_m, stride_qt, stride_dot, sm_scale2, mask_d, q_desc, do_desc, row, bos, h,
                dq_ptr, dcrow_ptr, dq_desc, stride_qad, offs_d, window, Z, z_base,
                BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEQ_START: tl.constexpr,
                PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_D: tl.constexpr, FUSED_DQ: tl.constexpr,
                LOWER: tl.constexpr, HAS_WINDOW: tl.constexpr, ZEROS: tl.constexpr):
    """Query block ``start_m`` against this key block; LOWER: each query hides the keys before its first
    visible one (``ranges.first_keys``: a window's edge, gates of exactly 0)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    mask_m = offs_m < t_q
    if USE_TMA:
        q = q_desc.load([row, (bos + start_m).to(tl.int32), h, 0]).reshape(BLOCK_M, BLOCK_D)
        do = do_desc.load([row, (bos + start_m).to(tl.int32), h, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        rows = offs_m[:, None].to(tl.int64)
        q = tl.load(q_ptrs + rows * stride_qt, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        do = tl.load(do_ptrs + rows * stride_dot, mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    delta = tl.load(delta_ptr + offs_m, mask=mask_m, other=0.0)
    pos_m = offs_m + shift
    # log2 of the softmax denominator less the row term c_i of the bias (one vector, not a tile, op)
    c_q2 = tile_bias(c_ptr, clq_ptr, anchor, pos_m, mask_m, shift + start_m)
    lse2 = tl.load(lse_ptr + offs_m, mask=mask_m, other=float("inf")) * LOG2E - c_q2
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * sm_scale2 - c_k2[:, None]
    if CAUSAL:
        s_t = tl.where(offs_n[:, None] <= pos_m[None, :], s_t, float("-inf"))
    if LOWER:
        lower = first_keys(Z, z_base, bos, pos_m, mask_m, window, HAS_WINDOW, ZEROS)
        s_t = tl.where(offs_n[:, None] >= lower[None, :], s_t, float("-inf"))
    if HAS_SEQ_START:
        s_t = tl.where(offs_n[:, None] >= s0, s_t, float("-inf"))
    p_t = tl.math.exp2(s_t - lse2[None, :])
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    ds_c = ds_t.to(q.dtype)
    dk += tl.dot(ds_c, q, input_precision=PRECISION)
    dc -= tl.sum(ds_t, 1)
    if FUSED_DQ:
        # this key tile's share of dQ, as (D, BLOCK_M) = K^T dS^T: only loaded tiles are transposed (a
        # transposed dot result feeding another dot is miscompiled by some Triton versions on Hopper);
        # added into a float32 (B, H, D, Tq) buffer with relaxed atomics (TMA reductions on Hopper)
        dq_t = tl.dot(tl.trans(k), ds_c, input_precision=PRECISION)
        if USE_TMA:
            dq_desc.atomic_add([row, h, 0, (bos + start_m).to(tl.int32)], dq_t.reshape(1, 1, BLOCK_D, BLOCK_M))
        else:
            tl.atomic_add(dq_ptr + offs_d[:, None].to(tl.int64) * stride_qad + offs_m[None, :], dq_t,
                          mask=mask_d[:, None] & mask_m[None, :], sem="relaxed")
        tl.atomic_add(dcrow_ptr + offs_m, tl.sum(ds_t, 0), mask=mask_m, sem="relaxed")
    return dk, dv, dc


@triton.jit
def _dkdv_kernel(
    Q, K, V, C, CLQ, Z, SEQ_START, CU, RANGE, DO, LSE, DELTA, DK, DV, DC, Q_DESC, DO_DESC, DQ_ACC, DC_ROW, DQ_DESC,
    q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, c_strides, lse_strides, dq_acc_strides,
    H, HKV, Tq, Tk, D, sm_scale, sm_scale2, WINDOW,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr, HAS_THRESH: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SCAN: tl.constexpr,
    HEADS_FIRST: tl.constexpr, FUSED_DQ: tl.constexpr, HAS_WINDOW: tl.constexpr, ZEROS: tl.constexpr,
    HAS_LOWER: tl.constexpr,
):
    """dK, dV and the column term of dc per key block; with FUSED_DQ also dQ and the row term of dc,
    added in with atomics into DQ_ACC (float32 (B, H, D, Tq), through DQ_DESC on Hopper) and DC_ROW (one
    pass instead of two, not bit-reproducible; without FUSED_DQ the kernel does not read the three).
    ZEROS (``ops/dispatch.py``): only the key blocks some query of the group hides part of, behind a gate of
    exactly 0 (``Z``), every query block masked, without pruning."""
    stride_qb, stride_qt, stride_qh = q_strides
    stride_kb, stride_kt, stride_kh = k_strides
    stride_vb, stride_vt, stride_vh = v_strides
    stride_dob, stride_dot, stride_doh = do_strides
    stride_dkb, stride_dkt, stride_dkh = dk_strides
    stride_dvb, stride_dvt, stride_dvh = dv_strides
    stride_cb, stride_ch = c_strides
    stride_lb, stride_lh = lse_strides
    pid_n, pid_bh, n_blk = block_and_head(HEADS_FIRST, False)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    row, bos, t_q, t_k, s0 = sequence_bounds(CU, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    if pid_n * BLOCK_N >= t_k:
        return
    if ZEROS:  # a query hides keys of this block when the last query's last gate of 0 lies past its first key
        hidden = 0
        for g in range(GROUP):
            hidden = tl.maximum(hidden, last_zero_gate(Z, row * stride_cb + (hk * GROUP + g) * stride_ch + bos, bos,
                                                       t_k - 1))
        if hidden <= pid_n * BLOCK_N:
            return
    shift = t_k - t_q
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < t_k
    mask_d = offs_d < D
    mask_nd = mask_n[:, None] & mask_d[None, :]
    rows_n = (bos + offs_n)[:, None]
    k = tl.load(K + row * stride_kb + hk * stride_kh + rows_n * stride_kt + offs_d[None, :], mask=mask_nd, other=0.0)
    v = tl.load(V + row * stride_vb + hk * stride_vh + rows_n * stride_vt + offs_d[None, :], mask=mask_nd, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    m_lo, m_mid, m_end = query_range(pid_n, shift, s0, t_q, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    for g in range(GROUP):
        h = hk * GROUP + g
        c_ptr = C + row * stride_cb + h * stride_ch + bos
        if CLQ is None:
            clq_ptr = None
        else:
            clq_ptr = CLQ + row * stride_cb + h * stride_ch + bos
        z_base = row * stride_cb + h * stride_ch + bos
        anchor = tl.load(c_ptr + pid_n * BLOCK_N)
        c_k = tl.load(c_ptr + offs_n, mask=mask_n, other=0.0)
        c_k2 = (c_k - anchor).to(tl.float32) * LOG2E
        q_ptrs = Q + row * stride_qb + h * stride_qh + bos * stride_qt + offs_d[None, :]
        do_ptrs = DO + row * stride_dob + h * stride_doh + bos * stride_dot + offs_d[None, :]
        lse_ptr = LSE + row * stride_lb + h * stride_lh + bos
        delta_ptr = DELTA + row * stride_lb + h * stride_lh + bos
        if FUSED_DQ:
            stride_qab, stride_qah, stride_qad = dq_acc_strides
            dq_ptr = DQ_ACC + row * stride_qab + h * stride_qah + bos
            dcrow_ptr = DC_ROW + row * stride_lb + h * stride_lh + bos
        else:
            stride_qad = None
            dq_ptr = None
            dcrow_ptr = None
        m_hi = m_end
        if HAS_THRESH:
            m_hi = tl.load(RANGE + (b * H + h).to(tl.int64) * n_blk + pid_n)
        m_diag = m_mid
        m_split = m_hi
        if HAS_WINDOW:  # a narrow window can end inside the diagonal blocks
            m_diag = tl.minimum(m_mid, m_hi)
            m_split = query_window_split(pid_n, shift, WINDOW, m_diag, m_hi, BLOCK_M, BLOCK_N)
        if ZEROS:  # any later query may sit behind a gate of 0
            m_split = m_diag
        dc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start_m in range(m_lo, m_diag, BLOCK_M):
            dk, dv, dc = _dkdv_block(dk, dv, dc, k, v, c_k2, q_ptrs, do_ptrs, lse_ptr, delta_ptr, c_ptr, clq_ptr, anchor,
                                     offs_n, s0, t_q, shift, start_m, stride_qt, stride_dot, sm_scale2, mask_d,
                                     Q_DESC, DO_DESC, row.to(tl.int32), bos, h, dq_ptr, dcrow_ptr, DQ_DESC,
                                     stride_qad, offs_d, WINDOW, Z, z_base, BLOCK_M, True, HAS_SEQ_START, PRECISION,
                                     USE_TMA, BLOCK_D, FUSED_DQ, HAS_LOWER, HAS_WINDOW, ZEROS)
        for start_m in range(m_diag, m_split, BLOCK_M):
            dk, dv, dc = _dkdv_block(dk, dv, dc, k, v, c_k2, q_ptrs, do_ptrs, lse_ptr, delta_ptr, c_ptr, clq_ptr, anchor,
                                     offs_n, s0, t_q, shift, start_m, stride_qt, stride_dot, sm_scale2, mask_d,
                                     Q_DESC, DO_DESC, row.to(tl.int32), bos, h, dq_ptr, dcrow_ptr, DQ_DESC,
                                     stride_qad, offs_d, WINDOW, Z, z_base, BLOCK_M, False, HAS_SEQ_START, PRECISION,
                                     USE_TMA, BLOCK_D, FUSED_DQ, False, HAS_WINDOW, ZEROS)
        if HAS_LOWER:
            for start_m in range(m_split, m_hi, BLOCK_M):
                dk, dv, dc = _dkdv_block(dk, dv, dc, k, v, c_k2, q_ptrs, do_ptrs, lse_ptr, delta_ptr, c_ptr, clq_ptr,
                                         anchor, offs_n, s0, t_q, shift, start_m, stride_qt, stride_dot, sm_scale2,
                                         mask_d, Q_DESC, DO_DESC, row.to(tl.int32), bos, h, dq_ptr, dcrow_ptr, DQ_DESC,
                                         stride_qad, offs_d, WINDOW, Z, z_base, BLOCK_M, False, HAS_SEQ_START,
                                         PRECISION, USE_TMA, BLOCK_D, FUSED_DQ, True, HAS_WINDOW, ZEROS)
        tl.store(DC + row * stride_cb + h * stride_ch + bos + offs_n, dc, mask=mask_n)
    dk_ptrs = DK + row * stride_dkb + hk * stride_dkh + rows_n * stride_dkt + offs_d[None, :]
    dv_ptrs = DV + row * stride_dvb + hk * stride_dvh + rows_n * stride_dvt + offs_d[None, :]
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask_nd)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask_nd)


@triton.jit
def _dq_block(dq, dc_row, q, do, lse2, delta, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k, start_n,
              stride_kt, stride_vt, sm_scale2, offs_n, mask_d, k_desc, v_desc, row, bos, hk, lower_m,
              CAUSAL: tl.constexpr, HAS_SEQ_START: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
              USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, LOWER: tl.constexpr):
    kn = start_n + offs_n
    mask_n = kn < t_k
    k, v = kv_tiles(k_ptrs, v_ptrs, kn, mask_n, mask_d, stride_kt, stride_vt, k_desc, v_desc, row, bos, start_n, hk,
                     CAUSAL or not EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)
    c_k2 = tile_bias(c_ptr, cl_ptr, anchor, kn, mask_n, start_n)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale2 - c_k2[None, :]
    if CAUSAL:
        s = tl.where((kn[None, :] <= pos_m[:, None]) & mask_n[None, :], s, float("-inf"))
    if LOWER:
        s = tl.where(kn[None, :] >= lower_m[:, None], s, float("-inf"))
    if HAS_SEQ_START:
        s = tl.where(kn[None, :] >= s0, s, float("-inf"))
    p = tl.math.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq, dc_row + tl.sum(ds, 1)


@triton.jit
def _dq_kernel(
    Q, K, V, C, CL, Z, SEQ_START, CU, RANGE, DO, LSE, DELTA, DQ, DC_ROW, K_DESC, V_DESC,
    q_strides, k_strides, v_strides, do_strides, dq_strides, c_strides, lse_strides,
    H, Tq, Tk, D, sm_scale, sm_scale2, WINDOW,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr, HAS_THRESH: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SCAN: tl.constexpr,
    HEADS_FIRST: tl.constexpr, HAS_WINDOW: tl.constexpr, ZEROS: tl.constexpr, HAS_LOWER: tl.constexpr,
):
    """dQ and the row term of dc per query block; ZEROS as in the forward (``ops/dispatch.py``)."""
    stride_qb, stride_qt, stride_qh = q_strides
    stride_kb, stride_kt, stride_kh = k_strides
    stride_vb, stride_vt, stride_vh = v_strides
    stride_dob, stride_dot, stride_doh = do_strides
    stride_dqb, stride_dqt, stride_dqh = dq_strides
    stride_cb, stride_ch = c_strides
    stride_lb, stride_lh = lse_strides
    pid_m, pid_bh, n_blk = block_and_head(HEADS_FIRST, True)
    b = pid_bh // H
    h = pid_bh % H
    row, bos, t_q, t_k, s0 = sequence_bounds(CU, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    if pid_m * BLOCK_M >= t_q:
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
    mask_md = mask_m[:, None] & mask_d[None, :]
    pos_m = offs_m + shift
    rows_m = (bos + offs_m)[:, None]
    q = tl.load(Q + row * stride_qb + h * stride_qh + rows_m * stride_qt + offs_d[None, :], mask=mask_md, other=0.0)
    do = tl.load(DO + row * stride_dob + h * stride_doh + rows_m * stride_dot + offs_d[None, :], mask=mask_md, other=0.0)
    lse2 = tl.load(LSE + row * stride_lb + h * stride_lh + bos + offs_m, mask=mask_m, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + row * stride_lb + h * stride_lh + bos + offs_m, mask=mask_m, other=0.0)
    hk = h // GROUP
    k_ptrs = K + row * stride_kb + hk * stride_kh + bos * stride_kt + offs_d[None, :]
    v_ptrs = V + row * stride_vb + hk * stride_vh + bos * stride_vt + offs_d[None, :]
    c_ptr = C + row * stride_cb + h * stride_ch + bos
    if CL is None:
        cl_ptr = None
    else:
        cl_ptr = CL + row * stride_cb + h * stride_ch + bos
    first = pid_m * BLOCK_M + shift
    anchor = tl.load(c_ptr + first)
    c_q = tl.load(c_ptr + pos_m, mask=mask_m, other=0.0)
    # the row term of the bias folded into the log-sum-exp (a vector op instead of a tile op per block)
    lse2 -= (c_q - anchor).to(tl.float32) * LOG2E

    lo, mid, hi = key_range(first, s0, t_k, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    if HAS_THRESH:
        # written as a multiple of BLOCK_N so the compiler keeps the key loads aligned (vectorised)
        lo = (tl.load(RANGE + pid_bh.to(tl.int64) * n_blk + pid_m) // BLOCK_N) * BLOCK_N
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dc_row = tl.zeros([BLOCK_M], dtype=tl.float32)
    lower_m = first_keys(Z, z_base, bos, pos_m, mask_m, WINDOW, HAS_WINDOW, ZEROS)
    split = lo
    if ZEROS:
        lo, split = lower_split(lower_m, mask_m, lo, mid, t_k, BLOCK_N)
    elif HAS_WINDOW:
        split = window_split(lo, mid, first, WINDOW, BLOCK_M, BLOCK_N)
    if HAS_LOWER:
        for jj in range(0, (split - lo) // BLOCK_N):
            start_n = lo + jj * BLOCK_N
            dq, dc_row = _dq_block(dq, dc_row, q, do, lse2, delta, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0,
                                   t_k, start_n, stride_kt, stride_vt, sm_scale2, offs_n, mask_d, K_DESC, V_DESC,
                                   row.to(tl.int32), bos, hk, lower_m, False, HAS_SEQ_START, EVEN_D, PRECISION,
                                   USE_TMA, BLOCK_N, BLOCK_D, True)
    # counted from 0 rather than ranging from lo: with lo loaded (pruning) the range form made this
    # pass 30-40% slower on an H200 (same results); the counted loop runs as fast as lo = 0
    for jj in range(0, (mid - split) // BLOCK_N):
        start_n = split + jj * BLOCK_N
        dq, dc_row = _dq_block(dq, dc_row, q, do, lse2, delta, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k, start_n,
                               stride_kt, stride_vt, sm_scale2, offs_n, mask_d, K_DESC, V_DESC, row.to(tl.int32), bos, hk,
                               lower_m, False, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA, BLOCK_N, BLOCK_D, False)
    for start_n in range(mid, hi, BLOCK_N):
        dq, dc_row = _dq_block(dq, dc_row, q, do, lse2, delta, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k, start_n,
                               stride_kt, stride_vt, sm_scale2, offs_n, mask_d, K_DESC, V_DESC, row.to(tl.int32), bos, hk,
                               lower_m, True, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA, BLOCK_N, BLOCK_D, HAS_LOWER)
    dq_ptrs = DQ + row * stride_dqb + h * stride_dqh + rows_m * stride_dqt + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=mask_md)
    tl.store(DC_ROW + row * stride_lb + h * stride_lh + bos + offs_m, dc_row, mask=mask_m)


def backward(do, q, k, v, c, lse, delta, call: AttentionCall, one_pass: bool):
    """(dq, dk, dv, dc, dc_row): the gradients of q, k, v and the column (B, H, Tk) and row (B, H, Tq)
    terms of the gradient of ``c`` (``sums.gate_grad`` adds them up). ``call``: the backward's (its
    threshold the forward's). ``one_pass``: the dK/dV programs also add dQ and the row term in, with
    atomics."""
    B, Tq, H, _ = q.shape
    Tk = k.shape[1]
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dc = torch.zeros(B, H, Tk, dtype=torch.float32, device=q.device)  # the passes may skip keys
    # the row term of dc: summed into with atomics by the one pass, written once per row by the dQ pass
    dc_row = (torch.zeros if one_pass else torch.empty)(B, H, Tq, dtype=torch.float32, device=q.device)
    n_rows, t_max = launch.grid_rows(call.cu_seqlens, B, Tk)
    tma = not call.varlen and launch.use_tma(call.options, q, k, v, do)
    flags = _flags(q, k, call, tma, zeros=False)
    _dkdv_pass(q, k, v, c, call, do, lse, delta, dk, dv, dc, dq, dc_row, one_pass, flags, n_rows, t_max)
    if not one_pass:
        _dq_pass(q, k, v, c, call, do, lse, delta, dq, dc_row, flags, n_rows, t_max)
    return dq, dk, dv, dc, dc_row


def backward_zero_gates(do, q, k, v, c, z, lse, delta, call: AttentionCall, grads):
    """Rewrites ``grads`` = (dq, dk, dv, dc, dc_row), from a backward of any backend on the same ``c``, where
    a gate of exactly 0 hides keys (``z`` from ``sums.prefix_sums(..., zeros=True)``): dK, dV and dc of
    the key blocks some query hides part of, then dQ and the row term of dc of the query tiles with such
    a gate at or before a row. Two passes, no pruning (the call's threshold is not read); the other
    programs only read ``z`` and return."""
    dq, dk, dv, dc, dc_row = grads
    n_rows, t_max = launch.grid_rows(call.cu_seqlens, q.shape[0], k.shape[1])
    flags = _flags(q, k, call, False, zeros=True)
    _dkdv_pass(q, k, v, c, call, do, lse, delta, dk, dv, dc, dq, dc_row, False, flags, n_rows, t_max, z)
    _dq_pass(q, k, v, c, call, do, lse, delta, dq, dc_row, flags, n_rows, t_max, z)


def _flags(q, k, call: AttentionCall, tma: bool, zeros: bool):
    """The compile-time switches both passes take; ``zeros``: the zero-gate passes (no pruning: HAS_THRESH
    off whatever the call's threshold)."""
    return dict(
        GROUP=q.shape[2] // k.shape[2], IS_VARLEN=call.varlen, HAS_SEQ_START=call.seq_start is not None,
        HAS_THRESH=not zeros and call.threshold is not None, EVEN_D=launch.block_d(q.shape[3]) == q.shape[3],
        PRECISION=launch.precision(q.dtype), HAS_WINDOW=call.has_window, USE_TMA=tma, SCAN=launch.scan(),
        ZEROS=zeros, HAS_LOWER=zeros or call.has_window,
    )


def _tiles(kind, q, flags):
    """A pass's tiles: the zero-gate passes take their lean ones (``launch.rerun_config``)."""
    return (launch.rerun_config if flags["ZEROS"] else launch.config)(kind, q.shape[3], q.dtype, q.device)


def _dkdv_pass(q, k, v, c, call, do, lse, delta, dk, dv, dc, dq, dc_row, one_pass, flags, n_rows, t_max, z=None):
    """dK, dV and the column term of dc; with ``one_pass`` also dQ (written into ``dq``) and the row term.
    Pruned by the call's threshold where ``flags`` has HAS_THRESH."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    seq_start, cu_seqlens, sm_scale, window = call.seq_start, call.cu_seqlens, call.sm_scale, call.window
    threshold = call.threshold if flags["HAS_THRESH"] else None
    cfg = _tiles("fused" if one_pass else "dkdv", q, flags)
    q_desc, do_desc = launch.descriptors((q, do), cfg["BLOCK_M"], cfg, flags["USE_TMA"])
    if one_pass:  # float32 dQ as (B, H, D, Tq), rows padded to 16 bytes for the TMA reductions
        dq_acc = dq_desc = torch.zeros(B, H, D, launch.cdiv(Tq, 4) * 4, dtype=torch.float32, device=q.device)
        if flags["USE_TMA"]:
            from triton.tools.tensor_descriptor import TensorDescriptor

            dq_desc = TensorDescriptor(dq_acc, [B, H, D, Tq], list(dq_acc.stride()),
                                       [1, 1, cfg["BLOCK_D"], cfg["BLOCK_M"]])
    else:
        # The two-pass kernel compiles its FUSED_DQ code out and never reads DQ_ACC or DQ_DESC, yet they are
        # passed (any float32 tensor, here dc_row): as None they leave the kernel's parameters, and that
        # changed its register allocation at some shapes (sm90, Triton 3.6).
        dq_acc = dq_desc = dc_row
    # query tiles of the dK/dV pass start at Tk - Tq + multiples of BLOCK_M
    ranges = kept_ranges(c, seq_start, cu_seqlens, threshold, n_rows, H, Tq, Tk, t_max, cfg, False, window)
    # the zero-gate passes read c in float64 instead (one launch less)
    clq = None if flags["ZEROS"] else local_sums(c, cu_seqlens, n_rows, t_max, cfg["BLOCK_M"], (Tk - Tq) % cfg["BLOCK_M"])
    grid, heads_first = launch.grid("dkdv", n_rows * Hkv, launch.cdiv(t_max, cfg["BLOCK_N"]), call.options.order_dkdv,
                                    D, H // Hkv)
    launch.run(launch.any_length(_dkdv_kernel, Tq, Tk), grid,
        q, k, v, c, clq, z, seq_start, cu_seqlens, ranges, do, lse, delta, dk, dv, dc, q_desc, do_desc,
        dq_acc, dc_row, dq_desc,
        launch.strides(q), launch.strides(k), launch.strides(v), launch.strides(do), launch.strides(dk),
        launch.strides(dv), launch.strides(c, 2), launch.strides(lse, 2), launch.strides(dq_acc),
        H, Hkv, Tq, Tk, D, sm_scale, sm_scale * LOG2E.value, window, HEADS_FIRST=heads_first, FUSED_DQ=one_pass,
        **flags, **cfg,
    )
    if one_pass:
        torch.mul(dq_acc[..., :Tq].permute(0, 3, 1, 2), sm_scale, out=dq)


def _dq_pass(q, k, v, c, call, do, lse, delta, dq, dc_row, flags, n_rows, t_max, z=None):
    """dQ and the row term of dc; pruned by the call's threshold where ``flags`` has HAS_THRESH."""
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    seq_start, cu_seqlens, sm_scale, window = call.seq_start, call.cu_seqlens, call.sm_scale, call.window
    threshold = call.threshold if flags["HAS_THRESH"] else None
    cfg = _tiles("dq", q, flags)
    k_desc, v_desc = launch.descriptors((k, v), cfg["BLOCK_N"], cfg, flags["USE_TMA"])
    ranges = kept_ranges(c, seq_start, cu_seqlens, threshold, n_rows, H, Tq, Tk, t_max, cfg, True, window)
    grid, heads_first = launch.grid("dq", n_rows * H, launch.cdiv(t_max, cfg["BLOCK_M"]), call.options.order_dq)
    launch.run(launch.any_length(_dq_kernel, Tq, Tk), grid,
        q, k, v, c, None if flags["ZEROS"] else local_sums(c, cu_seqlens, n_rows, t_max, cfg["BLOCK_N"]), z,
        seq_start, cu_seqlens, ranges, do, lse, delta, dq, dc_row, k_desc, v_desc,
        launch.strides(q), launch.strides(k), launch.strides(v), launch.strides(do), launch.strides(dq),
        launch.strides(c, 2), launch.strides(lse, 2),
        H, Tq, Tk, D, sm_scale, sm_scale * LOG2E.value, window, HEADS_FIRST=heads_first, **flags, **cfg,
    )
