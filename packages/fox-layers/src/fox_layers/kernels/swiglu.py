"""SwiGLU's activation in one pass: ``silu(gate) * up`` from the fused (gate, up) projection.

Eager PyTorch runs it as a silu kernel and a product kernel (and, in the backward, four more passes and a
concatenation into the projection's gradient); the fused kernels read the projection once and write the
gradient of the whole (gate, up) output directly. The PyTorch twin is ``swiglu_reference``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fox_kernel import cdiv
from fox_layers.kernels import needs_autograd, row_view, use_triton


@triton.jit
def _tile(N, I, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    return rows, cols, (rows < N)[:, None] & (cols < I)[None, :]


@triton.jit
def _swiglu_fwd(H, Y, N, I, stride_h, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    rows, cols, mask = _tile(N, I, BLOCK_N, BLOCK_I)
    at = H + rows[:, None] * stride_h + cols[None, :]
    g = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(at + I, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + rows[:, None] * I + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(H, DY, DH, N, I, stride_h, stride_dy, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    rows, cols, mask = _tile(N, I, BLOCK_N, BLOCK_I)
    at = H + rows[:, None] * stride_h + cols[None, :]
    g = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(at + I, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    out = DH + rows[:, None] * (2 * I) + cols[None, :]
    tl.store(out, (dy * u * s * (1 + g * (1 - s))).to(DH.dtype.element_ty), mask=mask)
    tl.store(out + I, (dy * g * s).to(DH.dtype.element_ty), mask=mask)


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """PyTorch twin: h (..., 2 I) = (gate, up) -> silu(gate) * up (..., I)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


_META = dict(BLOCK_N=16, BLOCK_I=256, num_warps=4)


def _grid(N: int, I: int) -> tuple[int, int]:
    return cdiv(N, _META["BLOCK_N"]), cdiv(I, _META["BLOCK_I"])


def _forward(h2: torch.Tensor) -> torch.Tensor:
    N, I = h2.shape[0], h2.shape[1] // 2
    y = torch.empty(N, I, dtype=h2.dtype, device=h2.device)
    if N and I:
        _swiglu_fwd[_grid(N, I)](h2, y, N, I, h2.stride(0), **_META)
    return y


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        h2 = row_view(h, own=True)
        ctx.save_for_backward(h2)
        ctx.shape = h.shape
        return _forward(h2).view(*h.shape[:-1], h.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        N, I = h.shape[0], h.shape[1] // 2
        dy = row_view(dy)
        dh = torch.empty(N, 2 * I, dtype=h.dtype, device=h.device)
        if N and I:
            _swiglu_bwd[_grid(N, I)](h, dy, dh, N, I, h.stride(0), dy.stride(0), **_META)
        return dh.view(ctx.shape)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for h (..., 2 I) = (gate, up): fused on CUDA (and in the Triton interpreter) in eager
    mode, the PyTorch twin elsewhere."""
    if not use_triton(h) or h.shape[-1] % 2:
        return swiglu_reference(h)
    if needs_autograd(h):
        return _SwiGLU.apply(h)
    return _forward(row_view(h)).view(*h.shape[:-1], h.shape[-1] // 2)
