"""Plain, materialised Forgetting Attention: the reference every fast path is tested against.

Everything is written with whole (T x T) matrices so a reader can check it line by line against the math,
O_i = sum_{j<=i} softmax_j(s q_i.k_j + c_i - c_j) v_j with c the prefix sums of the log forget gates. It
accepts any floating dtype; float64 inputs give a float64 answer.
"""

from __future__ import annotations

import torch


def gate_prefix_sum(log_fgate: torch.Tensor, seq_start: torch.Tensor | None = None) -> torch.Tensor:
    """Prefix sums ``c`` of the log forget gates, gates before ``seq_start`` zeroed.

    log_fgate: (B, T, H). Returns (B, T, H) in float64 if the input is float64, else float32. A gate of
    exactly 0 (log -inf) makes ``c`` -inf from there on; ``decay_bias`` takes such gates apart exactly.
    """
    dtype = torch.float64 if log_fgate.dtype == torch.float64 else torch.float32
    return torch.cumsum(_counted_gates(log_fgate.to(dtype), seq_start), dim=1)


def _counted_gates(g, seq_start):
    if seq_start is None:
        return g
    pos = torch.arange(g.shape[1], device=g.device)
    return torch.where((pos[None, :] >= seq_start[:, None].to(g.device))[..., None], g, torch.zeros_like(g))


def finite_prefix_sums(log_fgate: torch.Tensor, seq_start: torch.Tensor | None = None):
    """(c, zeros), both (B, T, H): ``c`` the prefix sums with gates of exactly 0 (log -inf) counted as 0,
    ``zeros`` how many such gates lie at or before each position (int64). Gates before ``seq_start`` do
    not count. float64 ``c`` for float64 input, else float32; NaN gates stay NaN."""
    dtype = torch.float64 if log_fgate.dtype == torch.float64 else torch.float32
    g = _counted_gates(log_fgate.to(dtype), seq_start)
    zero = torch.isneginf(g)
    c = torch.cumsum(torch.where(zero, torch.zeros_like(g), g), dim=1)
    return c, torch.cumsum(zero, dim=1)


def decay_bias(c_rows, zeros_rows, c_cols, zeros_cols):
    """``c_i - c_j`` for every (row i, column j), -inf where a gate of exactly 0 lies in (j, i] (the rows'
    and columns' counts of such gates differ). Inputs (..., I) and (..., J); returns (..., I, J)."""
    bias = c_rows[..., :, None] - c_cols[..., None, :]
    return bias.masked_fill(zeros_rows[..., :, None] != zeros_cols[..., None, :], float("-inf"))


def _attend(q, k, v, log_fgate, seq_start, sm_scale, window_size=None):
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    c, zeros = (x.permute(0, 2, 1) for x in finite_prefix_sums(log_fgate, seq_start))  # (B, H, Tk)
    # Matmuls in the input dtype (so a bf16 reference has bf16 rounding), softmax in acc_dtype.
    scores = torch.einsum("bihd,bjhd->bhij", q, k).to(acc_dtype) * sm_scale
    scores = scores + decay_bias(c[..., Tk - Tq :], zeros[..., Tk - Tq :], c, zeros).to(acc_dtype)
    pos_q = torch.arange(Tq, device=q.device) + (Tk - Tq)
    pos_k = torch.arange(Tk, device=q.device)
    allowed = pos_k[None, :] <= pos_q[:, None]
    if window_size is not None:
        allowed = allowed & (pos_k[None, :] > pos_q[:, None] - window_size)
    allowed = allowed[None].expand(B, Tq, Tk)
    if seq_start is not None:
        allowed = allowed & (pos_k[None, None, :] >= seq_start.to(q.device)[:, None, None])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # rows with no visible key (padding) give 0; a NaN elsewhere (a NaN input) stays NaN
    probs = probs.masked_fill(~allowed.any(dim=-1)[:, None, :, None], 0.0)
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
    window_size: int | None = None,
) -> torch.Tensor:
    """Reference Forgetting Attention. Same interface as ``fox_kernel.forgetting_attention``.

    q: (B, Tq, H, D); k, v: (B, Tk, Hkv, D); log_fgate: (B, Tk, H) or None (no forget gate: plain softmax
    attention); (T and H swapped with head_first). ``window_size`` W: query i sees keys j with
    i - W < j <= i (positions in k). Differentiable through plain autograd.
    """
    if head_first:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        log_fgate = None if log_fgate is None else log_fgate.transpose(1, 2)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    if log_fgate is None:
        log_fgate = q.new_zeros(k.shape[0], k.shape[1], q.shape[2], dtype=torch.float32)
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        pieces = [
            _attend(q[:, s:e], k[:, s:e], v[:, s:e], log_fgate[:, s:e], None, sm_scale, window_size)
            for s, e in zip(bounds[:-1], bounds[1:])
        ]
        out = torch.cat(pieces, dim=1)
    else:
        out = _attend(q, k, v, log_fgate, seq_start, sm_scale, window_size)
    return out.transpose(1, 2) if head_first else out
