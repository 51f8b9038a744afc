"""The Gluon backward for Hopper (sm90), warp-specialised: the dK/dV pass (one pass with FUSED_DQ), then
the dQ pass (see ``common`` for what it shares with the forward).

dK/dV: one program owns a block of BLOCK_N keys of one key/value head and walks the query blocks that see it,
for every query head of its group. A one-warp producer partition streams the Q and dO tiles through a
ring of STAGES shared-memory slots with TMA; two consumer partitions of one warpgroup each own half
of the key rows and run, each at its own pace, the four tile matmuls per query block as asynchronous
wgmma (so one's exponentials overlap the other's matmuls):

* ``S^T = K Q^T`` and ``dP^T = V dO^T`` are issued together, and the exponentials start as soon as the
  first is done;
* ``dV += P^T dO`` and ``dK += dS^T Q`` take P^T and dS^T from registers (no shared-memory round trip);
* a slot is handed back to the producer once both consumers' matmuls that read it are done.

The FoX bias and the gate gradient follow the Triton dK/dV pass (``triton/bwd.py``): the bias is
measured from ``c`` at the key block's first row, the query side of it comes from the float32 local
sums plus one float64 offset per query tile, and ``dc_j`` takes minus the column sums of dS.

With FUSED_DQ the dK/dV kernel is the whole backward (opt-in, D=64): each consumer also stores its dS
tile to shared memory, computes its keys' share of the query block's dQ (``dS K``, a fifth matmul) and
of the row sums of dS, and adds both into float32 tensors with TMA reductions (two buffers each, so
a reduction overlaps the next query block). It measured 2-10% slower than the two passes on an H100:
without the dQ stores and row sums it would be 22% faster (2.26 vs 2.88 ms at T=16k, H=12), so the
per-block stores, barriers and reductions, not the matmuls, decide it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mbarrier as ampere_mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fox_kernel.ops.constants import LOG2E
from fox_kernel.ops.gluon.common import (
    biased_scores,
    block_seen,
    kept_key_range,
    kv_load_partition,
    kv_ring,
    program_tile,
    query_program,
    thread_barrier,
    tma_add,
    tma_load,
    wgmma_layout,
)


@gluon.jit
def _query_blocks(pid_n, shift, t_q, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Query blocks that see key block ``pid_n``: from m_lo, those before m_mid on the diagonal (as
    triton.ranges.query_range without left padding)."""
    m_lo = (gl.maximum(pid_n * BLOCK_N - shift, 0) // BLOCK_M) * BLOCK_M
    m_mid = gl.minimum(gl.maximum((pid_n + 1) * BLOCK_N - shift + BLOCK_M - 1, 0) // BLOCK_M * BLOCK_M, t_q)
    return m_lo, gl.maximum(m_mid, m_lo)


@gluon.jit
def _query_end(RANGE, b, h, H, pid_n, n_blk, t_q, shift, window, BLOCK_N: gl.constexpr, HAS_THRESH: gl.constexpr,
               HAS_WINDOW: gl.constexpr):
    """End of the query blocks of key block ``pid_n`` and head ``h``: with pruning, those past it see the
    block through a negligible decay (found up front, see triton.ranges.kept_ranges); with a sliding window
    of ``window`` keys, those past the last query whose window holds the block's last key do not see it."""
    if HAS_THRESH:
        end = gl.load(RANGE + (b * H + h).to(gl.int64) * n_blk + pid_n)
    else:
        end = t_q
    if HAS_WINDOW:
        end = gl.minimum(end, (pid_n + 1) * BLOCK_N - 1 + window - shift)
    return end


@gluon.jit
def _load_partition(q_desc, do_desc, q_s, do_s, lse_s, delta_s, ready, empty, C, CLQ, LSE, DELTA, RANGE,
                    stride_cb, stride_ch, stride_lb, stride_lh, b, hk, H, pid_n, n_blk, shift, t_q, window,
                    GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Fills the ring: per query block, the Q and dO tiles (TMA) and two row vectors (written here, off
    the consumers' path): log2 of the softmax denominators less the row term of the bias, and delta."""
    vec_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    m_lo, _ = _query_blocks(pid_n, shift, t_q, BLOCK_M, BLOCK_N)
    nbytes: gl.constexpr = 2 * BLOCK_M * HEAD_D * q_desc.dtype.primitive_bitwidth // 8
    i = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        c_ptr = C + b * stride_cb + h * stride_ch
        clq_ptr = CLQ + b * stride_cb + h * stride_ch
        lse_ptr = LSE + b * stride_lb + h * stride_lh
        delta_ptr = DELTA + b * stride_lb + h * stride_lh
        anchor = gl.load(c_ptr + pid_n * BLOCK_N)
        for start_m in range(m_lo, _query_end(RANGE, b, h, H, pid_n, n_blk, t_q, shift, window, BLOCK_N, HAS_THRESH,
                                              HAS_WINDOW), BLOCK_M):
            offs_m = start_m + gl.arange(0, BLOCK_M, layout=vec_layout)
            mask_m = offs_m < t_q  # rows past the end get no weight (lse = inf)
            lse = gl.load(lse_ptr + offs_m, mask=mask_m, other=float("inf"))
            delta = gl.load(delta_ptr + offs_m, mask=mask_m, other=0.0)
            c_q2 = gl.load(clq_ptr + shift + offs_m, mask=mask_m, other=0.0)
            seg = ((gl.load(c_ptr + shift + start_m) - anchor) * LOG2E).to(gl.float32)
            s = i % STAGES
            # a fresh barrier counts as having completed the phase before its first: the first pass
            # over the ring does not wait
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            lse_s.index(s).store(lse * LOG2E - (c_q2 + seg))
            delta_s.index(s).store(delta)
            thread_barrier()  # every lane's stores before the one-thread arrival below
            mbarrier.expect(ready.index(s), nbytes)
            row = b * t_q + start_m
            tma_load(q_desc, [row, h * HEAD_D], ready.index(s), q_s.index(s))
            tma_load(do_desc, [row, h * HEAD_D], ready.index(s), do_s.index(s))
            i += 1


@gluon.jit
def _dkdv_step(i, dk, dv, dc, k_s, v_s, q_s, do_s, lse_s, delta_s, ready, empty, zero, c_k2, offs_n, key0,
               start_m, m_mid, shift, t_q, window, sm_scale2, dq_desc, ds_s, dq_s, rs_desc, rs_s, rs_row, q_row, h,
               BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
               a_layout: gl.constexpr, FUSED_DQ: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Query block ``start_m``, from ring slot ``i``. With FUSED_DQ, also this warpgroup's share of the
    block's dQ (dS K over its keys) and of the row term of dc, added into float32 tensors with TMA
    reductions."""
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    q_t = q_s.index(s)
    do_t = do_s.index(s)
    s_t = warpgroup_mma(k_s, q_t.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_s, do_t.permute((1, 0)), zero, use_acc=False, is_async=True)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    lse2 = lse_s.index(s).load(col_layout)
    delta = delta_s.index(s).load(col_layout)
    s_t = warpgroup_mma_wait(num_outstanding=1, deps=[s_t])
    s_t = s_t * sm_scale2 - c_k2[:, None]
    edge = (start_m < m_mid) | (start_m + BLOCK_M > t_q)  # the diagonal, or the end of the queries
    if HAS_WINDOW:  # or a query block whose last row's window starts past this warpgroup's first key
        edge = edge | (start_m + BLOCK_M - 1 + shift - window >= key0)
    if edge:
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
        keep = (offs_n[:, None] <= (offs_m + shift)[None, :]) & (offs_m < t_q)[None, :]
        if HAS_WINDOW:
            keep = keep & (offs_n[:, None] > (offs_m + shift - window)[None, :])
        s_t = gl.where(keep, s_t, float("-inf"))
    p_t = gl.exp2(s_t - lse2[None, :])
    dp_t = warpgroup_mma_wait(num_outstanding=0, deps=[dp_t])
    ds_t = p_t * (dp_t - delta[None, :])
    dtype: gl.constexpr = q_s.dtype
    dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_t, dv, is_async=True)
    if FUSED_DQ:
        ds_lo = ds_t.to(dtype)
        ds_s.store(ds_lo)
        fence_async_shared()
        tma.store_wait(2)  # the reductions that read this step's buffers (two steps ago) are done with them
        thread_barrier()  # and every lane's part of dS is in place for the matmuls that read it
        dk = warpgroup_mma(gl.convert_layout(ds_lo, a_layout), q_t, dk, is_async=True)
        dq_layout: gl.constexpr = wgmma_layout(HEAD_D)
        dq = warpgroup_mma(ds_s.permute((1, 0)), k_s, gl.zeros([BLOCK_M, HEAD_D], gl.float32, dq_layout),
                           use_acc=False, is_async=True)
        dc = dc - gl.sum(ds_t, axis=1)
        # the row term of dc: each warp's sums over its own keys (no exchange between warps: as atomics
        # of whole-tile sums it cost 0.9 of 3.6 ms at T=16k, H=12); the four partial sums go to four rows
        # of rs_desc's tensor and are added up on the host. (Taken from the dS rounded for the matmuls,
        # as a matmul with ones, they were cheaper but 7x further from float64 in the gate gradient.)
        ROWS: gl.constexpr = ds_s.shape[0]
        rs = gl.sum(gl.reshape(ds_t, [4, ROWS // 4, BLOCK_M]), axis=1)
        dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, dq])
        ampere_mbarrier.arrive(empty.index(s))
        buf = dq_s.index(i % 2)
        rs_buf = rs_s.index(i % 2)
        buf.store(dq)
        rs_buf.store(rs)
        fence_async_shared()
        thread_barrier()
        tma_add(dq_desc, [q_row + start_m, h * HEAD_D], buf)
        tma_add(rs_desc, [rs_row, start_m], rs_buf)
    else:
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q_t, dk, is_async=True)
        dc = dc - gl.sum(ds_t, axis=1)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk])
        ampere_mbarrier.arrive(empty.index(s))
    return dk, dv, dc


@gluon.jit
def _compute_partition(C, DK, DV, DC, RANGE, k_all, v_all, q_s, do_s, lse_s, delta_s, ready, empty, kv_bar,
                       b, hk, H, pid_n, n_blk, shift, t_q, t_k,
                       stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
                       stride_cb, stride_ch, sm_scale, sm_scale2, dq_desc, ds_s, dq_s, rs_desc, rs_s, window,
                       GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr,
                       FUSED_DQ: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """One warpgroup's share of the key block: rows [ROW0, ROW0 + ROWS)."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_M)
    kv_layout: gl.constexpr = wgmma_layout(HEAD_D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    m_lo, m_mid = _query_blocks(pid_n, shift, t_q, BLOCK_M, BLOCK_N)
    k_s = k_all.slice(ROW0, ROWS)
    v_s = v_all.slice(ROW0, ROWS)
    offs_n = pid_n * BLOCK_N + ROW0 + gl.arange(0, ROWS, layout=row_layout)
    mask_n = offs_n < t_k
    zero = gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, kv_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, kv_layout)
    mbarrier.wait(kv_bar, 0)
    i = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        c_ptr = C + b * stride_cb + h * stride_ch
        anchor = gl.load(c_ptr + pid_n * BLOCK_N)
        c_k = gl.load(c_ptr + offs_n, mask=mask_n, other=0.0)
        c_k2 = (c_k - anchor).to(gl.float32) * LOG2E
        dc = gl.zeros([ROWS], gl.float32, row_layout)
        for start_m in range(m_lo, _query_end(RANGE, b, h, H, pid_n, n_blk, t_q, shift, window, BLOCK_N, HAS_THRESH,
                                              HAS_WINDOW), BLOCK_M):
            dk, dv, dc = _dkdv_step(i, dk, dv, dc, k_s, v_s, q_s, do_s, lse_s, delta_s, ready, empty, zero, c_k2,
                                    offs_n, pid_n * BLOCK_N + ROW0, start_m, m_mid, shift, t_q, window, sm_scale2,
                                    dq_desc, ds_s, dq_s, rs_desc, rs_s, (b * H + h) * 4, b * t_q, h, BLOCK_M, HEAD_D,
                                    STAGES, s_layout, a_layout, FUSED_DQ, HAS_WINDOW)
            i += 1
        gl.store(DC + b * stride_cb + h * stride_ch + offs_n, dc, mask=mask_n)
    if FUSED_DQ:
        tma.store_wait(0)

    rows = pid_n * BLOCK_N + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, kv_layout))
    mask = (rows < t_k)[:, None]
    rows64 = rows.to(gl.int64)[:, None]
    dk_ptrs = DK + b.to(gl.int64) * stride_dkb + hk * stride_dkh + rows64 * stride_dkt + cols[None, :]
    dv_ptrs = DV + b.to(gl.int64) * stride_dvb + hk * stride_dvh + rows64 * stride_dvt + cols[None, :]
    gl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask)
    gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)


@gluon.jit
def gluon_dkdv_kernel(q_desc, do_desc, k_desc, v_desc, C, CLQ, LSE, DELTA, DK, DV, DC, RANGE, dq_desc, rs_desc,
                      stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
                      stride_cb, stride_ch, stride_lb, stride_lh,
                      H, HKV, Tq, Tk, sm_scale, sm_scale2, heads_per_group, window,
                      GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                      LOADER_REGS: gl.constexpr, FUSED_DQ: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """dK, dV and the column term of dc; with FUSED_DQ also dQ / sm_scale and the row term of dc, added
    with TMA reductions into the float32 tensors of ``dq_desc`` (q's layout) and ``rs_desc`` ((B*H*4, Tq):
    four partial sums per row): the one-pass backward."""
    n_blk = gl.cdiv(Tk, BLOCK_N)
    pid_n, pid_bh = program_tile(n_blk, heads_per_group)  # the first key blocks are the heaviest
    b = pid_bh // HKV
    hk = pid_bh % HKV
    shift = Tk - Tq

    dtype: gl.constexpr = q_desc.dtype
    k_s = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], k_desc.layout)
    v_s = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_D], v_desc.layout)
    q_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    lse_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    delta_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # released by both consumer warpgroups
    mbarrier.init(kv_bar, count=1)
    ROWS: gl.constexpr = BLOCK_N // 2
    # per consumer: its dS tile (the A operand of its dQ matmul) and two float32 dQ tiles for the reductions
    if FUSED_DQ:
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_M], dtype)
        ds_s = gl.allocate_shared_memory(dtype, [ROWS, BLOCK_M], ds_layout)
        ds2_s = gl.allocate_shared_memory(dtype, [ROWS, BLOCK_M], ds_layout)
        dq_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_D], dq_desc.layout)
        dq2_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_D], dq_desc.layout)
        rs_s = gl.allocate_shared_memory(gl.float32, [2, 4, BLOCK_M], rs_desc.layout)
        rs2_s = gl.allocate_shared_memory(gl.float32, [2, 4, BLOCK_M], rs_desc.layout)
    else:  # not used
        ds_s = k_s
        ds2_s = k_s
        dq_s = k_s
        dq2_s = k_s
        rs_s = k_s
        rs2_s = k_s

    k_row = b * Tk + pid_n * BLOCK_N
    mbarrier.expect(kv_bar, 2 * BLOCK_N * HEAD_D * dtype.primitive_bitwidth // 8)
    tma_load(k_desc, [k_row, hk * HEAD_D], kv_bar, k_s)
    tma_load(v_desc, [k_row, hk * HEAD_D], kv_bar, v_s)

    # (constexprs are spelled out: a tuple built in the kernel would turn them into tensors)
    gl.warp_specialize(
        [
            (_compute_partition, (C, DK, DV, DC, RANGE, k_s, v_s, q_s, do_s, lse_s, delta_s, ready, empty, kv_bar,
                                  b, hk, H, pid_n, n_blk, shift, Tq, Tk, stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt,
                                  stride_dvh, stride_cb, stride_ch, sm_scale, sm_scale2, dq_desc, ds_s, dq_s, rs_desc, rs_s,
                                  window, GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, 0, ROWS,
                                  FUSED_DQ, HAS_WINDOW)),
            (_compute_partition, (C, DK, DV, DC, RANGE, k_s, v_s, q_s, do_s, lse_s, delta_s, ready, empty, kv_bar,
                                  b, hk, H, pid_n, n_blk, shift, Tq, Tk, stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt,
                                  stride_dvh, stride_cb, stride_ch, sm_scale, sm_scale2, dq_desc, ds2_s, dq2_s, rs_desc, rs2_s,
                                  window, GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, ROWS, ROWS,
                                  FUSED_DQ, HAS_WINDOW)),
            (_load_partition, (q_desc, do_desc, q_s, do_s, lse_s, delta_s, ready, empty, C, CLQ, LSE, DELTA, RANGE,
                               stride_cb, stride_ch, stride_lb, stride_lh, b, hk, H, pid_n, n_blk, shift, Tq, window,
                               GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, HAS_WINDOW)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )



@gluon.jit
def _dq_step(i, dq, dc_row, q_s, do_s, k_s, v_s, ck_s, ready, empty, zero, lse2, delta, pos_m, start_n,
             my_first, my_last, window, sm_scale2, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             s_layout: gl.constexpr, a_layout: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Key block ``start_n``, from ring slot ``i``."""
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    if block_seen(start_n, my_first, my_last, window, BLOCK_N, HAS_WINDOW):
        k_t = k_s.index(s)
        v_t = v_s.index(s)
        sc = warpgroup_mma(q_s, k_t.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_s, v_t.permute((1, 0)), zero, use_acc=False, is_async=True)
        sc = biased_scores(sc, ck_s, s, pos_m, start_n, my_first, my_last, window, sm_scale2, BLOCK_N, s_layout, 1,
                           HAS_WINDOW)
        p = gl.exp2(sc - lse2[:, None])
        dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp])
        ds = p * (dp - delta[:, None])
        dq = warpgroup_mma(gl.convert_layout(ds.to(k_s.dtype), a_layout), k_t, dq, is_async=True)
        dc_row = dc_row + gl.sum(ds, axis=1)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
    ampere_mbarrier.arrive(empty.index(s))
    return dq, dc_row


@gluon.jit
def _dq_compute_partition(C, LSE, DELTA, DQ, DC_ROW, RANGE, range_cols, q_all, do_all, k_s, v_s, ck_s, ready, empty, q_bar,
                          b, h, pid_bh, pid_m, first, t_q, t_k, stride_dqb, stride_dqt, stride_dqh,
                          stride_cb, stride_ch, stride_lb, stride_lh, sm_scale, sm_scale2, window,
                          HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          HAS_THRESH: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """One warpgroup's share of the query block: rows [ROW0, ROW0 + ROWS)."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    dq_layout: gl.constexpr = wgmma_layout(HEAD_D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    shift = t_k - t_q
    offs_m = pid_m * BLOCK_M + ROW0 + gl.arange(0, ROWS, layout=row_layout)
    mask_m = offs_m < t_q
    pos_m = offs_m + shift
    c_ptr = C + b * stride_cb + h * stride_ch
    anchor = gl.load(c_ptr + first)
    c_q = gl.load(c_ptr + pos_m, mask=mask_m, other=0.0)
    lse = gl.load(LSE + b * stride_lb + h * stride_lh + offs_m, mask=mask_m, other=float("inf"))
    # the row term of the bias folded into the log-sum-exp
    lse2 = lse * LOG2E - (c_q - anchor).to(gl.float32) * LOG2E
    delta = gl.load(DELTA + b * stride_lb + h * stride_lh + offs_m, mask=mask_m, other=0.0)
    my_first = first + ROW0
    my_last = my_first + ROWS - 1
    q_s = q_all.slice(ROW0, ROWS)
    do_s = do_all.slice(ROW0, ROWS)
    zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([ROWS, HEAD_D], gl.float32, dq_layout)
    dc_row = gl.zeros([ROWS], gl.float32, row_layout)
    lo, hi = kept_key_range(RANGE, range_cols, pid_bh, pid_m, first, t_k, window, BLOCK_M, BLOCK_N, HAS_THRESH,
                            HAS_WINDOW)
    mbarrier.wait(q_bar, 0)
    for i in range(0, gl.cdiv(hi - lo, BLOCK_N)):
        dq, dc_row = _dq_step(i, dq, dc_row, q_s, do_s, k_s, v_s, ck_s, ready, empty, zero, lse2, delta, pos_m,
                              lo + i * BLOCK_N, my_first, my_last, window, sm_scale2, BLOCK_N, STAGES, s_layout,
                              a_layout, HAS_WINDOW)
    gl.store(DC_ROW + b * stride_lb + h * stride_lh + offs_m, dc_row, mask=mask_m)
    rows = pid_m * BLOCK_M + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, dq_layout))
    dq_ptrs = (DQ + b.to(gl.int64) * stride_dqb + h * stride_dqh + rows.to(gl.int64)[:, None] * stride_dqt
               + cols[None, :])
    gl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=(rows < t_q)[:, None])



@gluon.jit
def gluon_dq_kernel(q_desc, do_desc, k_desc, v_desc, C, CL, LSE, DELTA, DQ, DC_ROW, RANGE, range_cols,
                    stride_dqb, stride_dqt, stride_dqh, stride_cb, stride_ch, stride_lb, stride_lh,
                    H, Tq, Tk, sm_scale, sm_scale2, heads_per_group, window,
                    GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    LOADER_REGS: gl.constexpr, HAS_WINDOW: gl.constexpr):
    pid_m, pid_bh, b, h, hk, first = query_program(H, Tq, Tk, GROUP, BLOCK_M, heads_per_group)
    dtype: gl.constexpr = q_desc.dtype
    q_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    do_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], do_desc.layout)
    k_s, v_s, ck_s, ready, empty, q_bar = kv_ring(k_desc, v_desc, BLOCK_N, HEAD_D, STAGES, 2)

    q_row = b * Tq + pid_m * BLOCK_M
    mbarrier.expect(q_bar, 2 * BLOCK_M * HEAD_D * dtype.primitive_bitwidth // 8)
    tma_load(q_desc, [q_row, h * HEAD_D], q_bar, q_s)
    tma_load(do_desc, [q_row, h * HEAD_D], q_bar, do_s)

    ROWS: gl.constexpr = BLOCK_M // 2
    gl.warp_specialize(
        [
            (_dq_compute_partition, (C, LSE, DELTA, DQ, DC_ROW, RANGE, range_cols, q_s, do_s, k_s, v_s, ck_s, ready, empty, q_bar,
                                     b, h, pid_bh, pid_m, first, Tq, Tk, stride_dqb, stride_dqt, stride_dqh,
                                     stride_cb, stride_ch, stride_lb, stride_lh, sm_scale, sm_scale2, window,
                                     HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, 0, ROWS, HAS_WINDOW)),
            (_dq_compute_partition, (C, LSE, DELTA, DQ, DC_ROW, RANGE, range_cols, q_s, do_s, k_s, v_s, ck_s, ready, empty, q_bar,
                                     b, h, pid_bh, pid_m, first, Tq, Tk, stride_dqb, stride_dqt, stride_dqh,
                                     stride_cb, stride_ch, stride_lb, stride_lh, sm_scale, sm_scale2, window,
                                     HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, ROWS, ROWS, HAS_WINDOW)),
            (kv_load_partition, (k_desc, v_desc, k_s, v_s, ck_s, ready, empty, C, CL, RANGE, range_cols, stride_cb, stride_ch,
                                 b, h, hk, pid_bh, pid_m, first, Tk, window, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH,
                                 HAS_WINDOW)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )

