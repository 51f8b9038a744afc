"""What the Gluon dQ pass and forward share: a query tile is BLOCK_M queries of one head and the key blocks
they see (a dQ program owns one; a forward program takes tiles until none is left, see ``fwd``); a loader
partition streams K and V tiles (and each key block's column term of the bias) through a ring of
shared-memory slots, consumer warpgroups own the query rows. Same bias split as
the Triton passes: measured from ``c`` at the query block's first position, keys through the float32
local sums of BLOCK_N-long tiles plus one float64 offset per tile. Also the TMA reduction and the wgmma
layout that the dK/dV pass uses.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait

from fox_kernel.ops.constants import LOG2E

# TMA tile loads: ``async_load`` from Triton 3.8 on (3.9's ``async_copy_global_to_shared`` only raises)
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
# a barrier of the calling warps (the partition's, inside warp_specialize): ``barrier`` from Triton 3.7 on
thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

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
def wgmma_layout(n):
    """Register layout of a one-warpgroup wgmma accumulator with ``n`` columns."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def kept_key_range(RANGE, range_cols, pid_bh, pid_m, first, t_k, window, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, HAS_THRESH: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Key blocks seen by the query block whose first row sits at key position ``first``: [lo, hi); with
    pruning, those before lo are seen through a negligible decay (see triton.ranges.kept_ranges); with a
    sliding window of ``window`` keys, those before the first row's window are not seen at all."""
    hi = gl.minimum(first + BLOCK_M, t_k)
    if HAS_THRESH:
        lo = (gl.load(RANGE + pid_bh.to(gl.int64) * range_cols + pid_m) // BLOCK_N) * BLOCK_N
    else:
        lo = 0
    if HAS_WINDOW:
        lo = gl.maximum(lo, (gl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N)
    return lo, hi


@gluon.jit
def kv_load_tile(k_desc, v_desc, k_s, v_s, ck_s, ready, empty, C, CL, RANGE, range_cols, stride_cb, stride_ch,
                 b, h, hk, pid_bh, pid_m, first, t_k, window, it0, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_THRESH: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Fills the ring for one query block: per key block, the K and V tiles (TMA) and log2(e) * (c_j -
    c_first) of its keys, into the ring's slots from its ``it0``-th use on. Returns the next use's number."""
    vec_layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
    nbytes: gl.constexpr = 2 * BLOCK_N * HEAD_D * k_desc.dtype.primitive_bitwidth // 8
    c_ptr = C + b * stride_cb + h * stride_ch
    cl_ptr = CL + b * stride_cb + h * stride_ch
    anchor = gl.load(c_ptr + first)
    lo, hi = kept_key_range(RANGE, range_cols, pid_bh, pid_m, first, t_k, window, BLOCK_M, BLOCK_N, HAS_THRESH,
                            HAS_WINDOW)
    n_blocks = gl.cdiv(hi - lo, BLOCK_N)
    for i in range(0, n_blocks):
        start_n = lo + i * BLOCK_N
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=vec_layout)
        c_k2 = gl.load(cl_ptr + offs_n, mask=offs_n < t_k, other=0.0)
        seg = ((gl.load(c_ptr + start_n) - anchor) * LOG2E).to(gl.float32)
        u = it0 + i
        s = u % STAGES
        mbarrier.wait(empty.index(s), ((u // STAGES) & 1) ^ 1)
        ck_s.index(s).store(c_k2 + seg)
        thread_barrier()
        mbarrier.expect(ready.index(s), nbytes)
        row = b * t_k + start_n
        tma_load(k_desc, [row, hk * HEAD_D], ready.index(s), k_s.index(s))
        tma_load(v_desc, [row, hk * HEAD_D], ready.index(s), v_s.index(s))
    return it0 + n_blocks


@gluon.jit
def kv_load_partition(k_desc, v_desc, k_s, v_s, ck_s, ready, empty, C, CL, RANGE, range_cols, stride_cb, stride_ch,
                      b, h, hk, pid_bh, pid_m, first, t_k, window, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_THRESH: gl.constexpr,
                      HAS_WINDOW: gl.constexpr):
    """The loader of a program that owns one query block (``kv_load_tile`` from the ring's first use)."""
    kv_load_tile(k_desc, v_desc, k_s, v_s, ck_s, ready, empty, C, CL, RANGE, range_cols, stride_cb, stride_ch,
                 b, h, hk, pid_bh, pid_m, first, t_k, window, 0, HEAD_D, BLOCK_M, BLOCK_N, STAGES, HAS_THRESH,
                 HAS_WINDOW)


@gluon.jit
def block_seen(start_n, my_first, my_last, window, BLOCK_N: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Whether some row of the query block (key positions ``my_first``..``my_last``) sees a key of block
    ``start_n``: not when every key lies past the last row, nor, with a window, before every row's window."""
    seen = start_n <= my_last
    if HAS_WINDOW:
        seen = seen & (start_n + BLOCK_N > my_first - window + 1)
    return seen


@gluon.jit
def window_mask(x, pos_m, start_n, my_last, window, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                HAS_WINDOW: gl.constexpr):
    """``x`` (rows at key positions ``pos_m``, the last ``my_last``; key block ``start_n``) with the keys
    before each row's sliding window set to -inf, where the block reaches before some row's window."""
    if HAS_WINDOW:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if start_n <= my_last - window:
            offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            x = gl.where(offs_n[None, :] > pos_m[:, None] - window, x, float("-inf"))
    return x


@gluon.jit
def biased_scores(sc, ck_s, s, pos_m, start_n, my_first, my_last, window, sm_scale2, BLOCK_N: gl.constexpr,
                  s_layout: gl.constexpr, PENDING: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """The scores of key block ``start_n`` (ring slot ``s``) in log2 units less the rows' bias term: waits
    for the asynchronous ``sc = Q K^T`` (leaving the PENDING wgmma issued after it in flight), scales it,
    takes off the keys' bias term and, on the diagonal, masks the keys past each row (with a window, also
    those before it)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    c_k2 = ck_s.index(s).load(col_layout)
    sc = warpgroup_mma_wait(num_outstanding=PENDING, deps=[sc])
    sc = sc * sm_scale2 - c_k2[None, :]
    if start_n + BLOCK_N - 1 > my_first:  # the diagonal (past the keys' end too: pos_m < t_k)
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=col_layout)
        sc = gl.where(offs_n[None, :] <= pos_m[:, None], sc, float("-inf"))
    return window_mask(sc, pos_m, start_n, my_last, window, BLOCK_N, s_layout, HAS_WINDOW)


@gluon.jit
def tile_rank(idx, n_blk, n_bh, heads_per_group):
    """(rank, row*head) of tile ``idx`` in launch order, over ``n_blk`` blocks of each of ``n_bh`` (row, head)
    pairs, rank 0 the heaviest block: heads taken in groups of ``heads_per_group``, and within a group every
    head's rank-0 block first, then every head's rank 1, and so on. Groups of one head launch one head's
    blocks after another (its programs share its tiles in L2); one group of all heads launches every head's
    heaviest blocks first (the shortest tail)."""
    span = heads_per_group * n_blk
    group = idx // span
    first_bh = group * heads_per_group
    size = gl.minimum(heads_per_group, n_bh - first_bh)
    rest = idx - group * span
    return rest // size, first_bh + rest % size


@gluon.jit
def program_tile(n_blk, heads_per_group):
    """``tile_rank`` of this program of a one-axis grid with one program per tile."""
    return tile_rank(gl.program_id(0), n_blk, gl.num_programs(0) // n_blk, heads_per_group)


@gluon.jit
def query_tile(idx, n_bh, heads_per_group, H, Tq, Tk, GROUP: gl.constexpr, BLOCK_M: gl.constexpr):
    """(query block, row*head, row, head, key/value head, key position of the block's first query) of
    query tile ``idx``; the heaviest blocks (the last: they see the most keys) come first, in the order of
    ``tile_rank``."""
    n_blk = gl.cdiv(Tq, BLOCK_M)
    rank, pid_bh = tile_rank(idx, n_blk, n_bh, heads_per_group)
    pid_m = n_blk - 1 - rank
    h = pid_bh % H
    return pid_m, pid_bh, pid_bh // H, h, h // GROUP, pid_m * BLOCK_M + Tk - Tq


@gluon.jit
def query_program(H, Tq, Tk, GROUP: gl.constexpr, BLOCK_M: gl.constexpr, heads_per_group):
    """``query_tile`` of this program of a one-axis grid with one program per query tile."""
    n_bh = gl.num_programs(0) // gl.cdiv(Tq, BLOCK_M)
    return query_tile(gl.program_id(0), n_bh, heads_per_group, H, Tq, Tk, GROUP, BLOCK_M)


@gluon.jit
def kv_ring(k_desc, v_desc, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
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


