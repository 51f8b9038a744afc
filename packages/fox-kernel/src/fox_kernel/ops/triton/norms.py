"""Largest row norms of q and k in one read: the inputs of the forward's fixed softmax bound and of the
pruning bound (``fox_kernel.pruning``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_kernel.ops.triton import launch


@triton.jit
def _rows_of(X, Y, OUT_X, OUT_Y, sxb, sxt, sxh, syb, syt, syh, pid_bh, HX, HY, TX, TY):
    """(first row's address, row stride, length, output, output's row) of (row, head) ``pid_bh``: heads
    [0, HX) are X's, the next HY are Y's; the output is OUT_X or OUT_Y, its row ``b * HX + h`` or
    ``b * HY + h - HX``."""
    b = pid_bh // (HX + HY)
    h = pid_bh % (HX + HY)
    if h < HX:
        base = X + b.to(tl.int64) * sxb + h * sxh
        stride_t = sxt
        t_len = TX
        out = OUT_X
        row = b * HX + h
    else:
        base = Y + b.to(tl.int64) * syb + (h - HX) * syh
        stride_t = syt
        t_len = TY
        out = OUT_Y
        row = b * HY + (h - HX)
    return base, stride_t, t_len, out, row


@triton.jit
def max_sq_norm_block(X, Y, OUT_X, OUT_Y, sxb, sxt, sxh, syb, syt, syh, pid_bh, pid_t, HX, HY, TX, TY, D,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PER_ROW: tl.constexpr):
    """Rows [pid_t * BLOCK_T, +BLOCK_T) of (row, head) ``pid_bh`` (heads of X, then of Y): OUT_X[b, h] = max
    over t of |X[b, t, h, :]|^2, OUT_Y[b, h] the same of Y (float32; atomic max of non-negative values, so
    the result does not depend on the order; the rows of X and of Y are summed by the same code, so a
    tensor's maxima do not depend on which argument it is). PER_ROW (X only, B = 1): OUT_X[t, h] =
    |X[0, t, h, :]|^2 (with B = 1 the output row is h), the same sums one by one."""
    base, stride_t, t_len, out, row = _rows_of(X, Y, OUT_X, OUT_Y, sxb, sxt, sxh, syb, syt, syh, pid_bh, HX, HY, TX, TY)
    dst = out + row
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    if pid_t * BLOCK_T < t_len:
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_t < t_len)[:, None] & (offs_d < D)[None, :]
        x = tl.load(base + offs_t.to(tl.int64)[:, None] * stride_t + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if PER_ROW:
            tl.store(OUT_X + offs_t.to(tl.int64) * HX + row, tl.sum(x * x, 1), mask=offs_t < t_len)
        else:
            tl.atomic_max(dst, tl.max(tl.sum(x * x, 1), 0))


@triton.jit
def _max_sq_norm_kernel(X, Y, OUT_X, OUT_Y, x_strides, y_strides, HX, HY, TX, TY, D, n_blocks,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PER_ROW: tl.constexpr, STRIDED: tl.constexpr):
    """``max_sq_norm_block`` per program: (row, head) on grid axis 0 (heads fastest: neighbouring programs
    read neighbouring memory), row blocks on axis 1. STRIDED (``n_blocks`` past the programs CUDA allows on
    axis 1): a program takes every ``num_programs(1)``-th block; without it the kernel has no loop (a loop
    cost 2% of GPU time at T=16k on an H200, benchmarks/norms-grid-loop-ab-h200-2026-11-29.json)."""
    sxb, sxt, sxh = x_strides
    syb, syt, syh = y_strides
    if STRIDED:
        for pid_t in range(tl.program_id(1), n_blocks, tl.num_programs(1)):
            max_sq_norm_block(X, Y, OUT_X, OUT_Y, sxb, sxt, sxh, syb, syt, syh, tl.program_id(0), pid_t, HX, HY,
                              TX, TY, D, BLOCK_T, BLOCK_D, PER_ROW)
    else:
        max_sq_norm_block(X, Y, OUT_X, OUT_Y, sxb, sxt, sxh, syb, syt, syh, tl.program_id(0), tl.program_id(1), HX,
                          HY, TX, TY, D, BLOCK_T, BLOCK_D, PER_ROW)


NORM_ROWS = 64
"""Rows of ``max_sq_row_norms`` per program."""
NORM_PARTS = 256
"""Most partial maxima per (row, head) of ``max_sq_norm_part``: past NORM_PARTS * NORM_ROWS rows a program
takes every NORM_PARTS-th block of NORM_ROWS rows."""


@triton.jit
def max_sq_norm_part(X, Y, PARTS_X, PARTS_Y, sxb, sxt, sxh, syb, syt, syh, pid_bh, pid_p, n_parts, HX, HY, TX, TY,
                     D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """``max_sq_norm_block`` without atomics: PARTS_X[b, h, pid_p] (float32 (B, HX, n_parts)) = the largest
    squared norm of the rows of X[b, :, h] in blocks pid_p, pid_p + n_parts, ... of BLOCK_T (0 where there
    is none), PARTS_Y the same of Y; (row, head) ``pid_bh`` as there. A plain store per program, so the
    outputs need no zeroing, and the maximum over the last axis is ``max_sq_norm_block``'s, bit for bit
    (the same sums, and a maximum does not depend on the order)."""
    base, stride_t, t_len, parts, row = _rows_of(X, Y, PARTS_X, PARTS_Y, sxb, sxt, sxh, syb, syt, syh, pid_bh, HX, HY,
                                                 TX, TY)
    dst = parts + row.to(tl.int64) * n_parts + pid_p
    offs_d = tl.arange(0, BLOCK_D)
    best = tl.zeros([BLOCK_T], dtype=tl.float32)
    for start in range(pid_p * BLOCK_T, t_len, n_parts * BLOCK_T):
        offs_t = start + tl.arange(0, BLOCK_T)
        mask = (offs_t < t_len)[:, None] & (offs_d < D)[None, :]
        rows = base + offs_t.to(tl.int64)[:, None] * stride_t
        x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.sum(x * x, 1))
    tl.store(dst, tl.max(best, 0))


@triton.jit
def largest_part(PARTS, row, n_parts, N: tl.constexpr):
    """The largest of PARTS[row, :n_parts] (``max_sq_norm_part``'s, n_parts <= N)."""
    offs = tl.arange(0, N)
    return tl.max(tl.load(PARTS + row * n_parts + offs, mask=offs < n_parts, other=0.0), 0)


def norm_parts(x, y=None):
    """(x's parts, y's parts or None, n_parts) of ``max_sq_norm_part``: x's (B, Hx, n_parts), y's (B, Hy,
    n_parts), views of one uninitialised buffer, n_parts = min(row blocks of the longer, NORM_PARTS)."""
    B, TX, HX, _ = x.shape
    TY, HY = (y.shape[1], y.shape[2]) if y is not None else (0, 0)
    n_parts = max(1, min(launch.cdiv(max(TX, TY), NORM_ROWS), NORM_PARTS))
    out = torch.empty(B * (HX + HY) * n_parts, dtype=torch.float32, device=x.device)
    parts_x = out[:B * HX * n_parts].view(B, HX, n_parts)
    parts_y = out[B * HX * n_parts:].view(B, HY, n_parts) if y is not None else None
    return parts_x, parts_y, n_parts


def norm_outputs(x, y=None, per_row: bool = False):
    """(x's output, y's output (x's without y)) of ``max_sq_row_norms``, zeroed (the kernel takes maxima into
    them): contiguous views of one buffer."""
    B, TX, HX, _ = x.shape
    HY = y.shape[2] if y is not None else 0
    out = torch.zeros(TX * HX if per_row else B * (HX + HY), dtype=torch.float32, device=x.device)
    out_x = out.view(TX, HX) if per_row else out[:B * HX].view(B, HX)
    out_y = out[B * HX:].view(B, HY) if y is not None else out_x
    return out_x, out_y


def max_sq_row_norms(x: torch.Tensor, y: torch.Tensor | None = None, per_row: bool = False):
    """(B, Hx) float32: the largest squared L2 norm over time of the rows of x (B, T, Hx, D). Given y
    (B, T', Hy, D), the pair (x's (B, Hx), y's (B, Hy)) from one launch that reads both. ``per_row`` (x alone,
    B = 1): (T, Hx), every row's squared norm, summed as the maxima are."""
    B, TX, HX, D = x.shape
    TY, HY = (y.shape[1], y.shape[2]) if y is not None else (0, 0)
    if per_row and (y is not None or B != 1):
        raise ValueError("per_row takes one tensor with a batch of 1")
    out_x, out_y = norm_outputs(x, y, per_row)
    y_ = y if y is not None else x
    if max(TX, TY) > 0 and B > 0:
        n_blocks = launch.cdiv(max(TX, TY), NORM_ROWS)
        launch.run(
            _max_sq_norm_kernel, (B * (HX + HY), min(n_blocks, launch.MAX_GRID_YZ)),
            x, y_, out_x, out_y, launch.strides(x), launch.strides(y_), HX, HY, TX, TY, D, n_blocks, BLOCK_T=NORM_ROWS,
            BLOCK_D=launch.block_d(D), PER_ROW=per_row, STRIDED=n_blocks > launch.MAX_GRID_YZ, num_warps=4,
        )
    return (out_x, out_y) if y is not None else out_x


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
