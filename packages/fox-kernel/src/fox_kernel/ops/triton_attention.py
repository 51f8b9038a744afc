"""Triton kernels for Forgetting Attention: forward, dK/dV (with the gate gradient), dQ.

FlashAttention-2 structure with the FoX bias ``c_i - c_j`` added to every score tile:

* scores are kept in the log2 domain (``sm_scale * log2(e)`` folded into one multiply, ``exp2``);
* the prefix sums ``c`` are stored in float64 and each tile measures the bias from an anchor (``c`` at
  the tile's first row), so it is exact to the size of the *local* sum even when ``|c|`` is large (long
  sequences, fast-forgetting heads); the per-column values come as float32 offsets within their tile
  (``local_sums``) plus one float64 offset per tile, so no float64 work is done per column;
* key blocks left of a query tile's diagonal run without the causal mask; fully padded and (with
  ``adaptive_threshold``) negligibly decayed blocks are never visited;
* the gate gradient ``dc_j = sum_l ds_jl - sum_i ds_ij`` is a column sum taken in the dK/dV pass plus a
  row sum taken in the dQ pass, each position owned by one program, so no atomics are needed and
  gradients are bit-reproducible (the opt-in one-pass backward, ``FOX_KERNEL_BACKWARD=fused``, instead
  adds dQ and the row sums from the dK/dV programs with atomics; see ``fused_backward``);
* the row term ``c_i`` is constant along each softmax row, so it is left out of the tiles and folded
  into the log-sum-exp (forward) or the row vector ``lse - c_i`` (backward): one tile op less per block;
* the forward's softmax runs without a running maximum where it can: ``|q_i| max_j |k_j| s`` bounds
  every score and ``c`` never increases, so one number per query tile bounds every exponent of the
  tile; when each row's own largest term lies within ``FIXED_BOUND_GAP`` (log2) of it, far inside
  float32's range, the tile skips the row maxima and the rescaling of the accumulator (10-15% of the
  forward on an H200); the other tiles (large norms, or gates that decay much across a tile) are run
  by a second, online launch;
* on Hopper, K/V (forward, dQ) and Q/dO (dK/dV) tiles come through TMA tensor descriptors;
* the forward launches the heaviest (last) query blocks first; with ``adaptive_threshold`` the
  backward's kept ranges are found by a small kernel up front (the forward searches in place);
* GQA: one dK/dV program per key/value head loops over the query heads of its group.

Layouts: q (B, Tq, H, D), k/v (B, Tk, Hkv, D), any strides with a unit last stride; c (B, H, Tk)
float64; lse and delta (B, H, Tq) float32. Varlen inputs are packed as B = 1 and ``cu_seqlens``
gives the sequence bounds; the grid then runs over sequences.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from fox_kernel.ops.gates import gate_grad_from_dc
from fox_kernel.ops.gluon_attention import (
    GLUON_ONE_PASS_DIMS,
    gluon_blocks,
    gluon_dkdv,
    gluon_dq,
    gluon_forward,
    use_gluon,
    use_gluon_forward,
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _bounds(CU, SEQ_START, b, Tq, Tk, IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr):
    """(batch row for pointers, first packed row, q length, k length, first unpadded key)."""
    if IS_VARLEN:
        bos = tl.load(CU + b).to(tl.int64)
        eos = tl.load(CU + b + 1).to(tl.int64)
        row = tl.zeros([], dtype=tl.int64)
        t_q = (eos - bos).to(tl.int32)
        t_k = t_q
    else:
        bos = tl.zeros([], dtype=tl.int64)
        row = b.to(tl.int64)
        t_q = Tq
        t_k = Tk
    if HAS_SEQ_START:
        s0 = tl.load(SEQ_START + b).to(tl.int32)
    else:
        s0 = 0
    return row, bos, t_q, t_k, s0


@triton.jit
def _prefix_sums_kernel(LF, SEQ_START, C, stride_lb, stride_lt, stride_lh, H, T, HAS_SEQ_START: tl.constexpr,
                        BLOCK: tl.constexpr):
    """c (B, H, T) float64 = cumsum of log f (B, T, H) over T, zero before ``seq_start``: one program per
    (row, head) scans T in BLOCK-long chunks, carrying the float64 running sum."""
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    src = LF + b.to(tl.int64) * stride_lb + h * stride_lh
    dst = C + pid.to(tl.int64) * T
    _, _, _, _, s0 = _bounds(None, SEQ_START, b, T, T, False, HAS_SEQ_START)
    running = tl.zeros([], dtype=tl.float64)
    for start in range(0, T, BLOCK):
        t = start + tl.arange(0, BLOCK)
        x = tl.load(src + t.to(tl.int64) * stride_lt, mask=(t < T) & (t >= s0), other=0.0).to(tl.float64)
        tl.store(dst + t, tl.cumsum(x, 0) + running, mask=t < T)
        running += tl.sum(x, 0)


@triton.jit
def _gate_grad_kernel(DC, DC_ROW, SEQ_START, OUT, stride_ob, stride_ot, stride_oh, H, Tq, Tk,
                      HAS_SEQ_START: tl.constexpr, BLOCK: tl.constexpr):
    """d log f (B, Tk, H) float32 = the suffix sums over keys of dc (B, H, Tk) plus the row term dc_row
    (B, H, Tq, on the last Tq keys), in float64, zero before ``seq_start``: one program per (row, head)
    scans from the end in BLOCK-long chunks."""
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    dc = DC + pid.to(tl.int64) * Tk
    dc_row = DC_ROW + pid.to(tl.int64) * Tq
    dst = OUT + b.to(tl.int64) * stride_ob + h * stride_oh
    _, _, _, _, s0 = _bounds(None, SEQ_START, b, Tk, Tk, False, HAS_SEQ_START)
    shift = Tk - Tq
    n_chunks = tl.cdiv(Tk, BLOCK)
    running = tl.zeros([], dtype=tl.float64)
    for i in range(0, n_chunks):
        t = (n_chunks - 1 - i) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(dc + t, mask=t < Tk, other=0.0).to(tl.float64)
        x += tl.load(dc_row + (t - shift), mask=(t < Tk) & (t >= shift), other=0.0).to(tl.float64)
        suffix = tl.cumsum(x, 0, reverse=True) + running
        suffix = tl.where(t >= s0, suffix, 0.0)
        tl.store(dst + t.to(tl.int64) * stride_ot, suffix.to(tl.float32), mask=t < Tk)
        running += tl.sum(x, 0)


def triton_prefix_sums(log_fgate: torch.Tensor, seq_start: torch.Tensor | None) -> torch.Tensor:
    """c = cumsum(log f) in float64, laid out (B, H, T), gates before ``seq_start`` zeroed, in one launch
    (a float64 cast and torch's cumsum were two, and that cumsum over a few long rows ran ~40 us at
    T=16k, H=12 on an H200)."""
    B, T, H = log_fgate.shape
    c = torch.empty(B, H, T, dtype=torch.float64, device=log_fgate.device)
    if B * H and T:
        _prefix_sums_kernel[(B * H,)](log_fgate, seq_start, c, *_strides3(log_fgate), H, T,
                                      HAS_SEQ_START=seq_start is not None, BLOCK=_gate_block(T), num_warps=4)
    return c


def triton_gate_grad(dc: torch.Tensor, dc_row: torch.Tensor, seq_start: torch.Tensor | None) -> torch.Tensor:
    """``gates.gate_grad_from_dc(dc + dc_row on the last Tq keys)`` for fixed-length batches in one launch,
    written as a contiguous (B, Tk, H) tensor (it took seven: add, casts, flips, cumsum, copy)."""
    B, H, Tk = dc.shape
    Tq = dc_row.shape[-1]
    out = torch.empty(B, Tk, H, dtype=torch.float32, device=dc.device)
    if B * H and Tk:
        _gate_grad_kernel[(B * H,)](dc, dc_row, seq_start, out, *_strides3(out), H, Tq, Tk,
                                    HAS_SEQ_START=seq_start is not None, BLOCK=_gate_block(Tk), num_warps=4)
    return out


def _gate_block(T: int) -> int:
    return 16 if interpreting() else min(2048, max(16, triton.next_power_of_2(T)))


@triton.jit
def _local_sums_kernel(C, CU, OUT, stride_cb, stride_ch, H, T, origin, IS_VARLEN: tl.constexpr, SEG: tl.constexpr):
    """``(c_p - c_a) * log2(e)`` in float32, ``a`` the start of ``p``'s segment: segments (a pass's
    tiles) start at ``origin + k * SEG`` of each sequence (positions before ``origin`` take position 0)."""
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    row, bos, t, _, _ = _bounds(CU, C, b, T, T, IS_VARLEN, False)
    start = origin + (pid_s - 1) * SEG
    if start >= t:
        return
    pos = start + tl.arange(0, SEG)
    mask = (pos >= 0) & (pos < t)
    base = row * stride_cb + h * stride_ch + bos
    a = tl.load(C + base + tl.maximum(start, 0))
    x = tl.load(C + base + pos, mask=mask, other=0.0)
    tl.store(OUT + base + pos, ((x - a) * 1.4426950408889634).to(tl.float32), mask=mask)


@triton.jit
def _segment_offset(c_ptr, anchor, seg_pos):
    """log2(e) * (c at a tile's first position - the anchor) in float32: added to the local sums it gives
    ``(c_j - anchor) * log2(e)`` for every position j of the tile, with one float64 op per tile."""
    return ((tl.load(c_ptr + seg_pos) - anchor) * 1.4426950408889634).to(tl.float32)


@triton.jit
def _first_kept_key_block(c_ptr, c_top, delta, lo, hi, BLOCK_N: tl.constexpr, SCAN: tl.constexpr):
    """First key block in [lo, hi) whose largest bias ``c_top - c_last`` reaches ``delta``.

    ``c`` never increases, so the blocks that fall under the bound form a prefix. It is counted SCAN
    block ends per vector load from the left: when nothing prunes (slow gates) one load decides.
    """
    j = lo // BLOCK_N
    last = hi // BLOCK_N
    go = j < last
    while go:
        idx = j + tl.arange(0, SCAN)
        valid = idx < last
        c_last = tl.load(c_ptr + idx * BLOCK_N + BLOCK_N - 1, mask=valid, other=0.0)
        n = tl.sum((valid & ((c_top - c_last).to(tl.float32) < delta)).to(tl.int32), 0)
        j += n
        go = (n == SCAN) & (j < last)
    return j * BLOCK_N


@triton.jit
def _block_and_head(HEADS_FIRST: tl.constexpr, REVERSE: tl.constexpr):
    """(block, row*head, number of blocks) of this program. Blocks are launched heaviest first (REVERSE: the last query
    blocks see the most keys); HEADS_FIRST puts heads on grid axis 0, so all heads' heaviest blocks
    start before any lighter one, else one head's blocks run together (sharing K/V or Q/dO in L2)."""
    if HEADS_FIRST:
        blk = tl.program_id(1)
        n_blk = tl.num_programs(1)
        bh = tl.program_id(0)
    else:
        blk = tl.program_id(0)
        n_blk = tl.num_programs(0)
        bh = tl.program_id(1)
    if REVERSE:
        blk = n_blk - 1 - blk
    return blk, bh, n_blk


@triton.jit
def _key_range(first, s0, t_k, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key blocks of the query tile whose first row sits at key position ``first``: [lo, mid) fully
    visible (with a window: [lo, _window_split) partly outside it), [mid, hi) on the diagonal."""
    lo = (s0 // BLOCK_N) * BLOCK_N
    mid = tl.maximum((tl.minimum(first, t_k) // BLOCK_N) * BLOCK_N, lo)
    hi = tl.minimum(first + BLOCK_M, t_k)
    if HAS_WINDOW:  # the first key any row of the tile sees is first - window + 1
        lo = tl.minimum(tl.maximum((tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N, lo), mid)
    return lo, mid, hi


@triton.jit
def _window_split(lo, mid, first, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """First key block of [lo, mid) that every row of the query tile starting at ``first`` sees whole:
    keys from ``first + BLOCK_M - window`` on lie inside every row's window."""
    split = tl.cdiv(tl.maximum(first + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N
    return tl.minimum(tl.maximum(split, lo), mid)


@triton.jit
def _query_range(pid_n, shift, s0, t_q, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_WINDOW: tl.constexpr):
    """Query blocks that see part of key block ``pid_n`` (diagonal, [m_lo, m_mid)) then all of it, up to
    m_hi (t_q; with a window, the end of the queries whose window reaches the block's last key)."""
    m_lo = (tl.maximum(pid_n * BLOCK_N - shift, 0) // BLOCK_M) * BLOCK_M
    m_mid = tl.minimum(tl.maximum((pid_n + 1) * BLOCK_N - shift + BLOCK_M - 1, 0) // BLOCK_M * BLOCK_M, t_q)
    m_mid = tl.maximum(m_mid, m_lo)
    m_hi = t_q
    if HAS_WINDOW:  # the last query that sees key j sits at key position j + window - 1
        m_hi = tl.minimum(tl.cdiv(tl.maximum((pid_n + 1) * BLOCK_N + window - 1 - shift, 0), BLOCK_M) * BLOCK_M, t_q)
    if (pid_n + 1) * BLOCK_N <= s0:  # every key here is padding
        m_lo = t_q
        m_mid = t_q
    return m_lo, m_mid, m_hi


@triton.jit
def _query_window_split(pid_n, shift, window, m_mid, m_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """End of the query blocks in [m_mid, m_hi) whose windows hold all of key block ``pid_n``: a block
    starting at m does when its last row, at key position m + BLOCK_M - 1 + shift, is before the block's
    first key + window."""
    split = (tl.maximum(pid_n * BLOCK_N + window - shift, 0) // BLOCK_M) * BLOCK_M
    return tl.maximum(tl.minimum(split, m_hi), m_mid)


@triton.jit
def _kept_range_kernel(C, SEQ_START, CU, THRESH, OUT, stride_cb, stride_ch, H, Tq, Tk, WINDOW,
                       KEYS_OF_QUERIES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr, SCAN: tl.constexpr,
                       HAS_WINDOW: tl.constexpr):
    """Pruned ranges for the backward passes, one int per (row, head, block), found once up front so
    the dQ and dK/dV kernels only load them (searching inside them cost registers and time).

    KEYS_OF_QUERIES: first kept key of each query block (dQ); else end of the kept queries of each key
    block (dK/dV)."""
    pid_bh = tl.program_id(0)
    pid = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    row, bos, t_q, t_k, s0 = _bounds(CU, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    shift = t_k - t_q
    c_ptr = C + row * stride_cb + h * stride_ch + bos
    delta = tl.load(THRESH + b * H + h)
    out_ptr = OUT + pid_bh.to(tl.int64) * tl.num_programs(1) + pid
    if KEYS_OF_QUERIES:
        if pid * BLOCK_M < t_q:
            first = pid * BLOCK_M + shift
            lo, mid, hi = _key_range(first, s0, t_k, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
            tl.store(out_ptr, _first_kept_key_block(c_ptr, tl.load(c_ptr + first), delta, lo, mid, BLOCK_N, SCAN))
    else:
        if pid * BLOCK_N < t_k:
            m_lo, m_mid, m_hi = _query_range(pid, shift, s0, t_q, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
            c_bottom = tl.load(c_ptr + tl.minimum(pid * BLOCK_N + BLOCK_N, t_k) - 1)
            tl.store(out_ptr, _last_kept_query_block(c_ptr, c_bottom, delta, shift, m_mid, m_hi, BLOCK_M, SCAN))


@triton.jit
def _load_kv(k_ptrs, v_ptrs, kn, mask_n, mask_d, stride_kt, stride_vt, MASKED: tl.constexpr):
    """A (BLOCK_N, BLOCK_D) tile of K and of V; off the diagonal with a power-of-two D, unmasked."""
    rows = kn[:, None].to(tl.int64)
    if MASKED:
        mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptrs + rows * stride_kt, mask=mask, other=0.0)
        v = tl.load(v_ptrs + rows * stride_vt, mask=mask, other=0.0)
    else:
        k = tl.load(k_ptrs + rows * stride_kt)
        v = tl.load(v_ptrs + rows * stride_vt)
    return k, v


@triton.jit
def _kv_tiles(k_ptrs, v_ptrs, kn, mask_n, mask_d, stride_kt, stride_vt, k_desc, v_desc, row, bos, start_n, hk,
              MASKED: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    if USE_TMA:  # Hopper tensor-memory loads; rows past the tensor's end come back as zeros
        k = k_desc.load([row, (bos + start_n).to(tl.int32), hk, 0]).reshape(BLOCK_N, BLOCK_D)
        v = v_desc.load([row, (bos + start_n).to(tl.int32), hk, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        k, v = _load_kv(k_ptrs, v_ptrs, kn, mask_n, mask_d, stride_kt, stride_vt, MASKED)
    return k, v


@triton.jit
def _fwd_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k, start_n,
               stride_kt, stride_vt, sm_scale2, offs_n, mask_d, k_desc, v_desc, row, bos, hk, bound,
               CAUSAL: tl.constexpr, HAS_SEQ_START: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
               USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FIXED: tl.constexpr,
               ROWS: tl.constexpr, rowwise, window, WINDOWED: tl.constexpr):
    """One key block of the softmax; FIXED: ``bound`` bounds every exponent of the tile and is
    subtracted with the column term, so there is no row maximum and no rescaling; with ``rowwise``
    (ROWS 1: always, ROWS 2: a run-time choice per tile) each row subtracts its own bound ``m_i``."""
    kn = start_n + offs_n
    mask_n = kn < t_k
    k, v = _kv_tiles(k_ptrs, v_ptrs, kn, mask_n, mask_d, stride_kt, stride_vt, k_desc, v_desc, row, bos, start_n, hk,
                     CAUSAL or not EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)
    c_k2 = tl.load(cl_ptr + kn, mask=mask_n, other=0.0) + _segment_offset(c_ptr, anchor, start_n)
    if FIXED:
        c_k2 += bound
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale2 - c_k2[None, :]
    if FIXED:
        if ROWS == 1:
            s = s - m_i[:, None]
        elif ROWS == 2:  # noqa: SIM102 (a compile-time test, then a run-time one)
            if rowwise:
                s = s - m_i[:, None]
    if CAUSAL:
        s = tl.where((kn[None, :] <= pos_m[:, None]) & mask_n[None, :], s, float("-inf"))
    if WINDOWED:
        s = tl.where(kn[None, :] > pos_m[:, None] - window, s, float("-inf"))
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
               rowwise, stride_kt, stride_vt, sm_scale2, offs_n, mask_d, k_desc, v_desc, row, bos, hk, window,
               HAS_SEQ_START: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FIXED: tl.constexpr,
               ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[mid, hi) diagonal, [split, mid) whole, [lo, split) at the window's edge (split = lo without a window)."""
    if FIXED:
        # the bound each row's weights are measured from (it enters the log-sum-exp)
        if ROWS == 1:
            m_i = row_bound
            bound = 0.0  # folded into the column term only for the tile bound
        elif ROWS == 2:
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
                                   BLOCK_N, BLOCK_D, FIXED, ROWS, rowwise, window, HAS_WINDOW)
    for jj in range(0, (mid - split) // BLOCK_N):
        start_n = mid - BLOCK_N - jj * BLOCK_N
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k,
                                   start_n, stride_kt, stride_vt, sm_scale2, offs_n, mask_d, k_desc, v_desc,
                                   row, bos, hk, bound, False, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA,
                                   BLOCK_N, BLOCK_D, FIXED, ROWS, rowwise, window, False)
    if HAS_WINDOW:
        for jj in range(0, (split - lo) // BLOCK_N):
            start_n = split - BLOCK_N - jj * BLOCK_N
            acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k,
                                       start_n, stride_kt, stride_vt, sm_scale2, offs_n, mask_d, k_desc, v_desc,
                                       row, bos, hk, bound, False, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA,
                                       BLOCK_N, BLOCK_D, FIXED, ROWS, rowwise, window, True)
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, C, CL, SEQ_START, CU, THRESH, O, LSE, K_DESC, V_DESC, KMAX2, ONLINE,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_cb, stride_ch, stride_lb, stride_lh,
    H, Tq, Tk, D, sm_scale2, WINDOW,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr, HAS_THRESH: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SCAN: tl.constexpr,
    HEADS_FIRST: tl.constexpr, MODE: tl.constexpr, GAP: tl.constexpr, ROWS: tl.constexpr,
    AUTO: tl.constexpr, LOG_EPS: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """MODE 0: every query tile with the online softmax. MODE 1: the tiles whose fixed bound is usable
    (the others are marked in ONLINE), MODE 2: the marked tiles, online (one kernel holding both
    loops needed twice the shared memory).

    AUTO (with HAS_THRESH): the pruning bound of each query tile comes from its own rows' norms,
    ``delta = ln eps - ln Tk - 2 max_i |q_i| max|k| |s|``, and THRESH receives the least over the
    tiles of each (row, head): the per-head "auto" bound, which the backward uses."""
    pid_m, pid_bh, n_blk = _block_and_head(HEADS_FIRST, True)
    b = pid_bh // H
    h = pid_bh % H
    row, bos, t_q, t_k, s0 = _bounds(CU, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    if pid_m * BLOCK_M >= t_q:
        return
    tile = pid_bh.to(tl.int64) * n_blk + pid_m
    if MODE == 2:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if tl.load(ONLINE + tile) == 0:
            return
    shift = t_k - t_q
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
    c_q2 = (c_q - anchor).to(tl.float32) * 1.4426950408889634

    lo, mid, hi = _key_range(first, s0, t_k, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    q_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    kmax2 = 0.0
    if MODE == 1 or AUTO:
        qf = q.to(tl.float32)
        q_sq = tl.sum(qf * qf, 1)
        kmax2 = tl.load(KMAX2 + b * (H // GROUP) + hk)  # per batch row or packed sequence
    if HAS_THRESH:  # one vector load decides when nothing prunes: searched in place
        if AUTO:
            u = tl.sqrt(tl.max(tl.where(mask_m, q_sq, 0.0), 0) * kmax2) * tl.abs(sm_scale2) * 0.6931471805599453
            delta = LOG_EPS - tl.log(tl.maximum(t_k, 1).to(tl.float32)) - 2.0 * u
            if MODE < 2:  # every tile passes through MODE 0 or 1 once
                tl.atomic_min(THRESH + b * H + h, delta, sem="relaxed")
        else:
            delta = tl.load(THRESH + b * H + h)
        lo = _first_kept_key_block(c_ptr, anchor, delta, lo, mid, BLOCK_N, SCAN)
    split = lo
    if HAS_WINDOW:
        split = _window_split(lo, mid, first, WINDOW, BLOCK_M, BLOCK_N)

    cl_ptr = CL + row * stride_cb + h * stride_ch + bos
    bound = 0.0
    row_bound = tl.zeros([BLOCK_M], dtype=tl.float32)
    rowwise = False
    if MODE == 1:
        bound, tile_ok, row_bound, rows_ok = _fixed_bound(q_sq, c_q2, mask_m, kmax2, sm_scale2, GAP)
        if ROWS == 0:
            usable = tile_ok
        elif ROWS == 1:
            usable = rows_ok
        else:
            usable = tile_ok | rows_ok
            rowwise = tile_ok == 0
        tl.store(ONLINE + tile, tl.where(usable, 0, 1).to(tl.int8))
        if not usable:
            return
    acc, l_i, m_i = _fwd_loops(q, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k, lo, split, mid, hi, bound,
                               row_bound, rowwise, stride_kt, stride_vt, sm_scale2, offs_n, mask_d, K_DESC, V_DESC,
                               row.to(tl.int32), bos, hk, WINDOW, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA,
                               BLOCK_M, BLOCK_N, BLOCK_D, MODE == 1, ROWS, HAS_WINDOW)

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = O + row * stride_ob + h * stride_oh + (bos + offs_m)[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])
    # The row term c_i of the bias is constant along the softmax axis: it was left out of the tiles and
    # only enters the log-sum-exp.
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0)) + c_q2) * 0.6931471805599453, float("inf"))
    tl.store(LSE + row * stride_lb + h * stride_lh + bos + offs_m, lse, mask=mask_m)


@triton.jit
def _max_sq_norm_kernel(X, Y, OUT, sxb, sxt, sxh, syb, syt, syh, HX, HY, TX, TY, D,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PER_ROW: tl.constexpr):
    """OUT[b, h] = max over t of |X[b, t, h, :]|^2 for h < HX, of |Y[b, t, h - HX, :]|^2 after (float32;
    atomic max of non-negative values, so the result does not depend on the order). PER_ROW (X only,
    B = 1): OUT[t, h] = |X[0, t, h, :]|^2, the same sums one by one."""
    pid_bh = tl.program_id(0)  # heads fastest: neighbouring programs read neighbouring memory
    pid_t = tl.program_id(1)
    b = pid_bh // (HX + HY)
    h = pid_bh % (HX + HY)
    if h < HX:
        base = X + b.to(tl.int64) * sxb + h * sxh
        stride_t = sxt
        t_len = TX
    else:
        base = Y + b.to(tl.int64) * syb + (h - HX) * syh
        stride_t = syt
        t_len = TY
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    if pid_t * BLOCK_T < t_len:
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_t < t_len)[:, None] & (offs_d < D)[None, :]
        x = tl.load(base + offs_t.to(tl.int64)[:, None] * stride_t + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if PER_ROW:
            tl.store(OUT + offs_t.to(tl.int64) * HX + h, tl.sum(x * x, 1), mask=offs_t < t_len)
        else:
            tl.atomic_max(OUT + pid_bh, tl.max(tl.sum(x * x, 1), 0))


def max_sq_row_norms(x: torch.Tensor, y: torch.Tensor | None = None, per_row: bool = False) -> torch.Tensor:
    """(B, Hx [+ Hy]) float32: the largest squared L2 norm over time of the rows of x (B, T, Hx, D)
    (then of y (B, T', Hy, D)), both read in one launch. ``per_row`` (x alone, B = 1): (T, Hx), every
    row's squared norm, summed as the maxima are."""
    B, TX, HX, D = x.shape
    TY, HY = (y.shape[1], y.shape[2]) if y is not None else (0, 0)
    if per_row and (y is not None or B != 1):
        raise ValueError("per_row takes one tensor with a batch of 1")
    out = torch.zeros(*((TX, HX) if per_row else (B, HX + HY)), dtype=torch.float32, device=x.device)
    y_ = y if y is not None else x
    if max(TX, TY) > 0 and B > 0:
        block_t = 64
        _max_sq_norm_kernel[(B * (HX + HY), triton.cdiv(max(TX, TY), block_t))](
            x, y_, out, *_strides3(x), *_strides3(y_), HX, HY, TX, TY, D, BLOCK_T=block_t,
            BLOCK_D=max(16, triton.next_power_of_2(D)), PER_ROW=per_row, num_warps=4,
        )
    return out


def key_sq_norms(k: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """(rows, Hkv) float32: the largest squared key norm per batch row, or per packed sequence."""
    if cu_seqlens is None:
        return max_sq_row_norms(k)
    n, T = cu_seqlens.numel() - 1, k.shape[1]
    sq = max_sq_row_norms(k, per_row=True)  # (T, Hkv), the same sums as a sequence alone gets
    seq = torch.searchsorted(cu_seqlens[1:].to(torch.int64), torch.arange(T, device=k.device), right=True)
    seq = seq.clamp_(max=max(n - 1, 0))[:, None].expand_as(sq)
    return torch.zeros(n, k.shape[2], dtype=torch.float32, device=k.device).scatter_reduce_(0, seq, sq, "amax")


def max_row_norms(x: torch.Tensor) -> torch.Tensor:
    """(B, H) float32: the largest L2 norm over time of the rows of x (B, T, H, D), read once."""
    return max_sq_row_norms(x).sqrt_()


@triton.jit
def _auto_threshold_kernel(N2, OUT, H, HKV, GROUP, sm_scale, const, BLOCK_H: tl.constexpr):
    """OUT[b, h] = -2 |q|max |k|max |s| + const (const = ln eps - ln Tk) from the squared maxima N2
    (B, H + HKV) of max_sq_row_norms(q, k): the "auto" pruning bound in one launch."""
    b = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    mask = h < H
    qn2 = tl.load(N2 + b * (H + HKV) + h, mask=mask, other=0.0)
    kn2 = tl.load(N2 + b * (H + HKV) + H + h // GROUP, mask=mask, other=0.0)
    tl.store(OUT + b * H + h, -2.0 * tl.sqrt(qn2 * kn2) * tl.abs(sm_scale) + const, mask=mask)


def auto_threshold(q, k, sm_scale, t_k, log_eps):
    """The "auto" bound delta = -(2 U + ln Tk) + ln eps, U = max|q| max|k| |s|, per (row, head): (B, H)
    float32 from one read of q and k (three launches in all)."""
    B, _, H, _ = q.shape
    n2 = max_sq_row_norms(q, k)
    out = torch.empty(B, H, dtype=torch.float32, device=q.device)
    if B > 0:
        _auto_threshold_kernel[(B,)](n2, out, H, k.shape[2], H // k.shape[2], float(sm_scale),
                                     float(log_eps - math.log(max(t_k, 1))),
                                     BLOCK_H=triton.next_power_of_2(H), num_warps=1)
    return out


@triton.jit
def _delta_kernel(O, DO, DELTA, stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh,
                  H, T, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta_i = sum_d o_id * do_id (float32), written as (B, H, T)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < T)[:, None] & (offs_d < D)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(O + b * stride_ob + h * stride_oh + rows * stride_ot + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + rows * stride_dt + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + pid_bh.to(tl.int64) * T + offs_m, delta, mask=offs_m < T)


@triton.jit
def _dkdv_block(dk, dv, dc, k, v, c_k2, q_ptrs, do_ptrs, lse_ptr, delta_ptr, c_ptr, clq_ptr, anchor, offs_n,
                s0, t_q, shift, start_m, stride_qt, stride_dot, sm_scale2, mask_d, q_desc, do_desc, row, bos, h,
                dq_ptr, dcrow_ptr, dq_desc, stride_qad, offs_d, window,
                BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEQ_START: tl.constexpr,
                PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_D: tl.constexpr, FUSED_DQ: tl.constexpr,
                WINDOWED: tl.constexpr):
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
    c_q2 = tl.load(clq_ptr + pos_m, mask=mask_m, other=0.0) + _segment_offset(c_ptr, anchor, shift + start_m)
    lse2 = tl.load(lse_ptr + offs_m, mask=mask_m, other=float("inf")) * 1.4426950408889634 - c_q2
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * sm_scale2 - c_k2[:, None]
    if CAUSAL:
        s_t = tl.where(offs_n[:, None] <= pos_m[None, :], s_t, float("-inf"))
    if WINDOWED:
        s_t = tl.where(offs_n[:, None] > pos_m[None, :] - window, s_t, float("-inf"))
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
def _last_kept_query_block(c_ptr, c_bottom, delta, shift, lo, hi, BLOCK_M: tl.constexpr, SCAN: tl.constexpr):
    """End of the query blocks in [lo, hi) whose largest bias ``c_first - c_bottom`` reaches ``delta``.

    Later queries see ever smaller ``c``, so the negligible blocks form a suffix. It is counted SCAN
    blocks per vector load from the right: when nothing prunes (slow gates) one load decides.
    """
    first = lo // BLOCK_M
    j = (hi + BLOCK_M - 1) // BLOCK_M
    go = j > first
    while go:
        idx = j - SCAN + tl.arange(0, SCAN)
        valid = idx >= first
        c_first = tl.load(c_ptr + idx * BLOCK_M + shift, mask=valid, other=0.0)
        n = tl.sum((valid & ((c_first - c_bottom).to(tl.float32) < delta)).to(tl.int32), 0)
        j -= n
        go = (n == SCAN) & (j > first)
    return tl.minimum(j * BLOCK_M, hi)


@triton.jit
def _dkdv_kernel(
    Q, K, V, C, CLQ, SEQ_START, CU, RANGE, DO, LSE, DELTA, DK, DV, DC, A_DESC, B_DESC, DQ_ACC, DC_ROW, DQ_DESC,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh,
    stride_cb, stride_ch, stride_lb, stride_lh, stride_qab, stride_qah, stride_qad,
    H, HKV, Tq, Tk, D, sm_scale, sm_scale2, WINDOW,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr, HAS_THRESH: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SCAN: tl.constexpr,
    HEADS_FIRST: tl.constexpr, FUSED_DQ: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """dK, dV and the column term of dc per key block; with FUSED_DQ also dQ and the row term of dc,
    added in with atomics (one pass instead of two, not bit-reproducible)."""
    pid_n, pid_bh, n_blk = _block_and_head(HEADS_FIRST, False)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    row, bos, t_q, t_k, s0 = _bounds(CU, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    if pid_n * BLOCK_N >= t_k:
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

    m_lo, m_mid, m_end = _query_range(pid_n, shift, s0, t_q, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    for g in range(GROUP):
        h = hk * GROUP + g
        c_ptr = C + row * stride_cb + h * stride_ch + bos
        clq_ptr = CLQ + row * stride_cb + h * stride_ch + bos
        anchor = tl.load(c_ptr + pid_n * BLOCK_N)
        c_k = tl.load(c_ptr + offs_n, mask=mask_n, other=0.0)
        c_k2 = (c_k - anchor).to(tl.float32) * 1.4426950408889634
        q_ptrs = Q + row * stride_qb + h * stride_qh + bos * stride_qt + offs_d[None, :]
        do_ptrs = DO + row * stride_dob + h * stride_doh + bos * stride_dot + offs_d[None, :]
        lse_ptr = LSE + row * stride_lb + h * stride_lh + bos
        delta_ptr = DELTA + row * stride_lb + h * stride_lh + bos
        dq_ptr = DQ_ACC + row * stride_qab + h * stride_qah + bos
        dcrow_ptr = DC_ROW + row * stride_lb + h * stride_lh + bos
        m_hi = m_end
        if HAS_THRESH:
            m_hi = tl.load(RANGE + (b * H + h).to(tl.int64) * n_blk + pid_n)
        m_diag = m_mid
        m_split = m_hi
        if HAS_WINDOW:  # a narrow window can end inside the diagonal blocks
            m_diag = tl.minimum(m_mid, m_hi)
            m_split = _query_window_split(pid_n, shift, WINDOW, m_diag, m_hi, BLOCK_M, BLOCK_N)
        dc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start_m in range(m_lo, m_diag, BLOCK_M):
            dk, dv, dc = _dkdv_block(dk, dv, dc, k, v, c_k2, q_ptrs, do_ptrs, lse_ptr, delta_ptr, c_ptr, clq_ptr, anchor,
                                     offs_n, s0, t_q, shift, start_m, stride_qt, stride_dot, sm_scale2, mask_d,
                                     A_DESC, B_DESC, row.to(tl.int32), bos, h, dq_ptr, dcrow_ptr, DQ_DESC,
                                     stride_qad, offs_d, WINDOW, BLOCK_M, True, HAS_SEQ_START, PRECISION, USE_TMA,
                                     BLOCK_D, FUSED_DQ, HAS_WINDOW)
        for start_m in range(m_diag, m_split, BLOCK_M):
            dk, dv, dc = _dkdv_block(dk, dv, dc, k, v, c_k2, q_ptrs, do_ptrs, lse_ptr, delta_ptr, c_ptr, clq_ptr, anchor,
                                     offs_n, s0, t_q, shift, start_m, stride_qt, stride_dot, sm_scale2, mask_d,
                                     A_DESC, B_DESC, row.to(tl.int32), bos, h, dq_ptr, dcrow_ptr, DQ_DESC,
                                     stride_qad, offs_d, WINDOW, BLOCK_M, False, HAS_SEQ_START, PRECISION, USE_TMA,
                                     BLOCK_D, FUSED_DQ, False)
        if HAS_WINDOW:
            for start_m in range(m_split, m_hi, BLOCK_M):
                dk, dv, dc = _dkdv_block(dk, dv, dc, k, v, c_k2, q_ptrs, do_ptrs, lse_ptr, delta_ptr, c_ptr, clq_ptr,
                                         anchor, offs_n, s0, t_q, shift, start_m, stride_qt, stride_dot, sm_scale2,
                                         mask_d, A_DESC, B_DESC, row.to(tl.int32), bos, h, dq_ptr, dcrow_ptr, DQ_DESC,
                                         stride_qad, offs_d, WINDOW, BLOCK_M, False, HAS_SEQ_START, PRECISION,
                                         USE_TMA, BLOCK_D, FUSED_DQ, True)
        tl.store(DC + row * stride_cb + h * stride_ch + bos + offs_n, dc, mask=mask_n)
    dk_ptrs = DK + row * stride_dkb + hk * stride_dkh + rows_n * stride_dkt + offs_d[None, :]
    dv_ptrs = DV + row * stride_dvb + hk * stride_dvh + rows_n * stride_dvt + offs_d[None, :]
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask_nd)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask_nd)


@triton.jit
def _dq_block(dq, dc_row, q, do, lse2, delta, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k, start_n,
              stride_kt, stride_vt, sm_scale2, offs_n, mask_d, k_desc, v_desc, row, bos, hk, window,
              CAUSAL: tl.constexpr, HAS_SEQ_START: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
              USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOWED: tl.constexpr):
    kn = start_n + offs_n
    mask_n = kn < t_k
    k, v = _kv_tiles(k_ptrs, v_ptrs, kn, mask_n, mask_d, stride_kt, stride_vt, k_desc, v_desc, row, bos, start_n, hk,
                     CAUSAL or not EVEN_D, USE_TMA, BLOCK_N, BLOCK_D)
    c_k2 = tl.load(cl_ptr + kn, mask=mask_n, other=0.0) + _segment_offset(c_ptr, anchor, start_n)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale2 - c_k2[None, :]
    if CAUSAL:
        s = tl.where((kn[None, :] <= pos_m[:, None]) & mask_n[None, :], s, float("-inf"))
    if WINDOWED:
        s = tl.where(kn[None, :] > pos_m[:, None] - window, s, float("-inf"))
    if HAS_SEQ_START:
        s = tl.where(kn[None, :] >= s0, s, float("-inf"))
    p = tl.math.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq, dc_row + tl.sum(ds, 1)


@triton.jit
def _dq_kernel(
    Q, K, V, C, CL, SEQ_START, CU, RANGE, DO, LSE, DELTA, DQ, DC_ROW, A_DESC, B_DESC,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_dqb, stride_dqt, stride_dqh,
    stride_cb, stride_ch, stride_lb, stride_lh,
    H, Tq, Tk, D, sm_scale, sm_scale2, WINDOW,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr, HAS_THRESH: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr, SCAN: tl.constexpr,
    HEADS_FIRST: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    pid_m, pid_bh, n_blk = _block_and_head(HEADS_FIRST, True)
    b = pid_bh // H
    h = pid_bh % H
    row, bos, t_q, t_k, s0 = _bounds(CU, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    if pid_m * BLOCK_M >= t_q:
        return
    shift = t_k - t_q
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
    lse2 = tl.load(LSE + row * stride_lb + h * stride_lh + bos + offs_m, mask=mask_m, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + row * stride_lb + h * stride_lh + bos + offs_m, mask=mask_m, other=0.0)
    hk = h // GROUP
    k_ptrs = K + row * stride_kb + hk * stride_kh + bos * stride_kt + offs_d[None, :]
    v_ptrs = V + row * stride_vb + hk * stride_vh + bos * stride_vt + offs_d[None, :]
    c_ptr = C + row * stride_cb + h * stride_ch + bos
    cl_ptr = CL + row * stride_cb + h * stride_ch + bos
    first = pid_m * BLOCK_M + shift
    anchor = tl.load(c_ptr + first)
    c_q = tl.load(c_ptr + pos_m, mask=mask_m, other=0.0)
    # the row term of the bias folded into the log-sum-exp (a vector op instead of a tile op per block)
    lse2 -= (c_q - anchor).to(tl.float32) * 1.4426950408889634

    lo, mid, hi = _key_range(first, s0, t_k, WINDOW, BLOCK_M, BLOCK_N, HAS_WINDOW)
    if HAS_THRESH:
        # written as a multiple of BLOCK_N so the compiler keeps the key loads aligned (vectorised)
        lo = (tl.load(RANGE + pid_bh.to(tl.int64) * n_blk + pid_m) // BLOCK_N) * BLOCK_N
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dc_row = tl.zeros([BLOCK_M], dtype=tl.float32)
    split = lo
    if HAS_WINDOW:
        split = _window_split(lo, mid, first, WINDOW, BLOCK_M, BLOCK_N)
        for jj in range(0, (split - lo) // BLOCK_N):
            start_n = lo + jj * BLOCK_N
            dq, dc_row = _dq_block(dq, dc_row, q, do, lse2, delta, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0,
                                   t_k, start_n, stride_kt, stride_vt, sm_scale2, offs_n, mask_d, A_DESC, B_DESC,
                                   row.to(tl.int32), bos, hk, WINDOW, False, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA,
                                   BLOCK_N, BLOCK_D, True)
    # counted from 0 rather than ranging from lo: with lo loaded (pruning) the range form made this
    # pass 30-40% slower on an H200 (same results); the counted loop runs as fast as lo = 0
    for jj in range(0, (mid - split) // BLOCK_N):
        start_n = split + jj * BLOCK_N
        dq, dc_row = _dq_block(dq, dc_row, q, do, lse2, delta, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k, start_n,
                               stride_kt, stride_vt, sm_scale2, offs_n, mask_d, A_DESC, B_DESC, row.to(tl.int32), bos, hk,
                               WINDOW, False, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA, BLOCK_N, BLOCK_D, False)
    for start_n in range(mid, hi, BLOCK_N):
        dq, dc_row = _dq_block(dq, dc_row, q, do, lse2, delta, k_ptrs, v_ptrs, c_ptr, cl_ptr, anchor, pos_m, s0, t_k, start_n,
                               stride_kt, stride_vt, sm_scale2, offs_n, mask_d, A_DESC, B_DESC, row.to(tl.int32), bos, hk,
                               WINDOW, True, HAS_SEQ_START, EVEN_D, PRECISION, USE_TMA, BLOCK_N, BLOCK_D, HAS_WINDOW)
    dq_ptrs = DQ + row * stride_dqb + h * stride_dqh + rows_m * stride_dqt + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=mask_md)
    tl.store(DC_ROW + row * stride_lb + h * stride_lh + bos + offs_m, dc_row, mask=mask_m)


# Copies of the kernels that do not specialise on the sequence lengths, used when one of them is 1:
# Triton turns a length of 1 into a constant, and that made ptxas (Triton 3.6, sm90) crash on the dQ
# kernel. Other lengths keep the specialised kernels (not specialising cost 10-20% at T=16k).
_LENGTHS = ("Tq", "Tk")
_ANY_LENGTH = {}


def _kernel(kernel, Tq, Tk):
    if min(Tq, Tk) > 1:
        return kernel
    if kernel not in _ANY_LENGTH:
        _ANY_LENGTH[kernel] = triton.jit(do_not_specialize=_LENGTHS)(kernel.fn)
    return _ANY_LENGTH[kernel]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Tile shapes per pass, from benchmarks/tune_tiles.py on an H200 (sm90, torch 2.11, triton 3.6, T=16k;
# the forward's swept with the fixed softmax bound, six tiles per head dim, fixed-bound-h200-s6.json);
# sm80 gets them with narrower key tiles and two stages (less shared memory); older GPUs, fp32 and
# D > 128 get small, safe tiles.
TILES = {
    "fwd": {64: dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
            128: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)},
    "dkdv": {64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
             128: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)},
    # D=64 dQ: 64x64 with three stages (backward 11.64 -> 10.65 ms at H=32, T=16k; backward-tiles-h200-s9.json)
    "dq": {64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
           128: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)},
    # the one-pass backward (dK/dV program adding dQ in with atomics)
    "fused": {64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
              128: dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3)},
}
SAFE_TILES = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)


def _config(kind: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    block_d = max(16, triton.next_power_of_2(head_dim))
    if interpreting() or device.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=block_d, num_warps=4, num_stages=1)
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8 or dtype == torch.float32 or block_d > 128:
        cfg = dict(SAFE_TILES)
        if block_d <= 128 and major >= 8:
            cfg["num_stages"] = 2
    else:
        cfg = dict(TILES[kind][max(64, block_d)])
        if major == 8:  # A100-class shared memory: narrower key tiles, two stages
            cfg.update(BLOCK_N=min(cfg["BLOCK_N"], 64), num_stages=min(cfg["num_stages"], 2))
    cfg["BLOCK_D"] = block_d
    return cfg


def _use_tma(*tensors) -> bool:
    """Tensor-memory-accelerator tile loads: Hopper (sm90+), 16-bit types, 16-byte aligned rows.

    ``FOX_KERNEL_TMA=0`` turns them off (for comparison). Packed varlen batches keep the pointer loads:
    with TMA, varlen outputs differed from each sequence run alone on an H200 (not yet understood)."""
    x0 = tensors[0]
    if os.environ.get("FOX_KERNEL_TMA", "1") == "0" or interpreting() or x0.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(x0.device)[0] < 9 or x0.dtype == torch.float32:
        return False
    size = x0.element_size()
    return all(
        x.stride(-1) == 1 and all((st * size) % 16 == 0 for st in x.stride()[:-1]) and x.data_ptr() % 16 == 0
        and x.shape[1] < 2**31
        for x in tensors
    )


def _descriptors(tensors, block_rows, cfg, use_tma):
    """Descriptors of (B, T, H, D) tensors read in (block_rows, BLOCK_D) tiles, or the tensors themselves."""
    if not use_tma:
        return tensors
    from triton.tools.tensor_descriptor import TensorDescriptor

    return [TensorDescriptor(x, list(x.shape), list(x.stride()), [1, block_rows, 1, cfg["BLOCK_D"]]) for x in tensors]


def _grid(kind, n_heads, n_blocks, head_dim=128, group=1):
    """Grid and launch order of a pass (see _block_and_head). Measured on an H200 (T=16k/8k): the
    forward gains from all heads' heaviest blocks first at D <= 64 and with GQA (2-3%), loses at D=128
    MHA; both backward passes lose with it (D=64 dK/dV up to 2x: Q/dO no longer shared in L2), except
    the dK/dV pass of GQA at D=128: a program there runs the whole group, so one group's heaviest
    programs, launched last, left a tail (fwd+bwd 1-8% faster heads first at four shapes on an H200,
    gqa-launch-order-h200-s10.json;
    at D=64 it was 3% slower at T=16k). FOX_KERNEL_ORDER_<PASS>=heads|blocks overrides (for benchmarking)."""
    heads = (kind == "fwd" and (head_dim <= 64 or group > 1)) or (kind == "dkdv" and group > 1 and head_dim > 64)
    default = "heads" if heads else "blocks"
    order = os.environ.get(f"FOX_KERNEL_ORDER_{kind.upper()}", default)
    heads_first = order == "heads"
    return ((n_heads, n_blocks) if heads_first else (n_blocks, n_heads)), heads_first


def _scan() -> int:
    """Block bounds read per vector load when searching the pruned range (small in the interpreter, so
    tests cross several loads)."""
    return 4 if interpreting() else 64


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides3(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _grid_rows(cu_seqlens, batch, length):
    """(programs along the batch axis, longest sequence) for the grid."""
    if cu_seqlens is None:
        return batch, length
    return cu_seqlens.numel() - 1, int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def local_sums(c, cu_seqlens, n_rows, t_max, seg, origin=0):
    """The prefix sums as float32 offsets from the start of their ``seg``-long tile, times log2(e): the
    kernels add one float64 offset per tile to them instead of converting every float64 ``c_j``
    (float64 subtraction and conversion per score column cost up to 10% of the forward at D=128)."""
    out = torch.empty_like(c, dtype=torch.float32)  # same strides: the kernels index both alike
    H = c.shape[1]
    t = c.shape[-1] if cu_seqlens is None else t_max  # keys of the longest sequence
    grid = (triton.cdiv(max(t - origin, 0), seg) + 1, n_rows * H)
    _local_sums_kernel[grid](c, cu_seqlens, out, c.stride(0), c.stride(1), H, c.shape[-1], origin,
                             IS_VARLEN=cu_seqlens is not None, SEG=seg, num_warps=4)
    return out


FIXED_BOUND_GAP = 80.0


def fixed_bound_softmax(dtype: torch.dtype) -> bool:
    """Whether the forward may run the softmax of a query tile against a fixed bound (see the module
    docstring). Not for float16: its probabilities, as small as 2^-GAP, would leave float16's range
    (bfloat16 and float32 share float32's exponent). ``FOX_KERNEL_FIXED_BOUND=0`` keeps the online
    softmax everywhere (for comparison)."""
    return dtype != torch.float16 and os.environ.get("FOX_KERNEL_FIXED_BOUND", "1") != "0"


def fixed_bound_rows(head_dim: int) -> int:
    """How the forward's fixed softmax bound is taken: 0 one bound per query tile (folded into the
    column term), 1 one per row (one more tile op), 2 per tile where it is tight enough, else per row
    (a run-time branch per tile). A tile-wide bound fails when the gates decay by more than the gap
    across the tile; a row's own bound only when its norms are large. Measured on an H200 (T=16k,
    bf16, vs cuDNN, mean log f -0.03 / -0.24 / -0.58): D=128 tile 0.853 / 0.709 / 0.776, per row 0.798 /
    0.799 / 0.802, both 0.865 / 0.867 / 0.873; D=64 tile 0.856 / 0.902 / 0.900, both 0.811 / 0.872 / 0.975
    (the branch costs D=64's 4-warp tiles 5% when not taken). ``FOX_KERNEL_FIXED_ROWS`` overrides."""
    env = os.environ.get("FOX_KERNEL_FIXED_ROWS")
    if env is None:
        return 2 if head_dim > 64 else 0
    if env not in ("0", "1", "2"):
        raise ValueError(f"FOX_KERNEL_FIXED_ROWS must be 0, 1 or 2, got {env!r}")
    return int(env)


def triton_forward(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale, threshold, auto_log_eps=None, window=0):
    """(out, lse, threshold): with ``auto_log_eps`` the pruning bound is taken per query tile from the
    tile's own query norms (see _fwd_kernel) and the returned (rows, H) threshold is the per-head
    "auto" bound for the backward; otherwise ``threshold`` is returned as given. ``window``: the sliding
    window (0: none), run by the Triton kernels only."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    c = triton_prefix_sums(log_fgate, seq_start)
    # With pruning, the Triton forward takes each query tile's own "auto" bound (tighter than the Gluon
    # forward's per-head one) and needs fewer launches: at D=64 it stays there past GLUON_FWD_MAX_KEYS (the
    # pruned 125M FoX (Pro) step ran 12% slower with the Gluon forward on an H100:
    # fox-train/benchmarks/forward-ab-h100-s16-125m.json).
    fixed = fixed_bound_softmax(q.dtype)
    long_ok = fixed and threshold is None and auto_log_eps is None
    if not window and use_gluon_forward(q, k, seq_start, cu_seqlens, long_ok):
        return _gluon_forward(q, k, v, c, sm_scale, threshold, auto_log_eps, fixed)
    auto = auto_log_eps is not None
    kmax2 = key_sq_norms(k, cu_seqlens) if fixed or auto else None
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    n_rows, t_max = _grid_rows(cu_seqlens, B, Tq)
    if auto:
        threshold = torch.full((n_rows, H), float("inf"), dtype=torch.float32, device=q.device)
    cfg = _config("fwd", D, q.dtype, q.device)
    grid, heads_first = _grid("fwd", n_rows * H, triton.cdiv(t_max, cfg["BLOCK_M"]), D, H // Hkv)
    use_tma = cu_seqlens is None and _use_tma(k, v)
    k_desc, v_desc = _descriptors((k, v), cfg["BLOCK_N"], cfg, use_tma)
    # per query tile: 1 where the fixed bound was too loose and the online pass must run it
    online = torch.empty(grid[0] * grid[1] if fixed else 0, dtype=torch.int8, device=q.device)
    args = (q, k, v, c, local_sums(c, cu_seqlens, n_rows, t_max, cfg["BLOCK_N"]), seq_start, cu_seqlens, threshold,
            out, lse, k_desc, v_desc, kmax2, online,
            *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(out),
            c.stride(0), c.stride(1), lse.stride(0), lse.stride(1),
            H, Tq, Tk, D, sm_scale * LOG2E, window)
    flags = dict(HAS_WINDOW=window > 0, GROUP=H // Hkv, IS_VARLEN=cu_seqlens is not None, HAS_SEQ_START=seq_start is not None,
                 HAS_THRESH=threshold is not None, EVEN_D=cfg["BLOCK_D"] == D, PRECISION=_precision(q.dtype),
                 USE_TMA=use_tma, SCAN=_scan(), HEADS_FIRST=heads_first, GAP=FIXED_BOUND_GAP,
                 ROWS=fixed_bound_rows(D), AUTO=auto, LOG_EPS=float(auto_log_eps or 0.0), **cfg)
    kernel = _kernel(_fwd_kernel, Tq, Tk)
    for mode in ((1, 2) if fixed else (0,)):
        kernel[grid](*args, MODE=mode, **flags)
    return out, lse, threshold


def _gluon_forward(q, k, v, c, sm_scale, threshold, auto_log_eps, fixed):
    """The Gluon forward; with ``fixed`` (``fixed_bound_softmax``) its consumers run a fixed softmax bound
    where one is tight enough, else the online softmax. With "auto" pruning it takes the per-head
    bound (one read of q and k) rather than the Triton forward's per-tile one, and prunes through the
    table of kept key ranges, as the dQ pass does."""
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    if auto_log_eps is not None:
        threshold = auto_threshold(q, k, sm_scale, Tk, auto_log_eps)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    blocks = gluon_blocks(D, "fwd-fixed" if fixed else "fwd")
    ranges = _kept_ranges(c, None, None, threshold, B, H, Tq, Tk, Tq, blocks, True)
    kmax2 = key_sq_norms(k, None) if fixed else None
    gluon_forward(q, k, v, c, local_sums(c, None, B, Tk, blocks["BLOCK_N"]), out, lse, sm_scale, ranges,
                  kmax2, FIXED_BOUND_GAP)
    return out, lse, threshold


def _kept_ranges(c, seq_start, cu_seqlens, threshold, n_rows, H, Tq, Tk, t_max, cfg, keys_of_queries, window=0):
    if threshold is None:
        return None
    n_blocks = triton.cdiv(t_max, cfg["BLOCK_M"] if keys_of_queries else cfg["BLOCK_N"])
    out = torch.empty(n_rows * H, n_blocks, dtype=torch.int32, device=c.device)
    _kept_range_kernel[(n_rows * H, n_blocks)](
        c, seq_start, cu_seqlens, threshold, out, c.stride(0), c.stride(1), H, Tq, Tk, window,
        KEYS_OF_QUERIES=keys_of_queries, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        IS_VARLEN=cu_seqlens is not None, HAS_SEQ_START=seq_start is not None, SCAN=_scan(),
        HAS_WINDOW=window > 0, num_warps=1,
    )
    return out


BACKWARD_MODES = ("fused", "two-pass")


def fused_backward() -> bool:
    """Whether the backward runs as one pass that adds dQ in with atomics (not bit-reproducible) or as
    two passes (dK/dV, then dQ) that own every output and give identical gradients run to run.

    ``FOX_KERNEL_BACKWARD=fused|two-pass`` chooses; ``torch.use_deterministic_algorithms(True)`` forces
    the two-pass form. Two passes are the default: on an H200 (Triton 3.6, T=16k, H*D=2048, bf16) the
    Triton one-pass backward, best of seven tiles, took 12.35 ms vs 11.78 ms at D=64 (10.65 ms since the
    dQ pass's 64x64 tiles) and 11.9 ms vs 7.9 ms at D=128 (fused-backward-tiles-h200-s9.json). Where the
    Gluon kernels run, the one pass is the Gluon dK/dV kernel adding dQ in with TMA reductions (D=64;
    D=128 keeps two passes): on an H100 (results-h100-s15-quick.json, T=16k, D=64) 3.08 vs 2.88-2.91 ms
    at H=12, 5.94-5.99 vs 5.81-5.86 ms at H=24, 2.53-2.56 vs 2.31 ms at T=8k with GQA 32/8."""
    mode = os.environ.get("FOX_KERNEL_BACKWARD", "two-pass")
    if mode not in BACKWARD_MODES:
        raise ValueError(f"FOX_KERNEL_BACKWARD must be one of {BACKWARD_MODES}, got {mode!r}")
    return mode == "fused" and not torch.are_deterministic_algorithms_enabled()


def triton_backward(do, q, k, v, log_fgate, out, lse, seq_start, cu_seqlens, sm_scale, threshold, window=0):
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if do.stride(-1) != 1:
        do = do.contiguous()
    c = triton_prefix_sums(log_fgate, seq_start)
    delta = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    _delta_kernel[(triton.cdiv(Tq, 64), B * H)](
        out, do, delta, *_strides3(out), *_strides3(do), H, Tq, D, BLOCK_M=64, BLOCK_D=block_d,
    )
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    gluon = not window and use_gluon(q, seq_start, cu_seqlens)
    # the Gluon one-pass backward holds float32 dQ tiles in shared memory: D=64 only
    fused = fused_backward() and (not gluon or D in GLUON_ONE_PASS_DIMS)
    # the column term of dc: the Gluon dK/dV pass writes every key's, the Triton passes may skip some
    dc = (torch.empty if gluon else torch.zeros)(B, H, Tk, dtype=torch.float32, device=q.device)
    n_rows, t_max = _grid_rows(cu_seqlens, B, Tk)
    flags = dict(
        GROUP=H // Hkv, IS_VARLEN=cu_seqlens is not None, HAS_SEQ_START=seq_start is not None,
        HAS_THRESH=threshold is not None, EVEN_D=max(16, triton.next_power_of_2(D)) == D, PRECISION=_precision(q.dtype),
        HAS_WINDOW=window > 0,
    )
    use_tma = cu_seqlens is None and _use_tma(q, k, v, do)
    flags.update(USE_TMA=use_tma, SCAN=_scan())
    cfg = _config("fused" if fused else "dkdv", D, q.dtype, q.device)
    triton_fused = fused and not gluon
    # the row term of dc: summed into with atomics (Triton one pass), or written once per row by the dQ
    # pass or the Gluon one pass
    dc_row = (torch.zeros if triton_fused else torch.empty)(B, H, Tq, dtype=torch.float32, device=q.device)
    if triton_fused:  # float32 dQ as (B, H, D, Tq), rows padded to 16 bytes for the TMA reductions
        dq_acc = torch.zeros(B, H, D, triton.cdiv(Tq, 4) * 4, dtype=torch.float32, device=q.device)
        dq_desc = dq_acc
        if use_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            dq_desc = TensorDescriptor(dq_acc, [B, H, D, Tq], list(dq_acc.stride()),
                                       [1, 1, cfg["BLOCK_D"], cfg["BLOCK_M"]])
    else:
        dq_acc = dq_desc = dc_row  # not touched
    if gluon:
        # query tiles of the dK/dV pass start at Tk - Tq + multiples of BLOCK_M
        blocks = gluon_blocks(D)
        clq = local_sums(c, cu_seqlens, n_rows, t_max, blocks["BLOCK_M"], (Tk - Tq) % blocks["BLOCK_M"])
        ranges = _kept_ranges(c, seq_start, cu_seqlens, threshold, n_rows, H, Tq, Tk, t_max, blocks, False)
        gluon_dkdv(q, k, v, do, c, clq, lse, delta, dk, dv, dc, sm_scale, ranges,
                   dq if fused else None, dc_row if fused else None)
    else:
        _dkdv_pass(q, k, v, c, seq_start, cu_seqlens, threshold, do, lse, delta, dk, dv, dc, dq_acc, dc_row, dq_desc,
                   cfg, flags, use_tma, fused, n_rows, t_max, sm_scale, window)
    if triton_fused:
        torch.mul(dq_acc[..., :Tq].permute(0, 3, 1, 2), sm_scale, out=dq)
    elif fused:
        pass  # the Gluon one pass wrote dq and dc_row
    elif gluon:
        blocks = gluon_blocks(D, "dq")
        ranges = _kept_ranges(c, seq_start, cu_seqlens, threshold, n_rows, H, Tq, Tk, t_max, blocks, True)
        cl = local_sums(c, cu_seqlens, n_rows, t_max, blocks["BLOCK_N"])
        gluon_dq(q, k, v, do, c, cl, lse, delta, dq, dc_row, sm_scale, ranges)
    else:
        _dq_pass(q, k, v, c, seq_start, cu_seqlens, threshold, do, lse, delta, dq, dc_row, use_tma, flags,
                 n_rows, t_max, sm_scale, window)
    # The row term of dc (d score_ij / d c_i = 1) vanishes in exact arithmetic but cancels the rounding
    # of delta (computed from the stored, rounded output); without it that error piles up in the suffix sums.
    if cu_seqlens is None:
        return dq, dk, dv, triton_gate_grad(dc, dc_row, seq_start)
    dc[..., Tk - Tq :] += dc_row
    return dq, dk, dv, gate_grad_from_dc(dc, seq_start, cu_seqlens)


def _dkdv_pass(q, k, v, c, seq_start, cu_seqlens, threshold, do, lse, delta, dk, dv, dc, dq_acc, dc_row, dq_desc,
               cfg, flags, use_tma, fused, n_rows, t_max, sm_scale, window):
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    q_desc, do_desc = _descriptors((q, do), cfg["BLOCK_M"], cfg, use_tma)
    # query tiles of the dK/dV pass start at Tk - Tq + multiples of BLOCK_M
    ranges = _kept_ranges(c, seq_start, cu_seqlens, threshold, n_rows, H, Tq, Tk, t_max, cfg, False, window)
    clq = local_sums(c, cu_seqlens, n_rows, t_max, cfg["BLOCK_M"], (Tk - Tq) % cfg["BLOCK_M"])
    grid, heads_first = _grid("dkdv", n_rows * Hkv, triton.cdiv(t_max, cfg["BLOCK_N"]), D, H // Hkv)
    _kernel(_dkdv_kernel, Tq, Tk)[grid](
        q, k, v, c, clq, seq_start, cu_seqlens, ranges, do, lse, delta, dk, dv, dc, q_desc, do_desc,
        dq_acc, dc_row, dq_desc,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do), *_strides3(dk), *_strides3(dv),
        c.stride(0), c.stride(1), lse.stride(0), lse.stride(1), *_strides3(dq_acc),
        H, Hkv, Tq, Tk, D, sm_scale, sm_scale * LOG2E, window, HEADS_FIRST=heads_first, FUSED_DQ=fused, **flags,
        **cfg,
    )


def _dq_pass(q, k, v, c, seq_start, cu_seqlens, threshold, do, lse, delta, dq, dc_row, use_tma, flags, n_rows,
             t_max, sm_scale, window):
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    cfg = _config("dq", D, q.dtype, q.device)
    k_desc, v_desc = _descriptors((k, v), cfg["BLOCK_N"], cfg, use_tma)
    ranges = _kept_ranges(c, seq_start, cu_seqlens, threshold, n_rows, H, Tq, Tk, t_max, cfg, True, window)
    grid, heads_first = _grid("dq", n_rows * H, triton.cdiv(t_max, cfg["BLOCK_M"]))
    _kernel(_dq_kernel, Tq, Tk)[grid](
        q, k, v, c, local_sums(c, cu_seqlens, n_rows, t_max, cfg["BLOCK_N"]), seq_start, cu_seqlens, ranges, do, lse, delta, dq, dc_row, k_desc, v_desc,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(do), *_strides3(dq),
        c.stride(0), c.stride(1), lse.stride(0), lse.stride(1),
        H, Tq, Tk, D, sm_scale, sm_scale * LOG2E, window, HEADS_FIRST=heads_first, **flags, **cfg,
    )
