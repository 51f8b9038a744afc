"""Fused data-dependent token shift: out_t = a_t * prev_t + (1 - a_t) * cur_t, a_t = sigmoid(s_t) per head.

``prev_kind`` (B, T) int8 says where prev_t comes from: 0 the previous row, 1 zero (a sequence start or
padding), 2 the carried state (first token after a cache). The PyTorch twin is ``ShiftLinear``'s own code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prev(CUR, STATE, kind, rows, b, offs, mask, C):
    prev_rows = tl.maximum(rows - 1, 0).to(tl.int64)
    prev = tl.load(CUR + prev_rows[:, None] * C + offs[None, :], mask=mask & (kind == 0)[:, None], other=0.0)
    st = tl.load(STATE + b.to(tl.int64)[:, None] * C + offs[None, :], mask=mask & (kind == 2)[:, None], other=0.0)
    return prev.to(tl.float32) + st.to(tl.float32)


@triton.jit
def _shift_fwd(CUR, S, KIND, STATE, OUT, R, T, C, HS, HD, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_r = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    offs = h * HD + d
    mask = (rows < R)[:, None] & (d < HD)[None, :]
    kind = tl.load(KIND + rows, mask=rows < R, other=1)
    cur = tl.load(CUR + rows.to(tl.int64)[:, None] * C + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    prev = _prev(CUR, STATE, kind, rows, rows // T, offs, mask, C)
    a = tl.sigmoid(tl.load(S + rows.to(tl.int64) * HS + h, mask=rows < R, other=0.0).to(tl.float32))[:, None]
    out = a * prev + (1 - a) * cur
    tl.store(OUT + rows.to(tl.int64)[:, None] * C + offs[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _shift_bwd(CUR, S, KIND, STATE, DOUT, DCUR, DS, DSTATE, R, T, C, HS, HD,
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
    cur = tl.load(CUR + r64[:, None] * C + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    prev = _prev(CUR, STATE, kind, rows, rows // T, offs, mask, C)
    a = tl.sigmoid(tl.load(S + r64 * HS + h, mask=rmask, other=0.0).to(tl.float32))
    dout = tl.load(DOUT + r64[:, None] * C + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    # row r + 1 takes this row as its prev when its kind is 0
    nxt = rows + 1
    nmask = nxt < R
    kind_n = tl.load(KIND + nxt, mask=nmask, other=1)
    a_n = tl.sigmoid(tl.load(S + nxt.to(tl.int64) * HS + h, mask=nmask, other=0.0).to(tl.float32))
    dout_n = tl.load(DOUT + nxt.to(tl.int64)[:, None] * C + offs[None, :], mask=mask & (nmask & (kind_n == 0))[:, None],
                     other=0.0).to(tl.float32)
    dcur = (1 - a)[:, None] * dout + (a_n * (kind_n == 0).to(tl.float32))[:, None] * dout_n
    tl.store(DCUR + r64[:, None] * C + offs[None, :], dcur.to(DCUR.dtype.element_ty), mask=mask)
    ds = tl.sum(dout * (prev - cur), 1) * a * (1 - a)
    tl.store(DS + r64 * HS + h, ds, mask=rmask)
    b = rows // T
    tl.store(DSTATE + b.to(tl.int64)[:, None] * C + offs[None, :], a[:, None] * dout, mask=mask & (kind == 2)[:, None])


class _ShiftMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cur, s, kind, state):
        B, T, C = cur.shape
        HS = s.shape[-1]
        HD = C // HS
        cur_c, s_c = cur.contiguous(), s.contiguous()
        st = state.contiguous() if state is not None else cur_c.new_zeros(B, C)
        out = torch.empty_like(cur_c)
        block_d = max(16, triton.next_power_of_2(HD))
        block_r = max(1, min(64, 4096 // block_d))
        grid = (triton.cdiv(B * T, block_r), HS)
        _shift_fwd[grid](cur_c, s_c, kind, st, out, B * T, T, C, HS, HD, BLOCK_R=block_r, BLOCK_D=block_d)
        ctx.save_for_backward(cur_c, s_c, kind, st)
        ctx.meta = (block_r, block_d, state is not None)
        return out

    @staticmethod
    def backward(ctx, dout):
        cur, s, kind, st = ctx.saved_tensors
        block_r, block_d, has_state = ctx.meta
        B, T, C = cur.shape
        HS = s.shape[-1]
        dcur = torch.empty_like(cur)
        ds = torch.empty(s.shape, dtype=torch.float32, device=s.device)
        dstate = torch.zeros(B, C, dtype=torch.float32, device=cur.device)
        grid = (triton.cdiv(B * T, block_r), HS)
        _shift_bwd[grid](cur, s, kind, st, dout.contiguous(), dcur, ds, dstate, B * T, T, C, HS, C // HS,
                         BLOCK_R=block_r, BLOCK_D=block_d)
        return dcur, ds.to(s.dtype), None, dstate.to(st.dtype) if has_state else None


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
    return _ShiftMix.apply(cur, s, kind, state)
