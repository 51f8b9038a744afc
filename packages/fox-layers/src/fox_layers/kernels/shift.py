"""Fused data-dependent token shift: out_t = a_t * prev_t + (1 - a_t) * cur_t, a_t = sigmoid(s_t) per head.

``prev_kind`` (B, T) int8 says where prev_t comes from: 0 the previous row, 1 zero (a sequence start or
padding), 2 the carried state (first token after a cache). The PyTorch twin is ``ShiftLinear``'s own code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_kernel import cdiv
from fox_layers.kernels import needs_autograd, row_tiles, row_view


@triton.jit
def _prev(CUR, STATE, kind, rows, b, offs, mask, C, stride_cur):
    prev_rows = tl.maximum(rows - 1, 0).to(tl.int64)
    prev = tl.load(CUR + prev_rows[:, None] * stride_cur + offs[None, :], mask=mask & (kind == 0)[:, None], other=0.0)
    st = tl.load(STATE + b.to(tl.int64)[:, None] * C + offs[None, :], mask=mask & (kind == 2)[:, None], other=0.0)
    return prev.to(tl.float32) + st.to(tl.float32)


@triton.jit
def _shift_fwd(CUR, S, KIND, STATE, OUT, R, T, C, HS, HD, stride_cur, stride_s, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr):
    pid_r = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    offs = h * HD + d
    mask = (rows < R)[:, None] & (d < HD)[None, :]
    kind = tl.load(KIND + rows, mask=rows < R, other=1)
    cur = tl.load(CUR + rows.to(tl.int64)[:, None] * stride_cur + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    prev = _prev(CUR, STATE, kind, rows, rows // T, offs, mask, C, stride_cur)
    a = tl.sigmoid(tl.load(S + rows.to(tl.int64) * stride_s + h, mask=rows < R, other=0.0).to(tl.float32))[:, None]
    out = a * prev + (1 - a) * cur
    tl.store(OUT + rows.to(tl.int64)[:, None] * C + offs[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _shift_bwd(CUR, S, KIND, STATE, DOUT, DCUR, DS, DSTATE, R, T, C, HS, HD, stride_cur, stride_s, stride_dout,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_r = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    offs = h * HD + d
    rmask = rows < R
    mask = rmask[:, None] & (d < HD)[None, :]
    kind = tl.load(KIND + rows, mask=rmask, other=1)
    r64 = rows.to(tl.int64)
    cur = tl.load(CUR + r64[:, None] * stride_cur + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    prev = _prev(CUR, STATE, kind, rows, rows // T, offs, mask, C, stride_cur)
    a = tl.sigmoid(tl.load(S + r64 * stride_s + h, mask=rmask, other=0.0).to(tl.float32))
    dout = tl.load(DOUT + r64[:, None] * stride_dout + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    # row r + 1 takes this row as its prev when its kind is 0
    nxt = rows + 1
    nmask = nxt < R
    kind_n = tl.load(KIND + nxt, mask=nmask, other=1)
    a_n = tl.sigmoid(tl.load(S + nxt.to(tl.int64) * stride_s + h, mask=nmask, other=0.0).to(tl.float32))
    dout_n = tl.load(DOUT + nxt.to(tl.int64)[:, None] * stride_dout + offs[None, :], mask=mask & (nmask & (kind_n == 0))[:, None],
                     other=0.0).to(tl.float32)
    dcur = (1 - a)[:, None] * dout + (a_n * (kind_n == 0).to(tl.float32))[:, None] * dout_n
    tl.store(DCUR + r64[:, None] * C + offs[None, :], dcur.to(DCUR.dtype.element_ty), mask=mask)
    ds = tl.sum(dout * (prev - cur), 1) * a * (1 - a)
    tl.store(DS + r64 * HS + h, ds, mask=rmask)
    b = rows // T
    tl.store(DSTATE + b.to(tl.int64)[:, None] * C + offs[None, :], a[:, None] * dout, mask=mask & (kind == 2)[:, None])


def _launch(C: int, HS: int) -> dict:
    block_r, block_d = row_tiles(C // HS)
    return dict(BLOCK_R=block_r, BLOCK_D=block_d)


def _forward(cur, s, kind, state, B, T, C):
    """out (B, T, C) for rows cur (B * T, C) and s (B * T, HS) (any row strides), state (B, C)."""
    HS = s.shape[-1]
    out = torch.empty(B, T, C, dtype=cur.dtype, device=cur.device)
    meta = _launch(C, HS)
    if B * T:
        _shift_fwd[(cdiv(B * T, meta["BLOCK_R"]), HS)](cur, s, kind, state, out, B * T, T, C, HS, C // HS,
                                                       cur.stride(0), s.stride(0), **meta)
    return out


class _ShiftMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cur, s, kind, st):
        B, T, C = cur.shape
        # slices of a fused projection are read in place and kept as copies (see norm_gate)
        keep = any(ctx.needs_input_grad)
        cur_r, s_r = row_view(cur, own=keep), row_view(s, own=keep)
        out = _forward(cur_r, s_r, kind, st, B, T, C)
        ctx.save_for_backward(cur_r, s_r, kind, st)
        ctx.meta = (B, T, s.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        cur, s, kind, st = ctx.saved_tensors
        B, T, s_dtype = ctx.meta
        C = cur.shape[-1]
        HS = s.shape[-1]
        dout = row_view(dout)
        dcur = torch.empty(B, T, C, dtype=cur.dtype, device=cur.device)
        ds = torch.empty(B, T, HS, dtype=torch.float32, device=s.device)
        dstate = torch.zeros(B, C, dtype=torch.float32, device=cur.device)
        meta = _launch(C, HS)
        if B * T:
            _shift_bwd[(cdiv(B * T, meta["BLOCK_R"]), HS)](
                cur, s, kind, st, dout, dcur, ds, dstate, B * T, T, C, HS, C // HS, cur.stride(0), s.stride(0),
                dout.stride(0), **meta)
        return dcur, ds.to(s_dtype), None, dstate.to(st.dtype) if ctx.needs_input_grad[3] else None


def prev_kind(B: int, T: int, device, state, seq_start, cu_seqlens, past: int) -> torch.Tensor:
    """(B, T) int8: 0 previous row, 1 zero, 2 carried state (see the module docstring)."""
    kind = torch.zeros(B, T, dtype=torch.int8, device=device)
    kind[:, 0] = 1 if state is None else 2
    if seq_start is not None:
        pos = torch.arange(past, past + T, device=device)
        padded_prev = (pos[None, :] - 1) < seq_start[:, None]  # the previous position is padding (or t is)
        kind = torch.where(padded_prev & ~((kind == 2) & (pos[None, :] - 1 >= seq_start[:, None])),
                           torch.ones_like(kind), kind)
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].long()
        kind[:, starts[starts < T]] = 1
    return kind


def shift_mix(cur, s, state, seq_start, cu_seqlens, past: int):
    """cur (B, T, C), s (B, T, H) shift logits, state (B, C) or None -> (B, T, C)."""
    B, T, _ = cur.shape
    kind = prev_kind(B, T, cur.device, state, seq_start, cu_seqlens, past)
    st = state.contiguous() if state is not None else cur.new_zeros(B, cur.shape[-1])  # read where kind is 2
    if needs_autograd(cur, s, state):
        return _ShiftMix.apply(cur, s, kind, st)
    return _forward(row_view(cur), row_view(s), kind, st, B, T, cur.shape[-1])
