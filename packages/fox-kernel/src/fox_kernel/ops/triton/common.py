"""Device functions shared by the Triton passes: sequence bounds, program order, the bias of a key tile
and K/V tile loads."""

from __future__ import annotations

import triton
import triton.language as tl

from fox_kernel.ops.constants import LOG2E


@triton.jit
def sequence_bounds(CU, SEQ_START, b, Tq, Tk, IS_VARLEN: tl.constexpr, HAS_SEQ_START: tl.constexpr):
    """(batch row for pointers, first packed row, q length, k length, first unpadded key) of sequence ``b``."""
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
def block_and_head(HEADS_FIRST: tl.constexpr, REVERSE: tl.constexpr):
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
def segment_offset(c_ptr, anchor, seg_pos):
    """log2(e) * (c at a tile's first position - the anchor) in float32: added to the local sums it gives
    ``(c_j - anchor) * log2(e)`` for every position j of the tile, with one float64 op per tile."""
    return ((tl.load(c_ptr + seg_pos) - anchor) * LOG2E).to(tl.float32)


@triton.jit
def tile_bias(c_ptr, cl_ptr, anchor, pos, mask, tile_start):
    """``(c_pos - anchor) * log2(e)`` in float32 for positions ``pos`` of the tile starting at ``tile_start``:
    from the float32 local sums plus the tile's float64 offset, or, without local sums (``cl_ptr`` None:
    the zero-gate passes, which spare their launch), from ``c`` in float64."""
    if cl_ptr is None:
        bias = ((tl.load(c_ptr + pos, mask=mask, other=0.0) - anchor) * LOG2E).to(tl.float32)
    else:
        bias = tl.load(cl_ptr + pos, mask=mask, other=0.0) + segment_offset(c_ptr, anchor, tile_start)
    return bias


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
def kv_tiles(k_ptrs, v_ptrs, kn, mask_n, mask_d, stride_kt, stride_vt, k_desc, v_desc, row, bos, start_n, hk,
             MASKED: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The K and V tiles of key block ``start_n`` (head ``hk``): through TMA descriptors, or pointers."""
    if USE_TMA:  # Hopper tensor-memory loads; rows past the tensor's end come back as zeros
        k = k_desc.load([row, (bos + start_n).to(tl.int32), hk, 0]).reshape(BLOCK_N, BLOCK_D)
        v = v_desc.load([row, (bos + start_n).to(tl.int32), hk, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        k, v = _load_kv(k_ptrs, v_ptrs, kn, mask_n, mask_d, stride_kt, stride_vt, MASKED)
    return k, v
