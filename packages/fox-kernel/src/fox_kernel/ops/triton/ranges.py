"""Which blocks a program visits: the causal and window ranges of a query or key block, and the pruned
ranges (blocks whose decay keeps them under the ``adaptive_threshold`` bound), searched in place or found
up front for the backward by ``kept_ranges``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_kernel.ops.triton import launch
from fox_kernel.ops.triton.common import sequence_bounds


@triton.jit
def key_range(first, s0, t_k, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key blocks of the query tile whose first row sits at key position ``first``: [lo, mid) fully
    visible (with a window: [lo, window_split) partly outside it), [mid, hi) on the diagonal."""
    lo = (s0 // BLOCK_N) * BLOCK_N
    mid = tl.maximum((tl.minimum(first, t_k) // BLOCK_N) * BLOCK_N, lo)
    hi = tl.minimum(first + BLOCK_M, t_k)
    if HAS_WINDOW:  # the first key any row of the tile sees is first - window + 1
        lo = tl.minimum(tl.maximum((tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N, lo), mid)
    return lo, mid, hi


@triton.jit
def window_split(lo, mid, first, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """First key block of [lo, mid) that every row of the query tile starting at ``first`` sees whole:
    keys from ``first + BLOCK_M - window`` on lie inside every row's window."""
    split = tl.cdiv(tl.maximum(first + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N
    return tl.minimum(tl.maximum(split, lo), mid)


@triton.jit
def first_keys(Z, z_base, bos, pos_m, mask_m, window, HAS_WINDOW: tl.constexpr, ZEROS: tl.constexpr):
    """The first key each query row at key position ``pos_m`` sees (int32, 0 for all): past the window's
    edge, and with ZEROS at or after the row's last gate of exactly 0 (``Z`` at ``z_base``, the sequence's
    first position; Z counts positions from the packed row's first, ``bos`` before the sequence's)."""
    lower = tl.zeros(pos_m.shape, dtype=tl.int32)
    if HAS_WINDOW:
        lower = tl.maximum(pos_m - window + 1, 0)
    if ZEROS:
        zl = tl.load(Z + z_base + pos_m, mask=mask_m, other=0) - bos.to(tl.int32)
        lower = tl.maximum(lower, zl)
    return lower


@triton.jit
def last_zero_gate(Z, z_base, bos, last):
    """The last gate of exactly 0 at or before position ``last``, counted from the sequence's first
    position (``Z`` as in ``first_keys``); 0 or less for none after that first position."""
    return tl.load(Z + z_base + last) - bos.to(tl.int32)


@triton.jit
def lower_split(lower_m, mask_m, lo, mid, t_k, BLOCK_N: tl.constexpr):
    """(lo, split) for a query tile whose rows see keys from ``lower_m`` on: key blocks wholly before
    every row's first key are skipped; [lo, split) holds the blocks some row sees only in part."""
    first = tl.min(tl.where(mask_m, lower_m, t_k), 0)
    last = tl.max(tl.where(mask_m, lower_m, 0), 0)
    lo = tl.minimum(tl.maximum(lo, (first // BLOCK_N) * BLOCK_N), mid)
    split = tl.minimum(tl.maximum(tl.cdiv(last, BLOCK_N) * BLOCK_N, lo), mid)
    return lo, split


@triton.jit
def query_range(pid_n, shift, s0, t_q, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
def query_window_split(pid_n, shift, window, m_mid, m_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """End of the query blocks in [m_mid, m_hi) whose windows hold all of key block ``pid_n``: a block
    starting at m does when its last row, at key position m + BLOCK_M - 1 + shift, is before the block's
    first key + window."""
    split = (tl.maximum(pid_n * BLOCK_N + window - shift, 0) // BLOCK_M) * BLOCK_M
    return tl.maximum(tl.minimum(split, m_hi), m_mid)


@triton.jit
def first_kept_key_block(c_ptr, c_top, delta, lo, hi, BLOCK_N: tl.constexpr, SCAN: tl.constexpr):
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
def last_kept_query_block(c_ptr, c_bottom, delta, shift, lo, hi, BLOCK_M: tl.constexpr, SCAN: tl.constexpr):
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
def block_and_row(BLOCKS_FIRST: tl.constexpr):
    """(block, (row, head)) of this program: blocks on grid axis 0 with BLOCKS_FIRST, else on axis 1."""
    if BLOCKS_FIRST:
        return tl.program_id(0), tl.program_id(1)
    return tl.program_id(1), tl.program_id(0)


@triton.jit
def kept_range_block(C, SEQ_START, CU, delta, OUT_KEYS, OUT_QUERIES, stride_cb, stride_ch, pid, pid_bh, H, Tq, Tk,
                     WINDOW, N_KEYS, N_QUERIES, KEY_M: tl.constexpr, KEY_N: tl.constexpr, QUERY_M: tl.constexpr,
                     QUERY_N: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr,
                     SCAN: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Pruned range of block ``pid`` of (row, head) ``pid_bh``, one int per (row, head, block), found once up
    front for the backward passes (and the Gluon forward) so the kernels only load them (searching inside
    them cost registers and time). Blocks [0, N_KEYS): the end of the kept queries of each key block
    (dK/dV, tiles KEY_M x KEY_N) into OUT_KEYS; blocks [N_KEYS, N_KEYS + N_QUERIES): the first kept key of
    each query block (dQ, tiles QUERY_M x QUERY_N) into OUT_QUERIES. ``delta``: the (row, head)'s
    threshold."""
    b = pid_bh // H
    h = pid_bh % H
    row, bos, t_q, t_k, s0 = sequence_bounds(CU, SEQ_START, b, Tq, Tk, IS_VARLEN, HAS_SEQ_START)
    shift = t_k - t_q
    c_ptr = C + row * stride_cb + h * stride_ch + bos
    if pid < N_KEYS:
        if pid * KEY_N < t_k:
            m_lo, m_mid, m_hi = query_range(pid, shift, s0, t_q, WINDOW, KEY_M, KEY_N, HAS_WINDOW)
            c_bottom = tl.load(c_ptr + tl.minimum(pid * KEY_N + KEY_N, t_k) - 1)
            tl.store(OUT_KEYS + pid_bh.to(tl.int64) * N_KEYS + pid,
                     last_kept_query_block(c_ptr, c_bottom, delta, shift, m_mid, m_hi, KEY_M, SCAN))
    else:
        j = pid - N_KEYS
        if j * QUERY_M < t_q:
            first = j * QUERY_M + shift
            lo, mid, hi = key_range(first, s0, t_k, WINDOW, QUERY_M, QUERY_N, HAS_WINDOW)
            tl.store(OUT_QUERIES + pid_bh.to(tl.int64) * N_QUERIES + j,
                     first_kept_key_block(c_ptr, tl.load(c_ptr + first), delta, lo, mid, QUERY_N, SCAN))


@triton.jit
def _kept_range_kernel(C, SEQ_START, CU, THRESH, OUT_KEYS, OUT_QUERIES, c_strides, H, Tq, Tk, WINDOW, N_KEYS, N_QUERIES,
                       KEY_M: tl.constexpr, KEY_N: tl.constexpr, QUERY_M: tl.constexpr, QUERY_N: tl.constexpr,
                       IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr, SCAN: tl.constexpr,
                       HAS_WINDOW: tl.constexpr, BLOCKS_FIRST: tl.constexpr):
    """``kept_range_block`` per program: one per (row, head) and block, the blocks on the grid's second axis
    (the first with BLOCKS_FIRST). One launch fills both tables."""
    stride_cb, stride_ch = c_strides
    pid, pid_bh = block_and_row(BLOCKS_FIRST)
    kept_range_block(C, SEQ_START, CU, tl.load(THRESH + pid_bh), OUT_KEYS, OUT_QUERIES, stride_cb, stride_ch, pid,
                     pid_bh, H, Tq, Tk, WINDOW, N_KEYS, N_QUERIES, KEY_M, KEY_N, QUERY_M, QUERY_N, IS_VARLEN,
                     HAS_SEQ_START, SCAN, HAS_WINDOW)


def range_tables(device, programs: int, t_max: int, key_blocks, query_blocks):
    """The uninitialised (key blocks' table, query blocks' table) of ``kept_ranges_pair``: (programs, blocks)
    int32 each, None where its tiles are None or it has no block."""
    n_keys = 0 if key_blocks is None else launch.cdiv(t_max, key_blocks["BLOCK_N"])
    n_queries = 0 if query_blocks is None else launch.cdiv(t_max, query_blocks["BLOCK_M"])
    keys = torch.empty(programs, n_keys, dtype=torch.int32, device=device) if n_keys else None
    queries = torch.empty(programs, n_queries, dtype=torch.int32, device=device) if n_queries else None
    return keys, queries


def table_columns(table) -> int:
    """Blocks per (row, head) of a ``range_tables`` table (0 for None)."""
    return 0 if table is None else table.shape[1]


def kept_ranges_pair(c, seq_start, cu_seqlens, threshold, n_rows, H, Tq, Tk, t_max, key_blocks, query_blocks, window=0,
                     blocks_first=None):
    """(end of the kept queries of each key block with tiles ``key_blocks``, first kept key of each query
    block with tiles ``query_blocks``) as ``kept_ranges`` gives them, from one launch; a table whose tiles
    are None is not built (None). Both None without a threshold. ``blocks_first``: the blocks on the grid's
    first axis (None: there only when they pass the second axis's 65,535 programs, so that many packed
    sequences times heads keep the first axis)."""
    if threshold is None:
        return None, None
    keys, queries = range_tables(c.device, n_rows * H, t_max, key_blocks, query_blocks)
    n_keys, n_queries = table_columns(keys), table_columns(queries)
    kb, qb = key_blocks or query_blocks, query_blocks or key_blocks
    if blocks_first is None:
        blocks_first = n_keys + n_queries > launch.MAX_GRID_YZ
    if n_rows * H and n_keys + n_queries:
        grid = (n_keys + n_queries, n_rows * H) if blocks_first else (n_rows * H, n_keys + n_queries)
        launch.run(_kept_range_kernel, grid,
            c, seq_start, cu_seqlens, threshold, keys if keys is not None else queries,
            queries if queries is not None else keys, c.stride()[:2], H, Tq, Tk, window, n_keys, n_queries,
            KEY_M=kb["BLOCK_M"], KEY_N=kb["BLOCK_N"], QUERY_M=qb["BLOCK_M"], QUERY_N=qb["BLOCK_N"],
            IS_VARLEN=cu_seqlens is not None, HAS_SEQ_START=seq_start is not None, SCAN=launch.scan(),
            HAS_WINDOW=window > 0, BLOCKS_FIRST=blocks_first, num_warps=1,
        )
    return keys, queries


def kept_ranges(c, seq_start, cu_seqlens, threshold, n_rows, H, Tq, Tk, t_max, blocks, keys_of_queries, window=0):
    """The pruned ranges of a backward pass (or the Gluon forward) with tiles ``blocks`` (BLOCK_M, BLOCK_N):
    (rows * H, blocks) int32, the first kept key of each query block (``keys_of_queries``) or the end of
    the kept queries of each key block; None without a threshold."""
    keys, queries = kept_ranges_pair(c, seq_start, cu_seqlens, threshold, n_rows, H, Tq, Tk, t_max,
                                      None if keys_of_queries else blocks, blocks if keys_of_queries else None, window)
    return queries if keys_of_queries else keys
