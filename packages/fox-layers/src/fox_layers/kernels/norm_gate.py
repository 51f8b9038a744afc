"""Per-head RMSNorm times weight times an activated gate, in one pass: ``rms_norm(x) * w * act(g)``.

The FoX (Pro) output path. The PyTorch twin (``norm_gate_reference``) is what runs on the CPU and what the
Triton kernel is tested against; on CUDA the fused kernel saves the float32 intermediates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_layers.kernels import use_triton


@triton.jit
def _act(g, ACT: tl.constexpr):
    s = tl.sigmoid(g)
    if ACT == "silu":
        return g * s, s * (1 + g * (1 - s))
    return s, s * (1 - s)


@triton.jit
def _norm_gate_fwd(X, W, G, Y, RSTD, Dg, NG, eps, BLOCK: tl.constexpr, SHARED: tl.constexpr,
                   HAS_GATE: tl.constexpr, ACT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < Dg
    x = tl.load(X + pid * Dg + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / Dg + eps)
    w_off = offs if SHARED else (pid % NG) * Dg + offs
    w = tl.load(W + w_off, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    if HAS_GATE:
        g = tl.load(G + pid * Dg + offs, mask=mask, other=0.0).to(tl.float32)
        a, _ = _act(g, ACT)
        y = y * a
    tl.store(Y + pid * Dg + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + pid, rstd)


@triton.jit
def _norm_gate_bwd(X, W, G, DY, RSTD, DX, DG, DW_PART, Dg, NG, BLOCK: tl.constexpr, SHARED: tl.constexpr,
                   HAS_GATE: tl.constexpr, ACT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < Dg
    x = tl.load(X + pid * Dg + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + pid * Dg + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + pid)
    w_off = offs if SHARED else (pid % NG) * Dg + offs
    w = tl.load(W + w_off, mask=mask, other=0.0).to(tl.float32)
    xhat = x * rstd
    if HAS_GATE:
        g = tl.load(G + pid * Dg + offs, mask=mask, other=0.0).to(tl.float32)
        a, da = _act(g, ACT)
        tl.store(DG + pid * Dg + offs, (dy * xhat * w * da).to(DG.dtype.element_ty), mask=mask)
        dy = dy * a
    tl.store(DW_PART + pid * Dg + offs, dy * xhat, mask=mask)
    dxhat = dy * w
    dx = rstd * (dxhat - xhat * tl.sum(dxhat * xhat, 0) / Dg)
    tl.store(DX + pid * Dg + offs, dx.to(DX.dtype.element_ty), mask=mask)


def norm_gate_reference(x, weight, gate, num_groups: int, eps: float, act: str = "sigmoid"):
    """PyTorch twin: x, gate (..., G * Dg); weight (G * Dg,) or (Dg,) shared by the groups."""
    shape = x.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    xg = x.reshape(*shape[:-1], num_groups, -1).to(acc)
    w = weight.to(acc) if weight.numel() == xg.shape[-1] else weight.to(acc).view(num_groups, -1)
    y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps) * w).reshape(shape)
    if gate is not None:
        g = gate.to(acc)
        y = y * (torch.sigmoid(g) if act == "sigmoid" else torch.nn.functional.silu(g))
    return y.to(x.dtype)


class _NormGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, gate, num_groups, eps, act):
        Dg = x.shape[-1] // num_groups
        x2 = x.contiguous()
        g2 = gate.contiguous() if gate is not None else None
        y = torch.empty_like(x2)
        rows = x2.numel() // Dg
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        shared = weight.numel() == Dg
        block = max(16, triton.next_power_of_2(Dg))
        _norm_gate_fwd[(rows,)](x2, weight, g2 if g2 is not None else x2, y, rstd, Dg, num_groups, eps,
                                BLOCK=block, SHARED=shared, HAS_GATE=gate is not None, ACT=act)
        ctx.save_for_backward(x2, weight, g2, rstd)
        ctx.meta = (num_groups, Dg, shared, act, block)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, gate, rstd = ctx.saved_tensors
        num_groups, Dg, shared, act, block = ctx.meta
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        dg = torch.empty_like(gate) if gate is not None else None
        rows = x.numel() // Dg
        dw_part = torch.empty(rows, Dg, dtype=torch.float32, device=x.device)
        _norm_gate_bwd[(rows,)](x, weight, gate if gate is not None else x, dy, rstd, dx,
                                dg if dg is not None else dx, dw_part, Dg, num_groups,
                                BLOCK=block, SHARED=shared, HAS_GATE=gate is not None, ACT=act)
        dw = dw_part.sum(0) if shared else dw_part.view(-1, num_groups, Dg).sum(0).reshape(-1)
        return dx, dw.to(weight.dtype), dg, None, None, None


def norm_gate(x, weight, gate, num_groups: int, eps: float, act: str = "sigmoid"):
    """Fused on CUDA (and in the Triton interpreter), the PyTorch twin elsewhere."""
    if use_triton(x) and x.shape[-1] // num_groups <= 4096:
        return _NormGate.apply(x, weight, gate, num_groups, eps, act)
    return norm_gate_reference(x, weight, gate, num_groups, eps, act)
