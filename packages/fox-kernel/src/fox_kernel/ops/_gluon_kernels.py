"""Gluon kernels for Hopper (sm90), warp-specialised: the forward and the two passes of the backward
(dK/dV, then dQ).

Imported only through ``gluon_attention`` (Gluon is experimental and not in every Triton build).

dK/dV: one program owns a block of BLOCK_N keys of one key/value head and walks the query blocks that see it,
for every query head of its group. A one-warp producer partition streams the Q and dO tiles through a
ring of STAGES shared-memory slots with TMA; two consumer partitions of one warpgroup each own half
of the key rows and run, each at its own pace, the four tile matmuls per query block as asynchronous
wgmma (so one's exponentials overlap the other's matmuls):

* ``S^T = K Q^T`` and ``dP^T = V dO^T`` are issued together, and the exponentials start as soon as the
  first is done;
* ``dV += P^T dO`` and ``dK += dS^T Q`` take P^T and dS^T from registers (no shared-memory round trip);
* a slot is handed back to the producer once both consumers' matmuls that read it are done.

The FoX bias and the gate gradient follow the Triton dK/dV pass (``triton_attention``): the bias is
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
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import mbarrier as ampere_mbarrier
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


if hasattr(tma, "async_atomic_add"):  # newer Gluon
    tma_add = tma.async_atomic_add
else:

    @builtin
    def tma_add(tensor_desc, coord, src, _semantic=None):
        """Adds a shared-memory tile into global memory (a TMA reduction; Triton 3.6 has the op but no
        Gluon function for it)."""
        from triton._C.libtriton import ir

        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _wgmma_layout(n):
    """Register layout of a one-warpgroup wgmma accumulator with ``n`` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _query_blocks(pid_n, shift, t_q, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Query blocks that see key block ``pid_n``: from m_lo, those before m_mid on the diagonal (as
    triton_attention._query_range without left padding)."""
    m_lo = (gl.maximum(pid_n * BLOCK_N - shift, 0) // BLOCK_M) * BLOCK_M
    m_mid = gl.minimum(gl.maximum((pid_n + 1) * BLOCK_N - shift + BLOCK_M - 1, 0) // BLOCK_M * BLOCK_M, t_q)
    return m_lo, gl.maximum(m_mid, m_lo)


@gluon.jit
def _query_end(RANGE, b, h, H, pid_n, t_q, HAS_THRESH: gl.constexpr, HEADS_FIRST: gl.constexpr):
    """End of the query blocks of key block ``pid_n`` and head ``h``: with pruning, those past it see the
    block through a negligible decay (found up front, see triton_attention._kept_range_kernel)."""
    if HAS_THRESH:
        return gl.load(RANGE + (b * H + h).to(gl.int64) * gl.num_programs(1 if HEADS_FIRST else 0) + pid_n)
    else:
        return t_q


@gluon.jit
def _load_partition(q_desc, do_desc, q_s, do_s, lse_s, delta_s, ready, empty, C, CLQ, LSE, DELTA, RANGE,
                    stride_cb, stride_ch, stride_lb, stride_lh, b, hk, H, pid_n, shift, t_q,
                    GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, HEADS_FIRST: gl.constexpr):
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
        for start_m in range(m_lo, _query_end(RANGE, b, h, H, pid_n, t_q, HAS_THRESH, HEADS_FIRST), BLOCK_M):
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
            gl.thread_barrier()  # every lane's stores before the one-thread arrival below
            mbarrier.expect(ready.index(s), nbytes)
            row = b * t_q + start_m
            tma.async_copy_global_to_shared(q_desc, [row, h * HEAD_D], ready.index(s), q_s.index(s))
            tma.async_copy_global_to_shared(do_desc, [row, h * HEAD_D], ready.index(s), do_s.index(s))
            i += 1


@gluon.jit
def _dkdv_step(i, dk, dv, dc, k_s, v_s, q_s, do_s, lse_s, delta_s, ready, empty, zero, c_k2, offs_n,
               start_m, m_mid, shift, t_q, sm_scale2, dq_desc, ds_s, dq_s, rs_desc, rs_s, rs_row, q_row, h,
               BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
               a_layout: gl.constexpr, FUSED_DQ: gl.constexpr):
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
    if (start_m < m_mid) | (start_m + BLOCK_M > t_q):  # the diagonal, or the end of the queries
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
        keep = (offs_n[:, None] <= (offs_m + shift)[None, :]) & (offs_m < t_q)[None, :]
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
        gl.thread_barrier()  # and every lane's part of dS is in place for the matmuls that read it
        dk = warpgroup_mma(gl.convert_layout(ds_lo, a_layout), q_t, dk, is_async=True)
        dq_layout: gl.constexpr = _wgmma_layout(HEAD_D)
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
        gl.thread_barrier()
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
                       b, hk, H, pid_n, shift, t_q, t_k,
                       stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
                       stride_cb, stride_ch, sm_scale, sm_scale2, dq_desc, ds_s, dq_s, rs_desc, rs_s,
                       GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr,
                       FUSED_DQ: gl.constexpr, HEADS_FIRST: gl.constexpr):
    """One warpgroup's share of the key block: rows [ROW0, ROW0 + ROWS)."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_M)
    kv_layout: gl.constexpr = _wgmma_layout(HEAD_D)
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
        for start_m in range(m_lo, _query_end(RANGE, b, h, H, pid_n, t_q, HAS_THRESH, HEADS_FIRST), BLOCK_M):
            dk, dv, dc = _dkdv_step(i, dk, dv, dc, k_s, v_s, q_s, do_s, lse_s, delta_s, ready, empty, zero, c_k2,
                                    offs_n, start_m, m_mid, shift, t_q, sm_scale2, dq_desc, ds_s, dq_s, rs_desc, rs_s,
                                    (b * H + h) * 4, b * t_q, h, BLOCK_M, HEAD_D, STAGES, s_layout, a_layout, FUSED_DQ)
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
                      H, HKV, Tq, Tk, sm_scale, sm_scale2,
                      GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                      LOADER_REGS: gl.constexpr, FUSED_DQ: gl.constexpr, HEADS_FIRST: gl.constexpr):
    """dK, dV and the column term of dc; with FUSED_DQ also dQ / sm_scale and the row term of dc, added
    with TMA reductions into the float32 tensors of ``dq_desc`` (q's layout) and ``rs_desc`` ((B*H*4, Tq):
    four partial sums per row): the one-pass backward."""
    if HEADS_FIRST:  # every head's heaviest key blocks (the first) first
        pid_n = gl.program_id(1)
        pid_bh = gl.program_id(0)
    else:
        pid_n = gl.program_id(0)
        pid_bh = gl.program_id(1)
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
    tma.async_copy_global_to_shared(k_desc, [k_row, hk * HEAD_D], kv_bar, k_s)
    tma.async_copy_global_to_shared(v_desc, [k_row, hk * HEAD_D], kv_bar, v_s)

    # (constexprs are spelled out: a tuple built in the kernel would turn them into tensors)
    gl.warp_specialize(
        [
            (_compute_partition, (C, DK, DV, DC, RANGE, k_s, v_s, q_s, do_s, lse_s, delta_s, ready, empty, kv_bar,
                                  b, hk, H, pid_n, shift, Tq, Tk, stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt,
                                  stride_dvh, stride_cb, stride_ch, sm_scale, sm_scale2, dq_desc, ds_s, dq_s, rs_desc, rs_s,
                                  GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, 0, ROWS,
                                  FUSED_DQ, HEADS_FIRST)),
            (_compute_partition, (C, DK, DV, DC, RANGE, k_s, v_s, q_s, do_s, lse_s, delta_s, ready, empty, kv_bar,
                                  b, hk, H, pid_n, shift, Tq, Tk, stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt,
                                  stride_dvh, stride_cb, stride_ch, sm_scale, sm_scale2, dq_desc, ds2_s, dq2_s, rs_desc, rs2_s,
                                  GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, ROWS, ROWS,
                                  FUSED_DQ, HEADS_FIRST)),
            (_load_partition, (q_desc, do_desc, q_s, do_s, lse_s, delta_s, ready, empty, C, CLQ, LSE, DELTA, RANGE,
                               stride_cb, stride_ch, stride_lb, stride_lh, b, hk, H, pid_n, shift, Tq,
                               GROUP, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, HEADS_FIRST)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


# ---------------------------------------------------------------------------------------------------
# The dQ pass and the forward: one program owns BLOCK_M queries of one head and walks the key blocks
# they see; the loader streams K and V tiles (and each key block's column term of the bias) through the
# ring, two consumer warpgroups own half of the query rows each. Same bias split as the Triton passes:
# measured from ``c`` at the query block's first position, keys through the float32 local sums of
# BLOCK_N-long tiles plus one float64 offset per tile.


@gluon.jit
def _kept_key_range(RANGE, range_cols, pid_bh, pid_m, first, t_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HAS_THRESH: gl.constexpr):
    """Key blocks seen by the query block whose first row sits at key position ``first``: [lo, hi); with
    pruning, those before lo are seen through a negligible decay (see triton_attention._kept_range_kernel)."""
    hi = gl.minimum(first + BLOCK_M, t_k)
    if HAS_THRESH:
        lo = (gl.load(RANGE + pid_bh.to(gl.int64) * range_cols + pid_m) // BLOCK_N) * BLOCK_N
    else:
        lo = 0
    return lo, hi


@gluon.jit
def _kv_load_partition(k_desc, v_desc, k_s, v_s, ck_s, ready, empty, C, CL, RANGE, range_cols, stride_cb, stride_ch,
                       b, h, hk, pid_bh, pid_m, first, t_k, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_THRESH: gl.constexpr):
    """Fills the ring: per key block, the K and V tiles (TMA) and log2(e) * (c_j - c_first) of its keys."""
    vec_layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
    nbytes: gl.constexpr = 2 * BLOCK_N * HEAD_D * k_desc.dtype.primitive_bitwidth // 8
    c_ptr = C + b * stride_cb + h * stride_ch
    cl_ptr = CL + b * stride_cb + h * stride_ch
    anchor = gl.load(c_ptr + first)
    lo, hi = _kept_key_range(RANGE, range_cols, pid_bh, pid_m, first, t_k, BLOCK_M, BLOCK_N, HAS_THRESH)
    for i in range(0, gl.cdiv(hi - lo, BLOCK_N)):
        start_n = lo + i * BLOCK_N
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=vec_layout)
        c_k2 = gl.load(cl_ptr + offs_n, mask=offs_n < t_k, other=0.0)
        seg = ((gl.load(c_ptr + start_n) - anchor) * LOG2E).to(gl.float32)
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        ck_s.index(s).store(c_k2 + seg)
        gl.thread_barrier()
        mbarrier.expect(ready.index(s), nbytes)
        row = b * t_k + start_n
        tma.async_copy_global_to_shared(k_desc, [row, hk * HEAD_D], ready.index(s), k_s.index(s))
        tma.async_copy_global_to_shared(v_desc, [row, hk * HEAD_D], ready.index(s), v_s.index(s))


@gluon.jit
def _biased_scores(sc, ck_s, s, pos_m, start_n, my_first, sm_scale2, BLOCK_N: gl.constexpr,
                   s_layout: gl.constexpr, PENDING: gl.constexpr):
    """The scores of key block ``start_n`` (ring slot ``s``) in log2 units less the rows' bias term: waits
    for the asynchronous ``sc = Q K^T`` (leaving the PENDING wgmma issued after it in flight), scales it,
    takes off the keys' bias term and, on the diagonal, masks the keys past each row."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    c_k2 = ck_s.index(s).load(col_layout)
    sc = warpgroup_mma_wait(num_outstanding=PENDING, deps=[sc])
    sc = sc * sm_scale2 - c_k2[None, :]
    if start_n + BLOCK_N - 1 > my_first:  # the diagonal (past the keys' end too: pos_m < t_k)
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=col_layout)
        sc = gl.where(offs_n[None, :] <= pos_m[:, None], sc, float("-inf"))
    return sc


@gluon.jit
def _dq_step(i, dq, dc_row, q_s, do_s, k_s, v_s, ck_s, ready, empty, zero, lse2, delta, pos_m, start_n,
             my_first, my_last, sm_scale2, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             s_layout: gl.constexpr, a_layout: gl.constexpr):
    """Key block ``start_n``, from ring slot ``i``."""
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    if start_n <= my_last:  # else every key of the block lies past these rows
        k_t = k_s.index(s)
        v_t = v_s.index(s)
        sc = warpgroup_mma(q_s, k_t.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_s, v_t.permute((1, 0)), zero, use_acc=False, is_async=True)
        sc = _biased_scores(sc, ck_s, s, pos_m, start_n, my_first, sm_scale2, BLOCK_N, s_layout, 1)
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
                          stride_cb, stride_ch, stride_lb, stride_lh, sm_scale, sm_scale2,
                          HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          HAS_THRESH: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr):
    """One warpgroup's share of the query block: rows [ROW0, ROW0 + ROWS)."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    dq_layout: gl.constexpr = _wgmma_layout(HEAD_D)
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
    lo, hi = _kept_key_range(RANGE, range_cols, pid_bh, pid_m, first, t_k, BLOCK_M, BLOCK_N, HAS_THRESH)
    mbarrier.wait(q_bar, 0)
    for i in range(0, gl.cdiv(hi - lo, BLOCK_N)):
        dq, dc_row = _dq_step(i, dq, dc_row, q_s, do_s, k_s, v_s, ck_s, ready, empty, zero, lse2, delta, pos_m,
                              lo + i * BLOCK_N, my_first, my_last, sm_scale2, BLOCK_N, STAGES, s_layout, a_layout)
    gl.store(DC_ROW + b * stride_lb + h * stride_lh + offs_m, dc_row, mask=mask_m)
    rows = pid_m * BLOCK_M + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, dq_layout))
    dq_ptrs = (DQ + b.to(gl.int64) * stride_dqb + h * stride_dqh + rows.to(gl.int64)[:, None] * stride_dqt
               + cols[None, :])
    gl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=(rows < t_q)[:, None])


@gluon.jit
def _query_program(H, Tq, Tk, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, HEADS_FIRST: gl.constexpr):
    """(query block, row*head, row, head, key/value head, key position of the block's first query) of
    this program; the heaviest blocks (the last: they see the most keys) are launched first."""
    if HEADS_FIRST:  # every head's heaviest blocks first
        pid_m = gl.num_programs(1) - 1 - gl.program_id(1)
        pid_bh = gl.program_id(0)
    else:
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
        pid_bh = gl.program_id(1)
    h = pid_bh % H
    return pid_m, pid_bh, pid_bh // H, h, h // GROUP, pid_m * BLOCK_M + Tk - Tq


@gluon.jit
def _kv_ring(k_desc, v_desc, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
             CONSUMERS: gl.constexpr):
    """Shared memory of the key/value ring (K and V tiles, the key bias terms, ready and empty barriers,
    initialised) and a barrier for the program's own query-side tiles."""
    k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    ck_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], vec_smem)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)  # released by every consumer warpgroup
    mbarrier.init(q_bar, count=1)
    return k_s, v_s, ck_s, ready, empty, q_bar


@gluon.jit
def gluon_dq_kernel(q_desc, do_desc, k_desc, v_desc, C, CL, LSE, DELTA, DQ, DC_ROW, RANGE, range_cols,
                    stride_dqb, stride_dqt, stride_dqh, stride_cb, stride_ch, stride_lb, stride_lh,
                    H, Tq, Tk, sm_scale, sm_scale2,
                    GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    LOADER_REGS: gl.constexpr):
    pid_m, pid_bh, b, h, hk, first = _query_program(H, Tq, Tk, GROUP, BLOCK_M, False)
    dtype: gl.constexpr = q_desc.dtype
    q_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    do_s = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], do_desc.layout)
    k_s, v_s, ck_s, ready, empty, q_bar = _kv_ring(k_desc, v_desc, BLOCK_N, HEAD_D, STAGES, 2)

    q_row = b * Tq + pid_m * BLOCK_M
    mbarrier.expect(q_bar, 2 * BLOCK_M * HEAD_D * dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(q_desc, [q_row, h * HEAD_D], q_bar, q_s)
    tma.async_copy_global_to_shared(do_desc, [q_row, h * HEAD_D], q_bar, do_s)

    ROWS: gl.constexpr = BLOCK_M // 2
    gl.warp_specialize(
        [
            (_dq_compute_partition, (C, LSE, DELTA, DQ, DC_ROW, RANGE, range_cols, q_s, do_s, k_s, v_s, ck_s, ready, empty, q_bar,
                                     b, h, pid_bh, pid_m, first, Tq, Tk, stride_dqb, stride_dqt, stride_dqh,
                                     stride_cb, stride_ch, stride_lb, stride_lh, sm_scale, sm_scale2,
                                     HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, 0, ROWS)),
            (_dq_compute_partition, (C, LSE, DELTA, DQ, DC_ROW, RANGE, range_cols, q_s, do_s, k_s, v_s, ck_s, ready, empty, q_bar,
                                     b, h, pid_bh, pid_m, first, Tq, Tk, stride_dqb, stride_dqt, stride_dqh,
                                     stride_cb, stride_ch, stride_lb, stride_lh, sm_scale, sm_scale2,
                                     HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, ROWS, ROWS)),
            (_kv_load_partition, (k_desc, v_desc, k_s, v_s, ck_s, ready, empty, C, CL, RANGE, range_cols, stride_cb, stride_ch,
                                  b, h, hk, pid_bh, pid_m, first, Tk, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


@gluon.jit
def _fwd_step(i, acc, m_i, l_i, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, start_n, my_first, my_last,
              sm_scale2, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
              o_layout: gl.constexpr, a_layout: gl.constexpr):
    """Key block ``start_n``, from ring slot ``i``: online softmax in log2 units, less each row's bias term
    (a per-row constant, which the softmax does not see; the log-sum-exp gets it back at the end)."""
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    if start_n <= my_last:  # else every key of the block lies past these rows
        k_t = k_s.index(s)
        sc = warpgroup_mma(q_s, k_t.permute((1, 0)), zero, use_acc=False, is_async=True)
        sc = _biased_scores(sc, ck_s, s, pos_m, start_n, my_first, sm_scale2, BLOCK_N, s_layout, 0)
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(k_s.dtype), a_layout), v_s.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        m_i = m_new
    ampere_mbarrier.arrive(empty.index(s))
    return acc, m_i, l_i


@gluon.jit
def _fwd_online_loop(acc, m_i, l_i, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo, n_blocks, my_first, my_last,
                     sm_scale2, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                     o_layout: gl.constexpr, a_layout: gl.constexpr):
    for i in range(0, n_blocks):
        acc, m_i, l_i = _fwd_step(i, acc, m_i, l_i, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo + i * BLOCK_N,
                                  my_first, my_last, sm_scale2, BLOCK_N, STAGES, s_layout, o_layout, a_layout)
    return acc, m_i, l_i


@gluon.jit
def _fixed_scores(sc, ck_s, s, pos_m, start_n, my_first, sm_scale2, bound, l_i, dtype: gl.constexpr,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr, a_layout: gl.constexpr, ROWWISE: gl.constexpr):
    """Key block ``start_n`` (ring slot ``s``) against the fixed bound (one for the tile, folded into the
    column term, or with ROWWISE one per row): the weights 2^(score - bound) as the A operand of the P V
    matmul, and the row sums grown by them (on the diagonal, by the rounded weights the matmul uses, so
    that a row with a few keys is as exact as in the online form)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    if ROWWISE:
        x = sc * sm_scale2 - ck_s.index(s).load(col_layout)[None, :] - bound[:, None]
    else:
        x = sc * sm_scale2 - (ck_s.index(s).load(col_layout) + bound)[None, :]
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
def _fwd_fixed_loop(acc, l_i, bound, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo, n_mine, my_first,
                    sm_scale2, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                    a_layout: gl.constexpr, ROWWISE: gl.constexpr):
    """The softmax against a fixed bound: no row maximum and no rescaling of the output, so the matmuls
    are pipelined: block i's scores are issued before block i-1's P V and its exponentials run while
    that matmul does. The first ``n_mine`` blocks of the ring (from ``lo``) are this warpgroup's."""
    dtype: gl.constexpr = k_s.dtype
    mbarrier.wait(ready.index(0), 0)
    sc = warpgroup_mma(q_s, k_s.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    sc = warpgroup_mma_wait(num_outstanding=0, deps=[sc])
    p, l_i = _fixed_scores(sc, ck_s, 0, pos_m, lo, my_first, sm_scale2, bound, l_i, dtype, BLOCK_N, s_layout,
                           a_layout, ROWWISE)
    for i in range(1, n_mine):
        s = i % STAGES
        prev = (i - 1) % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        sc = warpgroup_mma(q_s, k_s.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v_s.index(prev), acc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=1, deps=[sc])
        p_next, l_i = _fixed_scores(sc, ck_s, s, pos_m, lo + i * BLOCK_N, my_first, sm_scale2, bound, l_i, dtype,
                                    BLOCK_N, s_layout, a_layout, ROWWISE)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p])
        ampere_mbarrier.arrive(empty.index(prev))
        p = p_next
    last = (n_mine - 1) % STAGES
    acc = warpgroup_mma(p, v_s.index(last), acc, is_async=True)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p])
    ampere_mbarrier.arrive(empty.index(last))
    return acc, l_i


@gluon.jit
def _fwd_bound(q_s, kmax2, c_q2, mask_m, sm_scale2, GAP: gl.constexpr, row_layout: gl.constexpr):
    """(bound, tile_ok, row_bound, rows_ok) of this warpgroup's rows, as triton_attention._fixed_bound:
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
def _fwd_compute_partition(C, OUT, LSE, RANGE, range_cols, KMAX2, q_all, k_s, v_s, ck_s, ready, empty, q_bar,
                           b, h, hk, HKV, pid_bh, pid_m, first, t_q, t_k, stride_ob, stride_ot, stride_oh,
                           stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2,
                           HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           HAS_THRESH: gl.constexpr, ROW0: gl.constexpr, ROWS: gl.constexpr, FIXED: gl.constexpr,
                           GAP: gl.constexpr):
    """One warpgroup's share of the query block: rows [ROW0, ROW0 + ROWS). With FIXED, the softmax runs
    against a fixed bound where it is tight enough for these rows (else online)."""
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_D)
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
    lo, hi = _kept_key_range(RANGE, range_cols, pid_bh, pid_m, first, t_k, BLOCK_M, BLOCK_N, HAS_THRESH)
    n_blocks = gl.cdiv(hi - lo, BLOCK_N)
    mbarrier.wait(q_bar, 0)
    if FIXED:
        bound, tile_ok, row_bound, rows_ok = _fwd_bound(q_s, gl.load(KMAX2 + b * HKV + hk), row_term * LOG2E, mask_m,
                                                        sm_scale2, GAP, row_layout)
        # the blocks that start past these rows are only handed back
        n_mine = gl.cdiv(gl.minimum(hi, my_last + 1) - lo, BLOCK_N)
        if tile_ok:
            acc, l_i = _fwd_fixed_loop(acc, l_i, bound, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo, n_mine,
                                       my_first, sm_scale2, BLOCK_N, STAGES, s_layout, a_layout, False)
            m_i = gl.full([ROWS], 0.0, gl.float32, row_layout) + bound
        elif rows_ok:  # the gates decay too much across the tile for one bound (one more tile op)
            acc, l_i = _fwd_fixed_loop(acc, l_i, row_bound, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo,
                                       n_mine, my_first, sm_scale2, BLOCK_N, STAGES, s_layout, a_layout, True)
            m_i = row_bound
        else:
            acc, m_i, l_i = _fwd_online_loop(acc, m_i, l_i, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo,
                                             n_blocks, my_first, my_last, sm_scale2, BLOCK_N, STAGES, s_layout,
                                             o_layout, a_layout)
            n_mine = n_blocks
        for i in range(n_mine, n_blocks):
            mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
            ampere_mbarrier.arrive(empty.index(i % STAGES))
    else:
        acc, m_i, l_i = _fwd_online_loop(acc, m_i, l_i, q_s, k_s, v_s, ck_s, ready, empty, zero, pos_m, lo, n_blocks,
                                         my_first, my_last, sm_scale2, BLOCK_N, STAGES, s_layout, o_layout, a_layout)
    lse = (m_i + gl.log2(l_i)) * LN2 + row_term
    gl.store(LSE + b * stride_lb + h * stride_lh + offs_m, lse, mask=mask_m)
    rows = pid_m * BLOCK_M + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    o_ptrs = (OUT + b.to(gl.int64) * stride_ob + h * stride_oh + rows.to(gl.int64)[:, None] * stride_ot
              + cols[None, :])
    gl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=(rows < t_q)[:, None])


@gluon.jit
def gluon_fwd_kernel(q_desc, k_desc, v_desc, C, CL, OUT, LSE, RANGE, range_cols, KMAX2,
                     stride_ob, stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh,
                     H, Tq, Tk, sm_scale2,
                     GROUP: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr, FIXED: gl.constexpr, GAP: gl.constexpr, CONSUMERS: gl.constexpr,
                     HEADS_FIRST: gl.constexpr):
    """Output and log-sum-exp, BLOCK_M queries split between CONSUMERS warpgroups; with FIXED (``KMAX2``:
    the largest squared key norm per (row, key/value head)) each consumer runs its rows against a fixed
    softmax bound where one is tight enough."""
    pid_m, pid_bh, b, h, hk, first = _query_program(H, Tq, Tk, GROUP, BLOCK_M, HEADS_FIRST)
    dtype: gl.constexpr = q_desc.dtype
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    # each consumer's query rows: a (ROWS, HEAD_D) tile (TMA tiles are powers of two; BLOCK_M need not be)
    q_s = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_D], q_desc.layout)
    k_s, v_s, ck_s, ready, empty, q_bar = _kv_ring(k_desc, v_desc, BLOCK_N, HEAD_D, STAGES, CONSUMERS)

    mbarrier.expect(q_bar, BLOCK_M * HEAD_D * dtype.primitive_bitwidth // 8)
    for c in gl.static_range(CONSUMERS):
        tma.async_copy_global_to_shared(q_desc, [b * Tq + pid_m * BLOCK_M + c * ROWS, h * HEAD_D], q_bar, q_s.index(c))

    # (argument tuples spelled out per partition: a tuple built in the kernel turns constexprs into tensors)
    if CONSUMERS == 2:
        gl.warp_specialize(
            [
                (_fwd_compute_partition, (C, OUT, LSE, RANGE, range_cols, KMAX2, q_s, k_s, v_s, ck_s, ready, empty,
                                          q_bar, b, h, hk, H // GROUP, pid_bh, pid_m, first, Tq, Tk, stride_ob,
                                          stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2,
                                          HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, 0, ROWS, FIXED, GAP)),
                (_fwd_compute_partition, (C, OUT, LSE, RANGE, range_cols, KMAX2, q_s, k_s, v_s, ck_s, ready, empty,
                                          q_bar, b, h, hk, H // GROUP, pid_bh, pid_m, first, Tq, Tk, stride_ob,
                                          stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2,
                                          HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, ROWS, ROWS, FIXED, GAP)),
                (_kv_load_partition, (k_desc, v_desc, k_s, v_s, ck_s, ready, empty, C, CL, RANGE, range_cols,
                                      stride_cb, stride_ch, b, h, hk, pid_bh, pid_m, first, Tk, HEAD_D, BLOCK_M,
                                      BLOCK_N, STAGES, HAS_THRESH)),
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )
    else:
        gl.static_assert(CONSUMERS == 3, "the forward runs two or three consumer warpgroups")
        gl.warp_specialize(
            [
                (_fwd_compute_partition, (C, OUT, LSE, RANGE, range_cols, KMAX2, q_s, k_s, v_s, ck_s, ready, empty,
                                          q_bar, b, h, hk, H // GROUP, pid_bh, pid_m, first, Tq, Tk, stride_ob,
                                          stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2,
                                          HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, 0, ROWS, FIXED, GAP)),
                (_fwd_compute_partition, (C, OUT, LSE, RANGE, range_cols, KMAX2, q_s, k_s, v_s, ck_s, ready, empty,
                                          q_bar, b, h, hk, H // GROUP, pid_bh, pid_m, first, Tq, Tk, stride_ob,
                                          stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2,
                                          HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, ROWS, ROWS, FIXED, GAP)),
                (_fwd_compute_partition, (C, OUT, LSE, RANGE, range_cols, KMAX2, q_s, k_s, v_s, ck_s, ready, empty,
                                          q_bar, b, h, hk, H // GROUP, pid_bh, pid_m, first, Tq, Tk, stride_ob,
                                          stride_ot, stride_oh, stride_cb, stride_ch, stride_lb, stride_lh, sm_scale2,
                                          HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH, 2 * ROWS, ROWS, FIXED, GAP)),
                (_kv_load_partition, (k_desc, v_desc, k_s, v_s, ck_s, ready, empty, C, CL, RANGE, range_cols,
                                      stride_cb, stride_ch, b, h, hk, pid_bh, pid_m, first, Tk, HEAD_D, BLOCK_M,
                                      BLOCK_N, STAGES, HAS_THRESH)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS],
        )
