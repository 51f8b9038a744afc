"""Largest row norms of q and k in one read: the inputs of the forward's fixed softmax bound and of the
pruning bound (``fox_kernel.pruning``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_kernel.ops.triton import launch


@triton.jit
def max_sq_norm_block(X, Y, OUT_X, OUT_Y, sxb, sxt, sxh, syb, syt, syh, pid_bh, pid_t, HX, HY, TX, TY, D,
                      BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PER_ROW: tl.constexpr):
    """Rows [pid_t * BLOCK_T, +BLOCK_T) of (row, head) ``pid_bh`` (heads of X, then of Y): OUT_X[b, h] = max
    over t of |X[b, t, h, :]|^2, OUT_Y[b, h] the same of Y (float32; atomic max of non-negative values, so
    the result does not depend on the order; the rows of X and of Y are summed by the same code, so a
    tensor's maxima do not depend on which argument it is). PER_ROW (X only, B = 1): OUT_X[t, h] =
    |X[0, t, h, :]|^2, the same sums one by one."""
    b = pid_bh // (HX + HY)
    h = pid_bh % (HX + HY)
    if h < HX:
        base = X + b.to(tl.int64) * sxb + h * sxh
        stride_t = sxt
        t_len = TX
        dst = OUT_X + b * HX + h
    else:
        base = Y + b.to(tl.int64) * syb + (h - HX) * syh
        stride_t = syt
        t_len = TY
        dst = OUT_Y + b * HY + (h - HX)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    if pid_t * BLOCK_T < t_len:
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_t < t_len)[:, None] & (offs_d < D)[None, :]
        x = tl.load(base + offs_t.to(tl.int64)[:, None] * stride_t + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if PER_ROW:
            tl.store(OUT_X + offs_t.to(tl.int64) * HX + h, tl.sum(x * x, 1), mask=offs_t < t_len)
        else:
            tl.atomic_max(dst, tl.max(tl.sum(x * x, 1), 0))


@triton.jit
def _max_sq_norm_kernel(X, Y, OUT_X, OUT_Y, x_strides, y_strides, HX, HY, TX, TY, D,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PER_ROW: tl.constexpr):
    """``max_sq_norm_block`` per program: (row, head) on grid axis 0 (heads fastest: neighbouring programs
    read neighbouring memory), row blocks on axis 1."""
    sxb, sxt, sxh = x_strides
    syb, syt, syh = y_strides
    max_sq_norm_block(X, Y, OUT_X, OUT_Y, sxb, sxt, sxh, syb, syt, syh, tl.program_id(0), tl.program_id(1), HX, HY,
                      TX, TY, D, BLOCK_T, BLOCK_D, PER_ROW)


NORM_ROWS = 64
"""Rows of ``max_sq_row_norms`` per program."""


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
        launch.run(
            _max_sq_norm_kernel, (B * (HX + HY), launch.cdiv(max(TX, TY), NORM_ROWS)),
            x, y_, out_x, out_y, launch.strides(x), launch.strides(y_), HX, HY, TX, TY, D, BLOCK_T=NORM_ROWS,
            BLOCK_D=launch.block_d(D), PER_ROW=per_row, num_warps=4,
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
