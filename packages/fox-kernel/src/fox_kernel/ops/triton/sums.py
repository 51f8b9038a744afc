"""The small kernels around the attention passes: prefix sums of the gates (``c``), their tile-local
float32 form, the backward's row dots ``delta`` and the gate gradient (suffix sums of ``dc``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_kernel.ops import zero_flags
from fox_kernel.ops.constants import LOG2E
from fox_kernel.ops.gates import gate_grad_from_dc
from fox_kernel.ops.triton import launch
from fox_kernel.ops.triton.common import sequence_bounds


@triton.jit
def _later(a, b):
    return tl.maximum(a, b)


@triton.jit
def prefix_sums_row(LF, SEQ_START, C, Z, FLAG, stride_lb, stride_lt, stride_lh, pid, H, T,
                    HAS_SEQ_START: tl.constexpr, ZEROS: tl.constexpr, BLOCK: tl.constexpr):
    """c (B, H, T) float64 = cumsum of log f (B, T, H) over T, zero before ``seq_start``, of (row, head)
    ``pid``: T scanned in BLOCK-long chunks, carrying the float64 running sum. With ZEROS a gate of exactly 0
    (log -inf) adds 0 to ``c`` and Z (B, H, T) int32 receives, per position, the last position at or before
    it holding such a gate (0 if none): the first key that position's query may see; where the row has
    such a gate past position 0, FLAG (one int64, see ``ops/zero_flags.py``) receives -1."""
    b = pid // H
    h = pid % H
    src = LF + b.to(tl.int64) * stride_lb + h * stride_lh
    dst = C + pid.to(tl.int64) * T
    _, _, _, _, s0 = sequence_bounds(None, SEQ_START, b, T, T, False, HAS_SEQ_START)
    running = tl.zeros([], dtype=tl.float64)
    last_zero = tl.zeros([], dtype=tl.int32)
    for start in range(0, T, BLOCK):
        t = start + tl.arange(0, BLOCK)
        x = tl.load(src + t.to(tl.int64) * stride_lt, mask=(t < T) & (t >= s0), other=0.0).to(tl.float64)
        if ZEROS:
            zero = x == float("-inf")
            x = tl.where(zero, 0.0, x)
            seen = tl.maximum(tl.associative_scan(tl.where(zero, t, 0), 0, _later), last_zero)
            tl.store(Z + pid.to(tl.int64) * T + t, seen, mask=t < T)
            last_zero = tl.max(seen, 0)
        tl.store(dst + t, tl.cumsum(x, 0) + running, mask=t < T)
        running += tl.sum(x, 0)
    if ZEROS:  # noqa: SIM102 (a compile-time test, then a run-time one)
        if last_zero > 0:
            tl.store(FLAG, -1)


@triton.jit
def _prefix_sums_kernel(LF, SEQ_START, C, Z, FLAG, lf_strides, H, T, HAS_SEQ_START: tl.constexpr,
                        ZEROS: tl.constexpr, BLOCK: tl.constexpr):
    """``prefix_sums_row`` per program, one per (row, head)."""
    stride_lb, stride_lt, stride_lh = lf_strides
    prefix_sums_row(LF, SEQ_START, C, Z, FLAG, stride_lb, stride_lt, stride_lh, tl.program_id(0), H, T,
                    HAS_SEQ_START, ZEROS, BLOCK)


@triton.jit
def _gate_grad_kernel(DC, DC_ROW, SEQ_START, OUT, out_strides, H, Tq, Tk, HAS_SEQ_START: tl.constexpr,
                      BLOCK: tl.constexpr):
    """d log f (B, Tk, H) float32 = the suffix sums over keys of dc (B, H, Tk) plus the row term dc_row
    (B, H, Tq, on the last Tq keys), in float64, zero before ``seq_start``: one program per (row, head)
    scans from the end in BLOCK-long chunks."""
    stride_ob, stride_ot, stride_oh = out_strides
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    dc = DC + pid.to(tl.int64) * Tk
    dc_row = DC_ROW + pid.to(tl.int64) * Tq
    dst = OUT + b.to(tl.int64) * stride_ob + h * stride_oh
    _, _, _, _, s0 = sequence_bounds(None, SEQ_START, b, Tk, Tk, False, HAS_SEQ_START)
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


def scan_block(T: int) -> int:
    """Positions per chunk of the prefix and suffix sums' scans."""
    return 16 if launch.INTERPRET else min(2048, max(16, launch.next_power_of_2(T)))


def prefix_sums(log_fgate: torch.Tensor, seq_start: torch.Tensor | None, zeros: bool = False):
    """c = cumsum(log f) in float64, laid out (B, H, T), gates before ``seq_start`` zeroed, in one launch
    (a float64 cast and torch's cumsum were two, and that cumsum over a few long rows ran ~40 us at
    T=16k, H=12 on an H200). With ``zeros``: (c, z, ticket), gates of exactly 0 counted as 0 in ``c``,
    ``z`` (B, H, T) int32 the last such gate at or before each position (``ops/dispatch.py``) and the
    kernel's report of whether there was one (``zero_flags.ZeroGateTicket``)."""
    B, T, H = log_fgate.shape
    c = torch.empty(B, H, T, dtype=torch.float64, device=log_fgate.device)
    z = torch.empty(B, H, T, dtype=torch.int32, device=log_fgate.device) if zeros else None
    seen = zero_flags.ticket(log_fgate.device) if zeros else None
    if B * H and T:
        launch.run(_prefix_sums_kernel, (B * H,), log_fgate, seq_start, c, z, seen and seen.flag,
                   launch.strides(log_fgate), H, T, HAS_SEQ_START=seq_start is not None, ZEROS=zeros,
                   BLOCK=scan_block(T), num_warps=4)
    if seen is not None:
        seen.launched()
    return (c, z, seen) if zeros else c


def suffix_sums(dc: torch.Tensor, dc_row: torch.Tensor, seq_start: torch.Tensor | None) -> torch.Tensor:
    """``gates.gate_grad_from_dc(dc + dc_row on the last Tq keys)`` for fixed-length batches in one launch,
    written as a contiguous (B, Tk, H) tensor (it took seven: add, casts, flips, cumsum, copy)."""
    B, H, Tk = dc.shape
    Tq = dc_row.shape[-1]
    out = torch.empty(B, Tk, H, dtype=torch.float32, device=dc.device)
    if B * H and Tk:
        launch.run(_gate_grad_kernel, (B * H,), dc, dc_row, seq_start, out, launch.strides(out), H, Tq, Tk,
                   HAS_SEQ_START=seq_start is not None, BLOCK=scan_block(Tk), num_warps=4)
    return out


def gate_grad(dc, dc_row, seq_start, cu_seqlens):
    """d log f (B, Tk, H) from the column term ``dc`` (B, H, Tk) and the row term ``dc_row`` (B, H, Tq) of
    the gradient of ``c``. The row term (d score_ij / d c_i = 1) vanishes in exact arithmetic but cancels
    the rounding of delta (computed from the stored, rounded output); without it that error piles up in
    the suffix sums."""
    if cu_seqlens is None:
        return suffix_sums(dc, dc_row, seq_start)
    dc[..., dc.shape[-1] - dc_row.shape[-1] :] += dc_row
    return gate_grad_from_dc(dc, seq_start, cu_seqlens)


@triton.jit
def local_sums_segment(C, CU, OUT, stride_cb, stride_ch, pid_s, pid_bh, H, T, origin, IS_VARLEN: tl.constexpr,
                       SEG: tl.constexpr):
    """``(c_p - c_a) * log2(e)`` in float32 for segment ``pid_s`` of (row, head) ``pid_bh``, ``a`` the start
    of ``p``'s segment: segments (a pass's tiles) start at ``origin + k * SEG`` of each sequence (positions
    before ``origin`` take position 0, in segment 0)."""
    b = pid_bh // H
    h = pid_bh % H
    row, bos, t, _, _ = sequence_bounds(CU, None, b, T, T, IS_VARLEN, False)
    start = origin + (pid_s - 1) * SEG
    if start < t:
        pos = start + tl.arange(0, SEG)
        mask = (pos >= 0) & (pos < t)
        base = row * stride_cb + h * stride_ch + bos
        a = tl.load(C + base + tl.maximum(start, 0))
        x = tl.load(C + base + pos, mask=mask, other=0.0)
        tl.store(OUT + base + pos, ((x - a) * LOG2E).to(tl.float32), mask=mask)


@triton.jit
def _local_sums_kernel(C, CU, OUT, c_strides, H, T, origin, IS_VARLEN: tl.constexpr, SEG: tl.constexpr):
    """``local_sums_segment`` per program: segments on grid axis 0, (row, head) on axis 1."""
    stride_cb, stride_ch = c_strides
    local_sums_segment(C, CU, OUT, stride_cb, stride_ch, tl.program_id(0), tl.program_id(1), H, T, origin,
                       IS_VARLEN, SEG)


def local_sums_grid(t: int, seg: int, origin: int = 0) -> int:
    """Programs per (row, head) of ``local_sums`` over ``t`` positions: segment 0 holds those before
    ``origin``."""
    return launch.cdiv(max(t - origin, 0), seg) + 1


def local_sums(c, cu_seqlens, n_rows, t_max, seg, origin=0):
    """The prefix sums as float32 offsets from the start of their ``seg``-long tile, times log2(e): the
    kernels add one float64 offset per tile to them instead of converting every float64 ``c_j``
    (float64 subtraction and conversion per score column cost up to 10% of the forward at D=128)."""
    out = torch.empty_like(c, dtype=torch.float32)  # same strides: the kernels index both alike
    H = c.shape[1]
    t = c.shape[-1] if cu_seqlens is None else t_max  # keys of the longest sequence
    for r0, r1 in launch.row_parts(n_rows, H):  # (row, head) pairs on grid axis 1
        # a part of the batch is a view (same strides), of packed sequences its slice of cu_seqlens
        cc, oo, cu = (c[r0:r1], out[r0:r1], None) if cu_seqlens is None else (c, out, cu_seqlens[r0:r1 + 1])
        launch.run(_local_sums_kernel, (local_sums_grid(t, seg, origin), (r1 - r0) * H), cc, cu, oo,
                   launch.strides(c, 2), H, c.shape[-1], origin, IS_VARLEN=cu_seqlens is not None, SEG=seg,
                   num_warps=4)
    return out


@triton.jit
def delta_rows(O, DO, DELTA, stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh, pid_m, pid_bh, H, T, D,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta_i = sum_d o_id * do_id (float32) of rows [pid_m * BLOCK_M, +BLOCK_M) of (row, head) ``pid_bh``,
    written as (B, H, T)."""
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
def _delta_kernel(O, DO, DELTA, o_strides, do_strides, H, T, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """``delta_rows`` per program: row blocks on grid axis 0, (row, head) on axis 1."""
    stride_ob, stride_ot, stride_oh = o_strides
    stride_db, stride_dt, stride_dh = do_strides
    delta_rows(O, DO, DELTA, stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh, tl.program_id(0),
               tl.program_id(1), H, T, D, BLOCK_M, BLOCK_D)


DELTA_ROWS = 64
"""Rows of ``delta`` per program."""


def delta(out: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """(B, H, Tq) float32: delta_i = sum_d o_id * do_id, the softmax backward's row term."""
    B, Tq, H, D = out.shape
    result = torch.empty(B, H, Tq, dtype=torch.float32, device=out.device)
    for b0, b1 in launch.row_parts(B, H):  # (row, head) pairs on grid axis 1
        launch.run(_delta_kernel, (launch.cdiv(Tq, DELTA_ROWS), (b1 - b0) * H), out[b0:b1], do[b0:b1],
                   result[b0:b1], launch.strides(out), launch.strides(do), H, Tq, D, BLOCK_M=DELTA_ROWS,
                   BLOCK_D=launch.block_d(D))
    return result
