"""The public Forgetting Attention op: argument checks, layout handling and a torch.library custom op.

``forgetting_attention`` dispatches on the device: CUDA tensors run the Triton kernels; CPU tensors run
the chunked PyTorch twin, or the Triton kernels through the interpreter when ``TRITON_INTERPRET=1``.
Both directions are custom ops with fake implementations, so ``torch.compile(fullgraph=True)`` traces
through them.
"""

from __future__ import annotations

import math

import torch

from fox_kernel.ops import checks
from fox_kernel.ops.chunked import chunked_backward, chunked_forward

# ln(eps) of the pruning bound used by adaptive_threshold="auto" (FOX.md section 1).
AUTO_LOG_EPS = -10.0


def _use_triton(x: torch.Tensor) -> bool:
    if x.is_cuda:
        return True
    from fox_kernel.ops.triton_attention import interpreting

    return interpreting() and x.dtype != torch.float64


@torch.library.custom_op("fox_kernel::forgetting_attention_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    seq_start: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    sm_scale: float,
    threshold: torch.Tensor | None,
    auto_log_eps: float | None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, auto bound): with ``auto_log_eps`` the per-head "auto" bound (rows, H) for the
    backward (the Triton forward prunes each query tile by its own rows' norms); otherwise an empty
    tensor (the backward takes ``threshold`` from the inputs). ``window``: the sliding window, 0 for none."""
    if _use_triton(q):
        from fox_kernel.ops.triton_attention import triton_forward

        out, lse, threshold = triton_forward(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale, threshold,
                                             auto_log_eps, window)
    else:
        if auto_log_eps is not None:
            threshold = pruning_threshold(q, k, sm_scale, k.shape[1], auto_log_eps, rows=cu_seqlens)
        out, lse = chunked_forward(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale, threshold, window)
        out = out.contiguous()
    if auto_log_eps is None:  # not an input as it is, nor None: a custom op may return neither
        threshold = q.new_empty(0, dtype=torch.float32)
    return out, lse, threshold


@_fwd_op.register_fake
def _(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale, threshold, auto_log_eps, window=0):
    B, Tq, H, _ = q.shape
    rows = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    bound = q.new_empty((rows, H) if auto_log_eps is not None else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty((B, H, Tq), dtype=torch.float32), bound


@torch.library.custom_op("fox_kernel::forgetting_attention_bwd", mutates_args=())
def _bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seq_start: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    sm_scale: float,
    threshold: torch.Tensor | None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_triton(q):
        from fox_kernel.ops.triton_attention import triton_backward

        grads = triton_backward(dout, q, k, v, log_fgate, out, lse, seq_start, cu_seqlens, sm_scale, threshold,
                                window)
    else:
        grads = chunked_backward(dout, q, k, v, log_fgate, out, lse, seq_start, cu_seqlens, sm_scale, threshold,
                                 window)
    return tuple(g.contiguous() for g in grads)


@_bwd_op.register_fake
def _(dout, q, k, v, log_fgate, out, lse, seq_start, cu_seqlens, sm_scale, threshold, window=0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), log_fgate.new_empty(log_fgate.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale, threshold, auto_log_eps, *window = inputs
    out, lse, auto_bound = output
    if auto_log_eps is not None:
        threshold = auto_bound
    ctx.save_for_backward(q, k, v, log_fgate, out, lse, seq_start, cu_seqlens, threshold)
    ctx.sm_scale = sm_scale
    ctx.window = window[0] if window else 0


def _backward(ctx, dout, _dlse, _dbound):
    q, k, v, log_fgate, out, lse, seq_start, cu_seqlens, threshold = ctx.saved_tensors
    dq, dk, dv, dg = _bwd_op(dout, q, k, v, log_fgate, out, lse, seq_start, cu_seqlens, ctx.sm_scale, threshold,
                             ctx.window)
    return dq, dk, dv, dg, None, None, None, None, None, None


torch.library.register_autograd("fox_kernel::forgetting_attention_fwd", _backward, setup_context=_setup_context)


def pruning_threshold(q, k, sm_scale, t_k, log_eps=AUTO_LOG_EPS, rows=None):
    """The ACP bound delta = -(2U + ln Tk) + ln eps with U = max|q| max|k| s per (row, head).

    q (B, Tq, H, D), k (B, Tk, Hkv, D); rows: (N+1,) cu_seqlens to bound each packed sequence alone.
    Returns (B or N, H) float32.
    """
    group = q.shape[2] // k.shape[2]
    if rows is None and q.is_cuda and k.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:
        # one read of q and k by a Triton reduction (torch's norm over a 64-128 wide axis is ~5x slower),
        # and the bound in a second launch: with torch ops in between it took ~200 us at T=16k on an H200
        from fox_kernel.ops.triton_attention import auto_threshold

        return auto_threshold(q, k, sm_scale, t_k, log_eps)
    # Norms in float32 without materialising float32 copies of q and k.
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 inputs
    qn = torch.linalg.vector_norm(q, dim=-1, dtype=acc)  # (B, Tq, H)
    kn = torch.linalg.vector_norm(k, dim=-1, dtype=acc).repeat_interleave(group, dim=-1)
    if rows is None:
        return _threshold_from_norms(qn.amax(dim=1), kn.amax(dim=1), sm_scale, t_k, log_eps).contiguous()
    bounds = rows.tolist()
    per_seq = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        per_seq.append(_threshold_from_norms(qn[0, s:e].amax(dim=0), kn[0, s:e].amax(dim=0), sm_scale, e - s,
                                             log_eps))
    return torch.stack(per_seq).contiguous()


def _threshold_from_norms(q_max, k_max, sm_scale, t_k, log_eps=AUTO_LOG_EPS):
    """delta = -(2U + ln Tk) + ln eps from the largest q and k norms (float32, U = q_max k_max s)."""
    u = q_max.float() * k_max.float() * abs(sm_scale)  # bounds |score|: the sign of the scale does not matter
    return -(2 * u + math.log(max(t_k, 1))) + log_eps


def _threshold_tensor(adaptive_threshold, q, k, sm_scale, cu_seqlens):
    n_rows = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    H = q.shape[2]
    if isinstance(adaptive_threshold, str):  # "auto" is taken by the forward op itself
        raise ValueError(f'adaptive_threshold must be None, a number, a tensor or "auto", got {adaptive_threshold!r}')
    if isinstance(adaptive_threshold, (int, float)):
        checks.check_threshold_number(float(adaptive_threshold))
        return torch.full((n_rows, H), float(adaptive_threshold), dtype=torch.float32, device=q.device)
    checks.require_tensor("adaptive_threshold", adaptive_threshold)
    try:
        t = torch.broadcast_to(adaptive_threshold.to(device=q.device, dtype=torch.float32), (n_rows, H))
    except RuntimeError:
        raise ValueError(
            f"adaptive_threshold must broadcast to ({n_rows}, {H}), got shape {tuple(adaptive_threshold.shape)}"
        ) from None
    checks.check_threshold_tensor(adaptive_threshold)
    return t.contiguous()


def _refuse_zero_gates(log_fgate, seq_start):
    """The Triton kernels measure ``c`` from tile anchors in float32, where a gate of exactly 0 (c = -inf from
    there on) has no exact form; the PyTorch path masks across it exactly. Checked where it costs no sync:
    the interpreter's CPU tensors (a CUDA tensor's -inf gives NaN rows after it, unchecked)."""
    if seq_start is not None:  # padded gates do not count
        pos = torch.arange(log_fgate.shape[1], device=log_fgate.device)
        log_fgate = log_fgate.masked_fill((pos[None, :] < seq_start[:, None])[..., None], 0.0)
    checks.check_no_zero_gates("log_fgate", log_fgate, "the Triton kernels cannot represent it exactly (the "
                               "PyTorch path, without TRITON_INTERPRET, does)")


def forgetting_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_fgate: torch.Tensor,
    *,
    head_first: bool = False,
    seq_start: torch.Tensor | None = None,
    sm_scale: float | None = None,
    adaptive_threshold=None,
    cu_seqlens: torch.Tensor | None = None,
    window_size: int | None = None,
) -> torch.Tensor:
    """Causal softmax attention with a per-head forget gate (Forgetting Attention).

    Args:
        q: (B, Tq, H, D) queries; (B, H, Tq, D) with ``head_first``.
        k, v: (B, Tk, Hkv, D) keys and values, ``H % Hkv == 0`` (GQA/MQA), ``Tq <= Tk``.
        log_fgate: (B, Tk, H) float32 log forget gates (``logsigmoid`` of the gate logits), one per query head.
            A gate of exactly 0 (-inf) at t hides the keys before t from the queries at and after t: exact on
            the PyTorch (CPU) path; refused by the Triton kernels in the interpreter; on CUDA unchecked
            (the rows after it come out NaN). NaN gates give NaN rows, never zeros.
        head_first: tensors are (B, H, T, D) and log_fgate (B, H, T).
        seq_start: (B,) integers, first real token of each row (left padding); padded keys get no attention,
            their gates do not count, padded query rows return 0.
        sm_scale: score scale, default ``D ** -0.5``.
        adaptive_threshold: skip blocks whose decay bias ``c_i - c_j`` stays below this (log space): None,
            a finite negative number, a tensor broadcastable to (B, H), or "auto" for the bound with
            eps = e^-10 (FOX.md section 1; the Triton forward takes it per query tile from that tile's own
            query norms, which is at least as tight, and the backward per head). A tensor's values are
            checked on the CPU only (reading a CUDA tensor would wait for the GPU).
        cu_seqlens: (N + 1,) int32 cumulative lengths of sequences packed into batch 1.
        window_size: sliding window W >= 1: the query at key position i sees only keys j with
            i - W < j <= i (flash-linear-attention's convention; W = 1 is the token itself). None, or
            W >= Tk, is full causal attention. Key tiles wholly outside the window are never read, so the
            cost grows with T * W. With log gates of 0 it is plain sliding-window attention.

    Returns:
        Tensor shaped like q.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("log_fgate", log_fgate)):
        checks.require_tensor(name, x)
    layout = "(B, H, T, D)" if head_first else "(B, T, H, D)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.require_rank(name, x, 4, layout)
    checks.require_rank("log_fgate", log_fgate, 3, "(B, H, T)" if head_first else "(B, T, H)")
    if head_first:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        log_fgate = log_fgate.transpose(1, 2)
    checks.require_same_device(q.device, k=k, v=v, log_fgate=log_fgate, seq_start=seq_start, cu_seqlens=cu_seqlens)
    checks.require_qkv_dtype(q, k, v)
    if log_fgate.dtype != torch.float32:
        raise TypeError(f"log_fgate must be float32, got {log_fgate.dtype}")
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    checks.require_dim("k", k.shape[0], B, "batch size (q's)")
    checks.require_dim("v", v.shape[0], B, "batch size (q's)")
    checks.require_dim("k", k.shape[3], D, "head dim (q's)")
    checks.require_dim("v", v.shape[3], D, "head dim (q's)")
    checks.require_dim("v", v.shape[1], Tk, "length (k's)")
    checks.require_dim("v", v.shape[2], Hkv, "number of heads (k's)")
    if not 1 <= D <= 256:
        raise ValueError(f"head dim must be in [1, 256], got {D}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q's {H} heads must be a multiple of k/v's heads, got Hkv={Hkv}")
    if Tq > Tk:
        raise ValueError(f"q must not be longer than k (queries are end-aligned), got Tq={Tq} > Tk={Tk}")
    expected_gates = (B, Tk, H)
    if tuple(log_fgate.shape) != expected_gates:
        raise ValueError(f"log_fgate must have shape {expected_gates} (B, Tk, H), got {tuple(log_fgate.shape)}")
    value_checks = not torch.compiler.is_compiling()
    if cu_seqlens is not None:
        if seq_start is not None:
            raise ValueError("seq_start and cu_seqlens cannot be combined: packed sequences carry no padding")
        if Tq != Tk:
            raise ValueError(f"with cu_seqlens q and k must have the same packed length, got Tq={Tq}, Tk={Tk}")
        checks.check_cu_seqlens(cu_seqlens, B, Tk, value_checks)
    if seq_start is not None:
        checks.check_seq_start(seq_start, B, Tk, value_checks)
        seq_start = seq_start.to(torch.int32).contiguous()
    if _use_triton(q) and checks.values_checkable(log_fgate):
        _refuse_zero_gates(log_fgate, seq_start)
    window = checks.check_window_size(window_size, Tk)
    if sm_scale is None:
        sm_scale = D**-0.5
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    threshold, auto_log_eps = None, None
    if isinstance(adaptive_threshold, str) and adaptive_threshold == "auto":
        auto_log_eps = AUTO_LOG_EPS  # taken inside the forward (no separate pass over q and k)
    elif adaptive_threshold is not None:
        threshold = _threshold_tensor(adaptive_threshold, q, k, float(sm_scale), cu_seqlens)
    out, _, _ = _fwd_op(q, k, v, log_fgate, seq_start, cu_seqlens, float(sm_scale), threshold, auto_log_eps, window)
    return out.transpose(1, 2) if head_first else out
