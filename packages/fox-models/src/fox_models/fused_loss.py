"""Fused linear + cross-entropy on the GPU (or the Triton interpreter): see ``fox_models.loss``.

Each chunk's logits are made by one GEMM in the compute dtype (bf16 under autocast); one Triton pass
takes each row's log-sum-exp and loss, and the logits are freed. The backward remakes them, turns them
into their own gradient in place with a second pass, and runs the two gradient GEMMs. No float32 copy of
the logits is made.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fox_kernel import next_power_of_2

IGNORE_INDEX = -100
"""The label whose token scores no loss (transformers' convention)."""


# Vocabulary tile of the fused passes (one program per token row loops over its row in these tiles).
# The vocabulary sizes are compile-time constants of the kernels: one build per model, and loop bounds
# that the Triton 3.6 interpreter accepts (it fails on a loop bounded by a plain integer argument).
BLOCK_V = 4096


@triton.jit
def _ce_fwd_kernel(LOGITS, LABELS, LOSS, LSE, stride_row, V: tl.constexpr, BLOCK_V: tl.constexpr, IGNORE: tl.constexpr):
    """loss = logsumexp(x[:V]) - x[label] per row (0 for ignored rows, NaN for a label outside [0, V))."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):  # a running max and sum per lane, merged once at the end
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes with no column yet stay at s = 0
        s = s * tl.exp(m - m_ref) + tl.exp(x - m_ref)
        m = m_new
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
    label = tl.load(LABELS + row).to(tl.int64)
    kept = label != IGNORE
    in_range = (label >= 0) & (label < V)
    x_label = tl.load(base + label, mask=kept & in_range, other=0.0).to(tl.float32)
    loss = tl.where(kept, tl.where(in_range, lse - x_label, float("nan")), 0.0)
    tl.store(LOSS + row, loss)
    tl.store(LSE + row, lse)


@triton.jit
def _ce_bwd_kernel(LOGITS, LABELS, LSE, DLOSS, stride_row, V: tl.constexpr, VP: tl.constexpr, BLOCK_V: tl.constexpr,
                   IGNORE: tl.constexpr):
    """In place: x <- (softmax(x[:V]) - onehot(label)) * dloss, and 0 in the padded columns [V, VP)."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    offs = tl.arange(0, BLOCK_V)
    label = tl.load(LABELS + row).to(tl.int64)
    lse = tl.load(LSE + row)
    g = tl.where(label != IGNORE, tl.load(DLOSS + row).to(tl.float32), 0.0)
    for start in range(0, VP, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < VP, other=0.0).to(tl.float32)
        d = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * g
        d = tl.where(cols < V, d, 0.0)
        tl.store(base + cols, d.to(LOGITS.dtype.element_ty), mask=cols < VP)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """hidden (N, D), weight (VP, D) with the vocabulary padded to VP >= V, labels (N,) -> loss (N,) float32."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab, chunk_tokens):
        N = hidden.shape[0]
        dt = _compute_dtype(hidden)
        w = weight.to(dt)
        loss = torch.empty(N, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(N, dtype=torch.float32, device=hidden.device)
        labels = labels.contiguous()
        for s in range(0, N, chunk_tokens):
            e = min(N, s + chunk_tokens)
            logits = F.linear(hidden[s:e].to(dt), w)
            _ce_fwd_kernel[(e - s,)](logits, labels[s:e], loss[s:e], lse[s:e], logits.stride(0), vocab,
                                     BLOCK_V=min(BLOCK_V, next_power_of_2(vocab)), IGNORE=IGNORE_INDEX,
                                     num_warps=8)
            del logits
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.meta = (vocab, chunk_tokens, dt)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        hidden, weight, labels, lse = ctx.saved_tensors
        vocab, chunk_tokens, dt = ctx.meta
        N, VP = hidden.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight.to(dt)
        dloss = dloss.contiguous()
        dh = torch.empty_like(hidden) if need_h else None
        dw = None
        for s in range(0, N, chunk_tokens):
            e = min(N, s + chunk_tokens)
            h = hidden[s:e].to(dt)
            dlogits = F.linear(h, w)
            _ce_bwd_kernel[(e - s,)](dlogits, labels[s:e], lse[s:e], dloss[s:e], dlogits.stride(0), vocab, VP,
                                     BLOCK_V=min(BLOCK_V, next_power_of_2(VP)), IGNORE=IGNORE_INDEX,
                                     num_warps=8)
            if need_h:
                dh[s:e] = dlogits @ w
            if need_w:
                part = (dlogits.T @ h).float()
                dw = part if dw is None else dw.add_(part)
            del dlogits
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None
