"""Plain, materialised Forgetting Attention: the reference every fast path is tested against.

Everything is written with whole (T x T) matrices so a reader can check it against the math of
FOX.md section 1 line by line. It accepts any floating dtype; float64 inputs give a float64 answer.
"""

from __future__ import annotations

import torch


def gate_prefix_sum(log_fgate: torch.Tensor, seq_start: torch.Tensor | None = None) -> torch.Tensor:
    """Prefix sums ``c`` of the log forget gates, gates before ``seq_start`` zeroed.

    log_fgate: (B, T, H). Returns (B, T, H) in float64 if the input is float64, else float32.
    """
    dtype = torch.float64 if log_fgate.dtype == torch.float64 else torch.float32
    g = log_fgate.to(dtype)
    if seq_start is not None:
        pos = torch.arange(g.shape[1], device=g.device)
        g = g * (pos[None, :] >= seq_start[:, None].to(g.device)).to(dtype)[..., None]
    return torch.cumsum(g, dim=1)


def _attend(q, k, v, log_fgate, seq_start, sm_scale):
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    c = gate_prefix_sum(log_fgate, seq_start)  # (B, Tk, H)
    c_q = c[:, Tk - Tq :]
    # Matmuls in the input dtype (so a bf16 reference has bf16 rounding), softmax in acc_dtype.
    scores = torch.einsum("bihd,bjhd->bhij", q, k).to(acc_dtype) * sm_scale
    scores = scores + (c_q.permute(0, 2, 1)[..., :, None] - c.permute(0, 2, 1)[..., None, :]).to(acc_dtype)
    pos_q = torch.arange(Tq, device=q.device) + (Tk - Tq)
    pos_k = torch.arange(Tk, device=q.device)
    allowed = pos_k[None, :] <= pos_q[:, None]
    allowed = allowed[None].expand(B, Tq, Tk)
    if seq_start is not None:
        allowed = allowed & (pos_k[None, None, :] >= seq_start.to(q.device)[:, None, None])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key (padding) give 0
    out = torch.einsum("bhij,bjhd->bihd", probs.to(v.dtype), v)
    return out.to(q.dtype)


def forgetting_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    head_first: bool = False,
    seq_start: torch.Tensor | None = None,
    sm_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference Forgetting Attention. Same interface as ``fox_kernel.forgetting_attention``.

    q: (B, Tq, H, D); k, v: (B, Tk, Hkv, D); log_fgate: (B, Tk, H); (T and H swapped with head_first).
    Differentiable through plain autograd.
    """
    if head_first:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        log_fgate = log_fgate.transpose(1, 2)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        pieces = [
            _attend(q[:, s:e], k[:, s:e], v[:, s:e], log_fgate[:, s:e], None, sm_scale)
            for s, e in zip(bounds[:-1], bounds[1:])
        ]
        out = torch.cat(pieces, dim=1)
    else:
        out = _attend(q, k, v, log_fgate, seq_start, sm_scale)
    return out.transpose(1, 2) if head_first else out
