"""The Gluon forward for Hopper (sm90), warp-specialised: output and log-sum-exp of query tiles of BLOCK_M
queries of one head, split between consumer warpgroups that each run their rows against a fixed softmax
bound where one is tight enough, else the online softmax (see ``common`` for the ring).

A program runs on each SM (``tiles.PERSISTENT``) and takes tiles until none is left: its loader takes
them in launch order (``common.tile_rank``) from an atomic counter, hands each one's number and Q to the
consumers through shared memory once they have released the last one's, and streams its key blocks, so
that the next tile's loads overlap the last one's end instead of waiting for a new program: 2-3% faster
than the forward with one program per tile that came before, at seven shapes on an H200
(benchmarks/persistent-fwd-trees-ab-h200-2026-11-29.json). The same for the two backward passes was level
with their one program per tile (0.985-1.011x forward+backward, persistent-bwd-trees-ab-h200-2026-11-29.json)
and is not kept.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mbarrier as ampere_mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fox_kernel.ops.constants import LN2, LOG2E
from fox_kernel.ops.gluon.common import (
    biased_scores,
    block_seen,
    kept_key_range,
    kv_load_tile,
    kv_ring,
    query_tile,
    thread_barrier,
    tma_load,
    wgmma_layout,
    window_mask,
)


@gluon.jit
def _fwd_step(u, acc, m_i, l_i, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, start_n, my_first, my_last,
              window, sm_scale2, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
              o_layout: gl.constexpr, a_layout: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Key block ``start_n``, from the ring's ``u``-th use: online softmax in log2 units, less each row's
    bias term (a per-row constant, which the softmax does not see; the log-sum-exp gets it back at the end)."""
    s = u % STAGES
    mbarrier.wait(ready.index(s), (u // STAGES) & 1)
    if block_seen(start_n, my_first, my_last, window, BLOCK_N, HAS_WINDOW):
        k_t = k_s.index(s)
        sc = warpgroup_mma(q_s, k_t.permute((1, 0)), zero, use_acc=False, is_async=True)
        sc = biased_scores(sc, ck_s, s, pos_m, start_n, my_first, my_last, window, sm_scale2, BLOCK_N, s_layout, 0,
                           HAS_WINDOW)
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        m_use = m_new
        if HAS_WINDOW:  # a row that has seen no key yet (all -inf so far) gets weights of 0, not NaN
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(k_s.dtype), a_layout), v_s.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        m_i = m_new
    ampere_mbarrier.arrive(empty.index(s))
    return acc, m_i, l_i


@gluon.jit
def _fwd_online_loop(acc, m_i, l_i, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo, n_blocks, my_first, my_last,
                     window, sm_scale2, it0, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                     o_layout: gl.constexpr, a_layout: gl.constexpr, HAS_WINDOW: gl.constexpr):
    for i in range(0, n_blocks):
        acc, m_i, l_i = _fwd_step(it0 + i, acc, m_i, l_i, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo + i * BLOCK_N,
                                  my_first, my_last, window, sm_scale2, BLOCK_N, STAGES, s_layout, o_layout, a_layout,
                                  HAS_WINDOW)
    return acc, m_i, l_i


@gluon.jit
def _fixed_scores(sc, ck_s, s, pos_m, start_n, my_first, my_last, window, sm_scale2, bound, l_i, dtype: gl.constexpr,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr, a_layout: gl.constexpr, ROWWISE: gl.constexpr,
                  HAS_WINDOW: gl.constexpr):
    """Key block ``start_n`` (ring slot ``s``) against the fixed bound (one for the tile, folded into the
    column term, or with ROWWISE one per row): the weights 2^(score - bound) as the A operand of the P V
    matmul, and the row sums grown by them (on the diagonal, by the rounded weights the matmul uses, so
    that a row with a few keys is as exact as in the online form)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    if ROWWISE:
        x = sc * sm_scale2 - ck_s.index(s).load(col_layout)[None, :] - bound[:, None]
    else:
        x = sc * sm_scale2 - (ck_s.index(s).load(col_layout) + bound)[None, :]
    x = window_mask(x, pos_m, start_n, my_last, window, BLOCK_N, s_layout, HAS_WINDOW)
    if start_n + BLOCK_N - 1 > my_first:  # the diagonal
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=col_layout)
        x = gl.where(offs_n[None, :] <= pos_m[:, None], x, float("-inf"))
        p = gl.exp2(x).to(dtype)
        l_i = l_i + gl.sum(p.to(gl.float32), axis=1)
    else:
        p = gl.exp2(x)
        l_i = l_i + gl.sum(p, axis=1)
        p = p.to(dtype)
    return gl.convert_layout(p, a_layout), l_i


@gluon.jit
def _fwd_fixed_loop(acc, l_i, bound, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo, n_mine, my_first, my_last,
                    window, sm_scale2, it0, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                    a_layout: gl.constexpr, ROWWISE: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """The softmax against a fixed bound: no row maximum and no rescaling of the output, so the matmuls
    are pipelined: block i's scores are issued before block i-1's P V and its exponentials run while
    that matmul does. The first ``n_mine`` blocks of the ring (from its ``it0``-th use) are this
    warpgroup's."""
    dtype: gl.constexpr = k_s.dtype
    s = it0 % STAGES
    mbarrier.wait(ready.index(s), (it0 // STAGES) & 1)
    sc = warpgroup_mma(q_s, k_s.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=[sc])
    p, l_i = _fixed_scores(sc, ck_s, s, pos_m, lo, my_first, my_last, window, sm_scale2, bound, l_i, dtype, BLOCK_N,
                           s_layout, a_layout, ROWWISE, HAS_WINDOW)
    for i in range(1, n_mine):
        u = it0 + i
        s = u % STAGES
        prev = (u - 1) % STAGES
        mbarrier.wait(ready.index(s), (u // STAGES) & 1)
        sc = warpgroup_mma(q_s, k_s.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v_s.index(prev), acc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=1, deps=[sc])
        p_next, l_i = _fixed_scores(sc, ck_s, s, pos_m, lo + i * BLOCK_N, my_first, my_last, window, sm_scale2, bound,
                                    l_i, dtype, BLOCK_N, s_layout, a_layout, ROWWISE, HAS_WINDOW)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p])
        ampere_mbarrier.arrive(empty.index(prev))
        p = p_next
    last = (it0 + n_mine - 1) % STAGES
    acc = warpgroup_mma(p, v_s.index(last), acc, is_async=True)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p])
    ampere_mbarrier.arrive(empty.index(last))
    return acc, l_i


@gluon.jit
def _fwd_bound(q_s, kmax2, c_q2, mask_m, sm_scale2, GAP: gl.constexpr, row_layout: gl.constexpr):
    """(bound, tile_ok, row_bound, rows_ok) of this warpgroup's rows, as the Triton forward's _fixed_bound:
    ``u_i - c2_i`` (``u_i = |q_i| max|k| |s| log2(e)``) bounds every visible score of row i (``c_j >= c_i``)
    and ``bound`` is their maximum. Every row's diagonal term is at least 2^(-2 u_i) of its own bound;
    ``tile_ok`` when that lies within GAP of ``bound`` for every row, ``rows_ok`` of the row's own bound."""
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q = q_s.load(q_layout).to(gl.float32)
    q_sq = gl.convert_layout(gl.sum(q * q, axis=1), row_layout)
    u = gl.sqrt(q_sq * kmax2) * gl.abs(sm_scale2)
    row_bound = u - c_q2
    bound = gl.max(gl.where(mask_m, row_bound, float("-inf")), axis=0)
    gap = gl.max(gl.where(mask_m, 2.0 * u + (bound - row_bound), 0.0), axis=0)
    row_gap = gl.max(gl.where(mask_m, 2.0 * u, 0.0), axis=0)
    return bound, gap <= GAP, row_bound, row_gap <= GAP


@gluon.jit
def _fwd_tile(C, OUT, LSE, RANGE, range_cols, KMAX2, q_all, k_s, v_s, ck_s, ready, empty, q_empty,
              b, h, hk, HKV, pid_bh, pid_m, first, t_q, t_k, stride_ob, stride_ot, stride_oh,
              stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2, window, it0,
              HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              HAS_THRESH: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr, FIXED: gl.constexpr,
              GAP: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """One warpgroup's share of one query block: rows [ROW0, ROW0 + ROWS), its key blocks from the ring's
    ``it0``-th use on (returns the next use's number). With FIXED, the softmax runs against a fixed bound
    where it is tight enough for these rows (else online). Hands the query tile back (``q_empty``) once its
    last ``Q K^T`` is done."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    offs_m = pid_m * BLOCK_M + ROW0 + gl.arange(0, ROWS, layout=row_layout)
    mask_m = offs_m < t_q
    pos_m = offs_m + (t_k - t_q)
    my_first = first + ROW0
    my_last = my_first + ROWS - 1
    q_s = q_all.index(ROW0 // ROWS)
    c_ptr = C + b * stride_cb + h * stride_ch
    row_term = (gl.load(c_ptr + pos_m, mask=mask_m, other=0.0) - gl.load(c_ptr + first)).to(gl.float32)
    zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    lo, hi = kept_key_range(RANGE, range_cols, pid_bh, pid_m, first, t_k, window, BLOCK_M, BLOCK_N, HAS_THRESH,
                            HAS_WINDOW)
    n_blocks = gl.cdiv(hi - lo, BLOCK_N)
    if FIXED:
        bound, tile_ok, row_bound, rows_ok = _fwd_bound(q_s, gl.load(KMAX2 + b * HKV + hk), row_term * LOG2E, mask_m,
                                                        sm_scale2, GAP, row_layout)
        # the blocks that start past these rows are only handed back
        n_mine = gl.cdiv(gl.minimum(hi, my_last + 1) - lo, BLOCK_N)
        if tile_ok:
            acc, l_i = _fwd_fixed_loop(acc, l_i, bound, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo, n_mine,
                                       my_first, my_last, window, sm_scale2, it0, BLOCK_N, STAGES, s_layout, a_layout,
                                       False, HAS_WINDOW)
            m_i = gl.full([ROWS], 0.0, gl.float32, row_layout) + bound
        elif rows_ok:  # the gates decay too much across the tile for one bound (one more tile op)
            acc, l_i = _fwd_fixed_loop(acc, l_i, row_bound, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo,
                                       n_mine, my_first, my_last, window, sm_scale2, it0, BLOCK_N, STAGES, s_layout,
                                       a_layout, True, HAS_WINDOW)
            m_i = row_bound
        else:
            acc, m_i, l_i = _fwd_online_loop(acc, m_i, l_i, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo,
                                             n_blocks, my_first, my_last, window, sm_scale2, it0, BLOCK_N, STAGES,
                                             s_layout, o_layout, a_layout, HAS_WINDOW)
            n_mine = n_blocks
        ampere_mbarrier.arrive(q_empty)
        for i in range(n_mine, n_blocks):
            u = it0 + i
            mbarrier.wait(ready.index(u % STAGES), (u // STAGES) & 1)
            ampere_mbarrier.arrive(empty.index(u % STAGES))
    else:
        acc, m_i, l_i = _fwd_online_loop(acc, m_i, l_i, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo, n_blocks,
                                         my_first, my_last, window, sm_scale2, it0, BLOCK_N, STAGES, s_layout, o_layout,
                                         a_layout, HAS_WINDOW)
        ampere_mbarrier.arrive(q_empty)
    lse = (m_i + gl.log2(l_i)) * LN2 + row_term
    gl.store(LSE + b * stride_lb + h * stride_lh + offs_m, lse, mask=mask_m)
    rows = pid_m * BLOCK_M + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    o_ptrs = (OUT + b.to(gl.int64) * stride_ob + h * stride_oh + rows.to(gl.int64)[:, None] * stride_ot
              + cols[None, :])
    gl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=(rows < t_q)[:, None])
    return it0 + n_blocks


@gluon.jit
def _next_tile(tile_s, q_bar, phase):
    """The query tile the loader handed out next (past the last: no more), once its Q tiles are in."""
    mbarrier.wait(q_bar, phase)
    return gl.max(tile_s.load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)


@gluon.jit
def _fwd_compute_partition(C, OUT, LSE, RANGE, range_cols, KMAX2, q_all, k_s, v_s, ck_s, ready, empty, q_bar,
                           q_empty, tile_s, HKV, H, Tq, Tk, n_bh, heads_per_group, stride_ob, stride_ot, stride_oh,
                           stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2, window, GROUP: gl.constexpr,
                           HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           HAS_THRESH: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr, FIXED: gl.constexpr,
                           GAP: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """One consumer warpgroup: rows [ROW0, ROW0 + ROWS) of every query tile the loader hands this program."""
    n_tiles = gl.cdiv(Tq, BLOCK_M) * n_bh
    n = 0
    it = 0
    t = _next_tile(tile_s, q_bar, 0)
    while t < n_tiles:
        pid_m, pid_bh, b, h, hk, first = query_tile(t, n_bh, heads_per_group, H, Tq, Tk, GROUP, BLOCK_M)
        it = _fwd_tile(C, OUT, LSE, RANGE, range_cols, KMAX2, q_all, k_s, v_s, ck_s, ready, empty, q_empty,
                       b, h, hk, HKV, pid_bh, pid_m, first, Tq, Tk, stride_ob, stride_ot, stride_oh,
                       stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2, window, it,
                       HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, ROW0, ROWS, FIXED, GAP, HAS_WINDOW)
        n += 1
        t = _next_tile(tile_s, q_bar, n & 1)


@gluon.jit
def _hand_out(tile_s, q_empty, n, t):
    """The loader writes the number of its ``n``-th tile, ``t``, for the consumers once they are done with
    the last tile's Q (the arrival that tells them follows)."""
    mbarrier.wait(q_empty, (n & 1) ^ 1)
    tile_s.store(gl.full([32], t, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
    thread_barrier()  # every lane's store before the one-thread arrival


@gluon.jit
def _fwd_load_partition(q_desc, k_desc, v_desc, q_all, k_s, v_s, ck_s, ready, empty, q_bar, q_empty, tile_s,
                        COUNTER, C, CL, RANGE, range_cols, stride_cb, stride_ch, H, Tq, Tk, n_bh, heads_per_group,
                        window, GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, CONSUMERS: gl.constexpr,
                        HAS_WINDOW: gl.constexpr):
    """The loader: takes query tiles, the program's own first and then the next not yet taken (an atomic
    counter), hands each to the consumers (its number and its Q tiles, once they have handed the last
    one's back) and streams its key blocks through the ring; past the last tile it hands out the end."""
    n_tiles = gl.cdiv(Tq, BLOCK_M) * n_bh
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    q_bytes: gl.constexpr = BLOCK_M * HEAD_D * q_desc.dtype.primitive_bitwidth // 8
    n = 0
    it = 0
    t = gl.program_id(0)
    while t < n_tiles:
        pid_m, pid_bh, b, h, hk, first = query_tile(t, n_bh, heads_per_group, H, Tq, Tk, GROUP, BLOCK_M)
        _hand_out(tile_s, q_empty, n, t)
        mbarrier.expect(q_bar, q_bytes)
        for c in gl.static_range(CONSUMERS):
            tma_load(q_desc, [b * Tq + pid_m * BLOCK_M + c * ROWS, h * HEAD_D], q_bar, q_all.index(c))
        it = kv_load_tile(k_desc, v_desc, k_s, v_s, ck_s, ready, empty, C, CL, RANGE, range_cols, stride_cb,
                          stride_ch, b, h, hk, pid_bh, pid_m, first, Tk, window, it, HEAD_D, BLOCK_M, BLOCK_N, STAGES,
                          HAS_THRESH, HAS_WINDOW)
        n += 1
        t = gl.num_programs(0) + gl.atomic_add(COUNTER, 1)
    _hand_out(tile_s, q_empty, n, t)
    ampere_mbarrier.arrive(q_bar)


@gluon.jit
def gluon_fwd_kernel(q_desc, k_desc, v_desc, C, CL, OUT, LSE, RANGE, range_cols, KMAX2, COUNTER,
                     stride_ob, stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh,
                     H, Tq, Tk, sm_scale2, n_bh, heads_per_group, window,
                     GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr, FIXED: gl.constexpr, GAP: gl.constexpr, CONSUMERS: gl.constexpr,
                     HAS_WINDOW: gl.constexpr):
    """Output and log-sum-exp of query tiles of BLOCK_M queries, each split between CONSUMERS warpgroups;
    a program runs tiles until none is left (``COUNTER``: an int32 0, counting the tiles taken past the
    programs' first). With FIXED (``KMAX2``: the largest squared key norm per (row, key/value head)) each
    consumer runs its rows against a fixed softmax bound where one is tight enough."""
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    # each consumer's query rows: a (ROWS, HEAD_D) tile (TMA tiles are powers of two; BLOCK_M need not be)
    q_s = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_D], q_desc.layout)
    k_s, v_s, ck_s, ready, empty, q_bar = kv_ring(k_desc, v_desc, BLOCK_N, HEAD_D, STAGES, CONSUMERS)
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_empty, count=CONSUMERS)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    tile_s = gl.allocate_shared_memory(gl.int32, [32], vec_smem)
    HKV = H // GROUP

    # (argument tuples spelled out per partition: a tuple built in the kernel turns constexprs into tensors)
    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_fwd_compute_partition, (C, OUT, LSE, RANGE, range_cols, KMAX2, q_s, k_s, v_s, ck_s, ready, empty,
                                          q_bar, q_empty, tile_s, HKV, H, Tq, Tk, n_bh, heads_per_group, stride_ob,
                                          stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2,
                                          window, GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, 0, ROWS, FIXED,
                                          GAP, HAS_WINDOW)),
                (_fwd_compute_partition, (C, OUT, LSE, RANGE, range_cols, KMAX2, q_s, k_s, v_s, ck_s, ready, empty,
                                          q_bar, q_empty, tile_s, HKV, H, Tq, Tk, n_bh, heads_per_group, stride_ob,
                                          stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2,
                                          window, GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, ROWS, ROWS, FIXED,
                                          GAP, HAS_WINDOW)),
                (_fwd_load_partition, (q_desc, k_desc, v_desc, q_s, k_s, v_s, ck_s, ready, empty, q_bar, q_empty,
                                       tile_s, COUNTER, C, CL, RANGE, range_cols, stride_cb, stride_ch, H, Tq, Tk,
                                       n_bh, heads_per_group, window, GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES,
                                       HAS_THRESH, CONSUMERS, HAS_WINDOW)),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )
    else:
        gl.static_assert(CONSUMERS == 3, "the forward runs two or three consumer warpgroups")
        gl.warp_specialize(
            [
                (_fwd_compute_partition, (C, OUT, LSE, RANGE, range_cols, KMAX2, q_s, k_s, v_s, ck_s, ready, empty,
                                          q_bar, q_empty, tile_s, HKV, H, Tq, Tk, n_bh, heads_per_group, stride_ob,
                                          stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2,
                                          window, GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, 0, ROWS, FIXED,
                                          GAP, HAS_WINDOW)),
                (_fwd_compute_partition, (C, OUT, LSE, RANGE, range_cols, KMAX2, q_s, k_s, v_s, ck_s, ready, empty,
                                          q_bar, q_empty, tile_s, HKV, H, Tq, Tk, n_bh, heads_per_group, stride_ob,
                                          stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2,
                                          window, GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, ROWS, ROWS, FIXED,
                                          GAP, HAS_WINDOW)),
                (_fwd_compute_partition, (C, OUT, LSE, RANGE, range_cols, KMAX2, q_s, k_s, v_s, ck_s, ready, empty,
                                          q_bar, q_empty, tile_s, HKV, H, Tq, Tk, n_bh, heads_per_group, stride_ob,
                                          stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2,
                                          window, GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, 2 * ROWS, ROWS,
                                          FIXED, GAP, HAS_WINDOW)),
                (_fwd_load_partition, (q_desc, k_desc, v_desc, q_s, k_s, v_s, ck_s, ready, empty, q_bar, q_empty,
                                       tile_s, COUNTER, C, CL, RANGE, range_cols, stride_cb, stride_ch, H, Tq, Tk,
                                       n_bh, heads_per_group, window, GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES,
                                       HAS_THRESH, CONSUMERS, HAS_WINDOW)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS],
        )
