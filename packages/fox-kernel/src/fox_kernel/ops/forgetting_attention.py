"""The public Forgetting Attention op: argument checks, layout handling and a torch.library custom op.

``dispatch`` chooses what runs: the Triton or Gluon kernels on CUDA, the chunked PyTorch twin on the CPU
(or the Triton kernels through the interpreter when ``TRITON_INTERPRET=1``). Both directions are custom
ops with fake implementations, so ``torch.compile(fullgraph=True)`` traces through them; the kernel
options travel through them as one string (``KernelOptions.key``). Eager calls take a plain
``torch.autograd.Function`` around the same two dispatch functions, which costs less host time per call.

After its checks an eager ``forgetting_attention`` describes the call once, as an ``AttentionCall``
(``call.py``), and passes that object down to ``dispatch`` and the backends. The custom ops take its fields
as primitives (a compiled call passes them as they are) and rebuild it inside
(``AttentionCall.from_op_args``).
"""

from __future__ import annotations

import numbers

import torch

from fox_kernel.ops import checks, dispatch
from fox_kernel.ops.call import AttentionCall
from fox_kernel.options import KernelOptions, current_options
from fox_kernel.pruning import DEFAULT_LOG_TOLERANCE, AutoThreshold


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
    options: str = "",
    zero_gates: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, auto bound): with ``auto_log_eps`` the per-head "auto" bound (rows, H) for the
    backward (the Triton forward prunes each query tile by its own rows' norms); otherwise an empty
    tensor (the backward takes ``threshold`` from the inputs). The arguments after log_fgate are
    ``AttentionCall.op_args()``: ``window`` the sliding window, 0 for none; ``options``
    ``KernelOptions.key`` ("" for the current options); ``zero_gates`` whether a gate may be exactly 0."""
    call = AttentionCall.from_op_args(seq_start, cu_seqlens, sm_scale, threshold, auto_log_eps, window, options,
                                      zero_gates)
    out, lse, threshold = dispatch.forward(q, k, v, log_fgate, call)
    if auto_log_eps is None:  # not an input as it is, nor None: a custom op may return neither
        threshold = q.new_empty(0, dtype=torch.float32)
    return out, lse, threshold


@_fwd_op.register_fake
def _(q, k, v, log_fgate, seq_start, cu_seqlens, sm_scale, threshold, auto_log_eps, window=0, options="",
      zero_gates=True):
    B, Tq, H, _ = q.shape
    rows = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    bound = q.new_empty((rows, H) if auto_log_eps is not None else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty((B, H, Tq), dtype=dispatch.lse_dtype(q)), bound


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
    options: str = "",
    zero_gates: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ``_fwd_op``: its arguments without ``auto_log_eps`` (``threshold`` is the bound the
    forward returned, or its own)."""
    call = AttentionCall.from_op_args(seq_start, cu_seqlens, sm_scale, threshold, None, window, options, zero_gates)
    grads = dispatch.backward(dout, q, k, v, log_fgate, out, lse, call)
    return tuple(g.contiguous() for g in grads)


@_bwd_op.register_fake
def _(dout, q, k, v, log_fgate, out, lse, seq_start, cu_seqlens, sm_scale, threshold, window=0, options="",
      zero_gates=True):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), log_fgate.new_empty(log_fgate.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, log_fgate, *op_args = inputs
    out, lse, auto_bound = output
    # the backward runs with the forward call's options ("" resolved now, not when the backward runs)
    call = AttentionCall.from_op_args(*op_args)
    tensors, ctx.call_rest = call.saved(auto_bound if call.auto_log_eps is not None else call.threshold)
    ctx.save_for_backward(q, k, v, log_fgate, out, lse, *tensors)


def _backward(ctx, dout, _dlse, _dbound):
    q, k, v, log_fgate, out, lse, *tensors = ctx.saved_tensors
    call = AttentionCall.from_saved(tensors, ctx.call_rest)
    dq, dk, dv, dg = _bwd_op(dout, q, k, v, log_fgate, out, lse, *call.op_args(backward=True))
    return dq, dk, dv, dg, None, None, None, None, None, None, None, None


torch.library.register_autograd("fox_kernel::forgetting_attention_fwd", _backward, setup_context=_setup_context)


class _EagerForgettingAttention(torch.autograd.Function):
    """The same forward and backward as the custom ops, for eager calls: a torch.library op costs host time
    at each call (schema parsing, defaults, the aliasing check, the autograd redispatch) that a training
    step pays per layer, and the call's description goes down as the object it is rather than as
    primitives. The backward reuses the forward's prefix sums of the gates. Under ``torch.compile`` the
    custom ops run instead (a graph can hold them, not this)."""

    @staticmethod
    def forward(ctx, q, k, v, log_fgate, call: AttentionCall):
        out, lse, threshold, prefix = dispatch.forward_keeping_sums(q, k, v, log_fgate, call)
        c, z, ctx.zero_ticket = prefix if prefix is not None else (None, None, None)
        tensors, ctx.call_rest = call.saved(threshold)
        ctx.save_for_backward(q, k, v, log_fgate, out, lse, c, z, *tensors)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, log_fgate, out, lse, c, z, *tensors = ctx.saved_tensors
        call = AttentionCall.from_saved(tensors, ctx.call_rest)
        grads = dispatch.backward(dout, q, k, v, log_fgate, out, lse, call,
                                  None if c is None else (c, z, ctx.zero_ticket))
        return *(g.contiguous() for g in grads), None


def _threshold_tensor(adaptive_threshold, q, k, sm_scale, cu_seqlens):
    n_rows = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    H = q.shape[2]
    if isinstance(adaptive_threshold, str):  # "auto" is taken by the forward op itself
        raise ValueError(f'adaptive_threshold must be None, a number, a tensor, "auto" or an AutoThreshold, got '
                         f'{adaptive_threshold!r}')
    if isinstance(adaptive_threshold, numbers.Real):
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


def pruning_args(adaptive_threshold, q, k, sm_scale: float, cu_seqlens):
    """(threshold tensor (rows, H) or None, ln eps of the "auto" bound or None): what the forward op takes
    for ``forgetting_attention``'s ``adaptive_threshold``. "auto" and ``AutoThreshold`` are taken inside the
    forward (no separate pass over q and k)."""
    if isinstance(adaptive_threshold, str) and adaptive_threshold == "auto":
        return None, DEFAULT_LOG_TOLERANCE
    if isinstance(adaptive_threshold, AutoThreshold):
        return None, float(adaptive_threshold.log_pruning_tolerance)
    if adaptive_threshold is not None:
        return _threshold_tensor(adaptive_threshold, q, k, sm_scale, cu_seqlens), None
    return None, None


@torch.compiler.assume_constant_result  # read while tracing; a compiled graph keeps the options it saw
def _options_key(options: KernelOptions | None) -> str:
    return (options if options is not None else current_options()).key


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
    options: KernelOptions | None = None,
    zero_gates: bool = True,
) -> torch.Tensor:
    """Causal softmax attention with a per-head forget gate (Forgetting Attention).

    Args:
        q: (B, Tq, H, D) queries; (B, H, Tq, D) with ``head_first``.
        k, v: (B, Tk, Hkv, D) keys and values, ``H % Hkv == 0`` (GQA/MQA), ``Tq <= Tk``.
        log_fgate: (B, Tk, H) float32 log forget gates (``logsigmoid`` of the gate logits), one per query head.
            A gate of exactly 0 (-inf) at t hides the keys before t from the queries at and after t, exactly,
            on every path (a document boundary in a packed row, say): the GPU kernels re-run the tiles such
            a gate touches (``ops/dispatch.py``), so calls without one cost one extra small launch per
            pass (none with ``zero_gates=False``). NaN gates give NaN rows, never zeros. Log gates must be <= 0 (a forget gate in [0, 1]):
            the Triton kernels (CUDA, and the CPU under ``TRITON_INTERPRET=1``) assume prefix sums that
            never increase (their fixed softmax bound and the pruning of key tiles), so a positive log gate
            is refused with a ValueError where the gates can be read without waiting for the GPU (CPU
            tensors, or CUDA with ``KernelOptions(check_gates=True)``); otherwise the Triton kernels
            return NaN or wrong rows for it.
        head_first: tensors are (B, H, T, D) and log_fgate (B, H, T).
        seq_start: (B,) integers, first real token of each row (left padding); padded keys get no attention,
            their gates do not count, padded query rows return 0.
        sm_scale: score scale, default ``D ** -0.5``; a finite positive number (others raise ValueError).
        adaptive_threshold: skip blocks whose decay bias ``c_i - c_j`` stays below this (log space): None,
            a finite negative number, a tensor broadcastable to (B, H), ``pruning.AutoThreshold(ln eps)``
            for the bound from the q/k norms with that tolerance, or "auto" for it with eps = e^-10
            (``fox_kernel.pruning``; the Triton forward takes it per query tile from that tile's own
            query norms, which is at least as tight, and the backward per head). A tensor's values are
            checked on the CPU only (reading a CUDA tensor would wait for the GPU).
        cu_seqlens: (N + 1,) int32 cumulative lengths of sequences packed into batch 1.
        window_size: sliding window W >= 1: the query at key position i sees only keys j with
            i - W < j <= i (flash-linear-attention's convention; W = 1 is the token itself). None, or
            W >= Tk, is full causal attention. Key tiles wholly outside the window are never read, so the
            cost grows with T * W. With log gates of 0 it is plain sliding-window attention.
        options: ``KernelOptions`` of the GPU kernels (default ``current_options()``: the environment's
            ``FOX_KERNEL_*`` switches); the backward runs with the same.
        zero_gates: whether log_fgate may hold gates of exactly 0 (-inf). False promises that it holds none
            (log gates from ``logsigmoid`` of finite logits never do), and the GPU kernels skip the passes
            that re-run what such a gate changes: one launch of the forward and two of the backward, whose
            programs would only read one number each and return. Under that promise a gate of 0 is refused
            with a ValueError where the gates are read (CPU tensors, or CUDA with
            ``KernelOptions(check_gates=True)``); otherwise the GPU kernels return NaN rows from it on. The
            PyTorch path is exact either way.

    Returns:
        Tensor shaped like q.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("log_fgate", log_fgate)):
        checks.require_tensor(name, x)
    checks.require_options(options)
    if not isinstance(head_first, bool):
        raise TypeError(f"head_first must be True or False, got {head_first!r}")
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
    checks.check_heads(H, Hkv, D, "k/v")
    if Tq > Tk:
        raise ValueError(f"q must not be longer than k (queries are end-aligned), got Tq={Tq} > Tk={Tk}")
    if tuple(log_fgate.shape) != (B, Tk, H):  # named in the caller's layout
        want, got = ((B, H, Tk), log_fgate.transpose(1, 2).shape) if head_first else ((B, Tk, H), log_fgate.shape)
        raise ValueError(f"log_fgate must have shape {want} {'(B, H, Tk)' if head_first else '(B, Tk, H)'}, got "
                         f"{tuple(got)}")
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
    window = checks.check_window_size(window_size, Tk)
    # gates read where it costs no wait for the GPU (CPU tensors, or KernelOptions.check_gates); a compiled
    # call reads no options here
    check_gates = value_checks and (options if options is not None else current_options()).check_gates
    if value_checks:
        checks.check_log_gates_at_most_zero("log_fgate", log_fgate, check_gates)
    checks.check_zero_gates_promise("log_fgate", log_fgate, zero_gates, check_gates, value_checks)
    sm_scale = D**-0.5 if sm_scale is None else checks.check_sm_scale(sm_scale)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    threshold, auto_log_eps = pruning_args(adaptive_threshold, q, k, float(sm_scale), cu_seqlens)
    if not value_checks:
        # compiling: the custom ops, which a graph can hold. Their schema takes the call's fields as
        # primitives (the op builds the description inside), so the compiler traces no object here.
        out, _, _ = _fwd_op(q, k, v, log_fgate, seq_start, cu_seqlens, float(sm_scale), threshold, auto_log_eps,
                            window, _options_key(options), zero_gates)
    else:
        call = AttentionCall(float(sm_scale), seq_start, cu_seqlens, threshold, auto_log_eps, window,
                             options if options is not None else current_options(), zero_gates)
        out = _EagerForgettingAttention.apply(q, k, v, log_fgate, call)
    return out.transpose(1, 2) if head_first else out
