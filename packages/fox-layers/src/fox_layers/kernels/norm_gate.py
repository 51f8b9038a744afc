"""Per-head RMSNorm times weight times an activated gate, in one pass: ``rms_norm(x) * w * act(g)``.

The FoX (Pro) output path and QK-norm, and (one group, no gate) the blocks' RMSNorm. The PyTorch twin
(``norm_gate_reference``) is what runs on the CPU and what the Triton kernel is tested against; on CUDA the
fused kernel saves the float32 intermediates.

Each program normalises a tile of ``BLOCK_N`` rows of one group: a group of a head (64 channels) is too
small a job for a program of its own (one program per row ran at about a tenth of the memory bandwidth).
Rows are read with their own stride, so the slices of a fused projection's output are read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_kernel import cdiv
from fox_layers.checks import require_int
from fox_layers.kernels import needs_autograd, row_tiles, row_view, use_triton


@triton.jit
def _act(g, ACT: tl.constexpr):
    s = tl.sigmoid(g)
    if ACT == "silu":
        return g * s, s * (1 + g * (1 - s))
    return s, s * (1 - s)


@triton.jit
def _tile(N, Dg, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SHARED: tl.constexpr):
    """The program's rows (int64), its group's columns and their mask, the tile's mask and the weight's
    offsets."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    cols = tl.program_id(1) * Dg + d
    dmask = d < Dg
    mask = (rows < N)[:, None] & dmask[None, :]
    return rows.to(tl.int64), cols, dmask, mask, d if SHARED else cols


@triton.jit
def _norm_gate_fwd(X, W, G, Y, RSTD, N, NG, Dg, stride_x, stride_g, eps, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, SHARED: tl.constexpr, HAS_GATE: tl.constexpr, ACT: tl.constexpr):
    rows, cols, dmask, mask, w_off = _tile(N, Dg, BLOCK_N, BLOCK_D, SHARED)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / Dg + eps)
    w = tl.load(W + w_off, mask=dmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    if HAS_GATE:
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a, _ = _act(g, ACT)
        y = y * a
    tl.store(Y + rows[:, None] * (NG * Dg) + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows * NG + tl.program_id(1), rstd, mask=rows < N)


@triton.jit
def _norm_gate_bwd(X, W, G, DY, RSTD, DX, DG, DW_PART, N, NG, Dg, stride_x, stride_g, stride_dy,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SHARED: tl.constexpr, HAS_GATE: tl.constexpr,
                   ACT: tl.constexpr):
    rows, cols, dmask, mask, w_off = _tile(N, Dg, BLOCK_N, BLOCK_D, SHARED)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows * NG + tl.program_id(1), mask=rows < N, other=0.0)
    w = tl.load(W + w_off, mask=dmask, other=0.0).to(tl.float32)
    xhat = x * rstd[:, None]
    out = rows[:, None] * (NG * Dg) + cols[None, :]
    if HAS_GATE:
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a, da = _act(g, ACT)
        tl.store(DG + out, (dy * xhat * w[None, :] * da).to(DG.dtype.element_ty), mask=mask)
        dy = dy * a
    # the weight's gradient, summed over this tile's rows (the host sums the tiles)
    tl.store(DW_PART + tl.program_id(0).to(tl.int64) * NG * Dg + cols, tl.sum(dy * xhat, 0), mask=dmask)
    dxhat = dy * w[None, :]
    dx = rstd[:, None] * (dxhat - xhat * (tl.sum(dxhat * xhat, 1) / Dg)[:, None])
    tl.store(DX + out, dx.to(DX.dtype.element_ty), mask=mask)


def norm_gate_reference(x, weight, gate, num_groups: int, eps: float, act: str = "sigmoid"):
    """PyTorch twin: x, gate (..., G * Dg); weight (G * Dg,) or (Dg,) shared by the groups."""
    shape = x.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    xg = x.reshape(*shape[:-1], num_groups, shape[-1] // num_groups).to(acc)  # -1 is ambiguous for 0 rows
    w = weight.to(acc) if weight.numel() == xg.shape[-1] else weight.to(acc).view(num_groups, -1)
    y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps) * w).reshape(shape)
    if gate is not None:
        g = gate.to(acc)
        y = y * (torch.sigmoid(g) if act == "sigmoid" else torch.nn.functional.silu(g))
    return y.to(x.dtype)


def _launch(Dg: int) -> dict:
    """Tile and warps: about 4k elements per program."""
    block_n, block_d = row_tiles(Dg)
    return dict(BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4 if block_n * block_d <= 4096 else 8)


def _forward(x2, weight, g2, num_groups, eps, act):
    """y (N, G * Dg) and rstd (N * G,) float32 for rows x2 (N, G * Dg), gate rows g2 or None."""
    N, C = x2.shape
    Dg = C // num_groups
    y = torch.empty(N, C, dtype=x2.dtype, device=x2.device)
    rstd = torch.empty(N * num_groups, dtype=torch.float32, device=x2.device)
    meta = _launch(Dg)
    if N:
        _norm_gate_fwd[(cdiv(N, meta["BLOCK_N"]), num_groups)](
            x2, weight, g2 if g2 is not None else x2, y, rstd, N, num_groups, Dg, x2.stride(0),
            g2.stride(0) if g2 is not None else 0, eps, SHARED=weight.numel() == Dg, HAS_GATE=g2 is not None,
            ACT=act, **meta)
    return y, rstd


class _NormGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, num_groups, eps, act):
        # a view into a larger buffer is read in place, but kept for the backward as a copy: keeping the
        # view would keep the whole buffer (a fused projection's q, k, v and gates) alive until then
        x2 = row_view(x, own=ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        g2 = row_view(gate, own=any(ctx.needs_input_grad[:3])) if gate is not None else None
        y, rstd = _forward(x2, weight, g2, num_groups, eps, act)
        ctx.save_for_backward(x2, weight, g2, rstd)
        ctx.meta = (num_groups, act, x.shape)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, gate, rstd = ctx.saved_tensors
        num_groups, act, shape = ctx.meta
        N, C = x.shape
        Dg = C // num_groups
        dy = row_view(dy)
        dx = torch.empty(N, C, dtype=x.dtype, device=x.device)
        dg = torch.empty(N, C, dtype=gate.dtype, device=x.device) if gate is not None else None
        meta = _launch(Dg)
        n_tiles = cdiv(N, meta["BLOCK_N"])
        dw_part = torch.empty(n_tiles, C, dtype=torch.float32, device=x.device)
        shared = weight.numel() == Dg
        if N:
            _norm_gate_bwd[(n_tiles, num_groups)](
                x, weight, gate if gate is not None else x, dy, rstd, dx, dg if dg is not None else dx, dw_part,
                N, num_groups, Dg, x.stride(0), gate.stride(0) if gate is not None else 0, dy.stride(0),
                SHARED=shared, HAS_GATE=gate is not None, ACT=act, **meta)
        dw = dw_part.sum(0)
        dw = dw.view(num_groups, Dg).sum(0) if shared else dw
        return (dx.view(shape), dw.to(weight.dtype), dg.view(shape) if dg is not None else None, None, None, None)


def norm_gate(x, weight, gate, num_groups: int, eps: float, act: str = "sigmoid"):
    """Fused on CUDA (and in the Triton interpreter), the PyTorch twin elsewhere."""
    require_int("num_groups", num_groups)
    C = x.shape[-1]
    if C % num_groups or weight.numel() not in (C // num_groups, C):
        sizes = f"{C}" if num_groups == 1 else f"{C} or {C // num_groups}"  # one group: the two are the same
        groups = "1 group" if num_groups == 1 else f"{num_groups} groups"
        raise ValueError(f"weight must have {sizes} elements for x (..., {C}) in {groups}, got {weight.numel()}")
    if act not in ("sigmoid", "silu"):  # any other name ran as sigmoid
        raise ValueError(f"act must be 'sigmoid' or 'silu', got {act!r}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must be shaped like x {tuple(x.shape)}, got {tuple(gate.shape)}")
    if use_triton(x) and x.shape[-1] // num_groups <= 4096:
        if needs_autograd(x, weight, gate):
            return _NormGate.apply(x, weight, gate, num_groups, eps, act)
        y, _ = _forward(row_view(x), weight, row_view(gate) if gate is not None else None, num_groups, eps, act)
        return y.view(x.shape)
    return norm_gate_reference(x, weight, gate, num_groups, eps, act)
