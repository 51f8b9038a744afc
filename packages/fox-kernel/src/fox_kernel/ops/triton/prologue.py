"""The Gluon kernels' small inputs from few launches: the forward's prefix sums and q/k norms from one, its
"auto" bound, local sums and kept ranges from a second; the backward's row dots ``delta``, the tile-local
sums of the dK/dV and the dQ pass and both passes' kept ranges from one.

Separately these are up to ten launches (``sums.prefix_sums``, ``norms.max_sq_row_norms`` with the fill of
its outputs, ``pruning.auto_threshold``, ``ranges.kept_ranges``, ``sums.local_sums``; ``sums.delta``,
``sums.local_sums`` twice, ``ranges.kept_ranges_pair``), each a few microseconds of GPU time and ~20-30 us
of host time, which a small model's training step at long context waits on. Here one grid holds several
parts: the grid's block axis lists each part's blocks after the previous part's (the other axis is the
(row, head)), and every program runs the same code as its part's own kernel (``sums.prefix_sums_row``,
``sums.local_sums_segment``, ``ranges.kept_range_block``, ``sums.delta_rows``), so the outputs are the same
bit for bit. The forward's norms are partial maxima (``norms.max_sq_norm_part``) that their readers reduce,
so they need no zeroed buffer (no fill launch); their maxima are ``norms.max_sq_row_norms``'s bit for bit.
Fixed-length batches without ``seq_start`` or a window (the calls the Gluon kernels run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_kernel.ops import zero_flags
from fox_kernel.ops.triton import launch
from fox_kernel.ops.triton.norms import NORM_PARTS, NORM_ROWS, largest_part, max_sq_norm_part, norm_parts
from fox_kernel.ops.triton.ranges import block_and_row, kept_range_block, range_tables, table_columns
from fox_kernel.ops.triton.sums import (
    DELTA_ROWS,
    delta_rows,
    local_sums_grid,
    local_sums_segment,
    prefix_sums_row,
    scan_block,
)
from fox_kernel.pruning import head_bound


def _grid(blocks: int, programs: int):
    """(grid, BLOCKS_FIRST) of ``blocks`` blocks for each of ``programs`` (row, head) pairs: the larger count
    on grid axis 0 (up to 2^31 - 1 programs), the other on axis 1 (up to 65,535)."""
    if max(min(blocks, programs), 1) > launch.MAX_GRID_YZ:
        raise ValueError(f"{programs} (row, head) pairs of {blocks} blocks each pass the launch grid's limits")
    return ((blocks, programs), True) if blocks >= programs else ((programs, blocks), False)


@triton.jit
def _backward_prologue_kernel(O, DO, DELTA, C, CLQ, CL, THRESH, KEYS, QUERIES, o_strides, do_strides, c_strides,
                              H, Tq, Tk, D, clq_origin, N_DELTA, N_CLQ, N_CL, N_KEYS, N_QUERIES,
                              BLOCK_D: tl.constexpr, DELTA_M: tl.constexpr, CLQ_SEG: tl.constexpr,
                              CL_SEG: tl.constexpr, HAS_CL: tl.constexpr, HAS_RANGES: tl.constexpr,
                              KEY_M: tl.constexpr, KEY_N: tl.constexpr, QUERY_M: tl.constexpr,
                              QUERY_N: tl.constexpr, SCAN: tl.constexpr, BLOCKS_FIRST: tl.constexpr):
    """Blocks [0, N_DELTA): delta; then N_CLQ segments of CLQ (CLQ_SEG long from ``clq_origin``); with HAS_CL
    N_CL segments of CL (CL_SEG long from 0); with HAS_RANGES the N_KEYS + N_QUERIES blocks of the kept
    ranges (see ``_grid``)."""
    stride_ob, stride_ot, stride_oh = o_strides
    stride_db, stride_dt, stride_dh = do_strides
    stride_cb, stride_ch = c_strides
    pid, pid_bh = block_and_row(BLOCKS_FIRST)
    if pid < N_DELTA:
        delta_rows(O, DO, DELTA, stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh, pid, pid_bh, H, Tq,
                   D, DELTA_M, BLOCK_D)
    elif pid < N_DELTA + N_CLQ:
        local_sums_segment(C, None, CLQ, stride_cb, stride_ch, pid - N_DELTA, pid_bh, H, Tk, clq_origin, False,
                           CLQ_SEG)
    elif pid < N_DELTA + N_CLQ + N_CL:
        if HAS_CL:
            local_sums_segment(C, None, CL, stride_cb, stride_ch, pid - N_DELTA - N_CLQ, pid_bh, H, Tk, 0, False,
                               CL_SEG)
    else:
        if HAS_RANGES:
            kept_range_block(C, None, None, tl.load(THRESH + pid_bh), KEYS, QUERIES, stride_cb, stride_ch,
                             pid - N_DELTA - N_CLQ - N_CL, pid_bh, H, Tq, Tk, 0, N_KEYS, N_QUERIES, KEY_M, KEY_N,
                             QUERY_M, QUERY_N, False, False, SCAN, False)


def backward_prologue(out, do, c, threshold, Tk: int, clq_seg: int, clq_origin: int, cl_seg: int | None,
                      key_blocks: dict, query_blocks: dict | None):
    """(delta (B, H, Tq), clq, cl, key blocks' ranges, query blocks' ranges), as

        sums.delta(out, do), sums.local_sums(c, None, B, Tk, clq_seg, clq_origin),
        sums.local_sums(c, None, B, Tk, cl_seg), ranges.kept_ranges_pair(c, None, None, threshold, B, H, Tq,
        Tk, Tk, key_blocks, query_blocks)

    give them, from one launch. ``cl_seg`` None: no ``cl`` (None); ``query_blocks`` None: no query table;
    ``threshold`` None: no tables. ``out`` and ``do`` (B, Tq, H, D); ``c`` (B, H, Tk) float64."""
    B, Tq, H, D = out.shape
    row_dots = torch.empty(B, H, Tq, dtype=torch.float32, device=out.device)
    clq = torch.empty_like(c, dtype=torch.float32)  # same strides as c: the kernels index both alike
    cl = None if cl_seg is None else torch.empty_like(c, dtype=torch.float32)
    keys, queries = (None, None) if threshold is None else range_tables(c.device, B * H, Tk, key_blocks, query_blocks)
    n_delta = launch.cdiv(Tq, DELTA_ROWS)
    n_clq = local_sums_grid(Tk, clq_seg, clq_origin)
    n_cl = 0 if cl_seg is None else local_sums_grid(Tk, cl_seg)
    n_keys, n_queries = table_columns(keys), table_columns(queries)
    qb = query_blocks or key_blocks
    grid, blocks_first = _grid(n_delta + n_clq + n_cl + n_keys + n_queries, B * H)
    if B * H:
        launch.run(_backward_prologue_kernel, grid,
            out, do, row_dots, c, clq, cl, threshold, keys if keys is not None else queries,
            queries if queries is not None else keys, launch.strides(out), launch.strides(do), launch.strides(c, 2),
            H, Tq, Tk, D, clq_origin, n_delta, n_clq, n_cl, n_keys, n_queries,
            BLOCK_D=launch.block_d(D), DELTA_M=DELTA_ROWS, CLQ_SEG=clq_seg, CL_SEG=cl_seg or 1, HAS_CL=cl is not None,
            HAS_RANGES=keys is not None or queries is not None, KEY_M=key_blocks["BLOCK_M"],
            KEY_N=key_blocks["BLOCK_N"], QUERY_M=qb["BLOCK_M"], QUERY_N=qb["BLOCK_N"], SCAN=launch.scan(),
            BLOCKS_FIRST=blocks_first, num_warps=4,
        )
    return row_dots, clq, cl, keys, queries


@triton.jit
def _forward_sums_kernel(LF, C, Z, FLAG, X, Y, PARTS_X, PARTS_Y, COUNTER, lf_strides, x_strides, y_strides, H, T,
                         HX, HY, TX, TY, D, N_SUMS, n_parts, ZEROS: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_NORMS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Programs [0, N_SUMS): the prefix sums of one (row, head) each; with HAS_NORMS the rest: the partial
    maxima of the squared row norms of X and Y, one (row, head) x part each (heads fastest). Program 0 also
    sets COUNTER (if given) to 0."""
    stride_lb, stride_lt, stride_lh = lf_strides
    pid = tl.program_id(0)
    if COUNTER is not None:  # noqa: SIM102 (a compile-time test around a run-time one)
        if pid == 0:
            tl.store(COUNTER, 0)
    if pid < N_SUMS:
        prefix_sums_row(LF, None, C, Z, FLAG, stride_lb, stride_lt, stride_lh, pid, H, T, False, ZEROS, BLOCK)
    else:
        if HAS_NORMS:
            sxb, sxt, sxh = x_strides
            syb, syt, syh = y_strides
            r = pid - N_SUMS
            n_bh = (N_SUMS // H) * (HX + HY)
            max_sq_norm_part(X, Y, PARTS_X, PARTS_Y, sxb, sxt, sxh, syb, syt, syh, r % n_bh, r // n_bh, n_parts, HX,
                             HY, TX, TY, D, BLOCK_T, BLOCK_D)


def forward_sums(log_fgate, zeros: bool, x=None, y=None, counter=None):
    """(c, z, ticket, x's norms, y's norms) from one launch: c, z and the ticket as
    ``sums.prefix_sums(log_fgate, None, zeros)`` gives them (z and the ticket None without ``zeros``); given
    x (B, Tx, Hx, D) and y (B, Ty, Hy, D) with log_fgate's batch, the partial maxima of their squared row
    norms (``norms.norm_parts``: (B, H, n_parts), whose maximum over the last axis is
    ``norms.max_sq_row_norms``'s; x's alone without y, y's None; both None without x), which need no fill
    launch. ``counter``: a one-element int32 tensor the same launch sets to 0 (the Gluon forward's tile
    counter, without a fill launch of its own)."""
    B, T, H = log_fgate.shape
    c = torch.empty(B, H, T, dtype=torch.float64, device=log_fgate.device)
    z = torch.empty(B, H, T, dtype=torch.int32, device=log_fgate.device) if zeros else None
    seen = zero_flags.ticket(log_fgate.device) if zeros else None
    px, py, n_parts = norm_parts(x, y) if x is not None else (None, None, 0)
    y_ = y if y is not None else x  # stands in for a missing y (no program reads it)
    n_norms = B * (_dim(x, 2) + _dim(y, 2)) * n_parts  # (row, head) pairs of x and y times the parts
    if B * H and T:
        launch.run(_forward_sums_kernel, (B * H + n_norms,),
            log_fgate, c, z, seen and seen.flag, x, y_, px, py if py is not None else px, counter,
            launch.strides(log_fgate), _strides(x), _strides(y_), H, T, _dim(x, 2), _dim(y, 2), _dim(x, 1),
            _dim(y, 1), _dim(x, 3), B * H, n_parts, ZEROS=zeros, BLOCK=scan_block(T), HAS_NORMS=x is not None,
            BLOCK_T=NORM_ROWS, BLOCK_D=launch.block_d(_dim(x, 3)), num_warps=4,
        )
    elif counter is not None:
        counter.zero_()
    if seen is not None:
        seen.launched()
    return c, z, seen, px, py


def _strides(x):
    return (0, 0, 0) if x is None else launch.strides(x)


def _dim(x, i: int) -> int:
    return 0 if x is None else x.shape[i]


@triton.jit
def _forward_tables_kernel(C, CL, THRESH, QN2, KN2, KMAX2, RANGES, c_strides, H, GROUP, Tq, Tk, sm_scale, offset,
                           n_parts, N_CL, N_QUERIES, CL_SEG: tl.constexpr, HAS_RANGES: tl.constexpr,
                           AUTO: tl.constexpr, PARTS: tl.constexpr, QUERY_M: tl.constexpr, QUERY_N: tl.constexpr,
                           SCAN: tl.constexpr, BLOCKS_FIRST: tl.constexpr):
    """Blocks [0, N_CL): segments of CL (CL_SEG long), and where KMAX2 is given the first block of the
    first head of each key/value head's group writes its largest squared key norm there (the largest of
    KN2's partial maxima, ``norms.max_sq_norm_part``'s); with HAS_RANGES the N_QUERIES blocks of the kept
    ranges of the query blocks, their threshold read from THRESH or, with AUTO, the "auto" bound
    (``pruning.head_bound`` of the largest of QN2's and KN2's partial maxima, as ``pruning.auto_threshold``)
    written there by each (row, head)'s first range block."""
    stride_cb, stride_ch = c_strides
    pid, pid_bh = block_and_row(BLOCKS_FIRST)
    if pid < N_CL:
        local_sums_segment(C, None, CL, stride_cb, stride_ch, pid, pid_bh, H, Tk, 0, False, CL_SEG)
        if KMAX2 is not None:  # noqa: SIM102 (a compile-time test around a run-time one)
            if pid == 0 and pid_bh % GROUP == 0:
                kv = pid_bh // GROUP  # (row, key/value head): b * (H // GROUP) + h // GROUP
                tl.store(KMAX2 + kv, largest_part(KN2, kv, n_parts, PARTS))
    else:
        if HAS_RANGES:
            if AUTO:
                b = pid_bh // H
                h = pid_bh % H
                delta = head_bound(largest_part(QN2, pid_bh, n_parts, PARTS),
                                   largest_part(KN2, b * (H // GROUP) + h // GROUP, n_parts, PARTS), sm_scale, offset)
                if pid == N_CL:
                    tl.store(THRESH + pid_bh, delta)
            else:
                delta = tl.load(THRESH + pid_bh)
            kept_range_block(C, None, None, delta, RANGES, RANGES, stride_cb, stride_ch, pid - N_CL, pid_bh, H, Tq, Tk,
                             0, 0, N_QUERIES, QUERY_M, QUERY_N, QUERY_M, QUERY_N, False, False, SCAN, False)


def forward_tables(c, threshold, qn2, kn2, sm_scale: float, auto_offset: float | None, Tq: int, blocks: dict):
    """(threshold, the first kept key of each query block, cl, kmax2), as the Gluon forward's

        pruning.auto_threshold's bound from the squared norms (given ``auto_offset``, ln eps - ln Tk),
        ranges.kept_ranges(c, None, None, threshold, B, H, Tq, Tk, Tq, blocks, True),
        sums.local_sums(c, None, B, Tk, blocks["BLOCK_N"]),
        norms.max_sq_row_norms(k) (given ``kn2``, else None)

    give them, from one launch. ``qn2`` (B, H, n_parts), ``kn2`` (B, Hkv, n_parts): ``forward_sums``'s
    partial maxima of the squared q and k norms (``qn2`` with ``auto_offset`` only); ``threshold`` (B, H)
    otherwise, or None (no ranges); ``blocks`` the forward's tiles. ``c`` (B, H, Tk) float64. The largest
    key norms come out reduced here, once per (row, key/value head), rather than in the attention
    kernel's every tile."""
    B, H, Tk = c.shape
    auto = auto_offset is not None
    if auto:
        threshold = torch.empty(B, H, dtype=torch.float32, device=c.device)
    cl = torch.empty_like(c, dtype=torch.float32)  # same strides as c: the kernels index both alike
    kmax2 = None if kn2 is None else torch.empty(kn2.shape[:2], dtype=torch.float32, device=c.device)
    ranges = None if threshold is None else range_tables(c.device, B * H, Tq, None, blocks)[1]
    n_cl = local_sums_grid(Tk, blocks["BLOCK_N"])
    n_queries = table_columns(ranges)
    grid, blocks_first = _grid(n_cl + n_queries, B * H)
    if B * H:
        launch.run(_forward_tables_kernel, grid,
            c, cl, threshold, qn2, kn2, kmax2, ranges, launch.strides(c, 2), H, 1 if kn2 is None else H // kn2.shape[1],
            Tq, Tk, float(sm_scale), float(auto_offset or 0.0), 1 if kn2 is None else kn2.shape[2], n_cl, n_queries,
            CL_SEG=blocks["BLOCK_N"], HAS_RANGES=ranges is not None, AUTO=auto, PARTS=NORM_PARTS,
            QUERY_M=blocks["BLOCK_M"], QUERY_N=blocks["BLOCK_N"], SCAN=launch.scan(), BLOCKS_FIRST=blocks_first,
            num_warps=4,
        )
    return threshold, ranges, cl, kmax2
