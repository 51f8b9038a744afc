"""Forgetting Attention in plain PyTorch, chunked over queries (the CPU path).

A FlashAttention-style twin of the Triton kernels: the forward keeps only the output and the
log-sum-exp per row; the backward recomputes the probabilities one query chunk at a time. No step
holds more than (B, H, chunk, Tk) scores, so long sequences fit on a laptop.

Tensors here are in the kernel layout: q (B, Tq, H, D), k/v (B, Tk, Hkv, D), log_fgate (B, Tk, H),
lse (B, H, Tq) in natural log (+inf for rows that see no key), float32 (float64 for float64 inputs).
The scale, window and the rest of the call come as one ``AttentionCall`` (``call.py``); the helpers take
the rows' own ``seq_start`` and threshold beside it, as a packed batch runs each sequence as its own row.
"""

from __future__ import annotations

import torch

from fox_kernel.ops.call import AttentionCall
from fox_kernel.ops.gates import gate_grad_from_dc
from fox_kernel.reference import decay_bias, finite_prefix_sums

# Scores held at once, in elements: bounds the memory of one chunk (256 MiB in float32).
_CHUNK_ELEMENTS = 1 << 26


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _sequences(cu_seqlens, total):
    if cu_seqlens is None:
        return [(0, total)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _prefix_sums(log_fgate, seq_start, acc):
    """(c, zeros) of ``finite_prefix_sums`` as (B, H, Tk), summed in ``acc`` (float64 for float64 q/k/v, whose
    decay terms ``c_i - c_j`` would otherwise have float32 accuracy)."""
    c, zeros = finite_prefix_sums(log_fgate.to(acc), seq_start)
    return c.to(acc).permute(0, 2, 1), zeros.permute(0, 2, 1)


def _chunk_rows(B, H, Tq, Tk):
    return max(16, min(Tq, _CHUNK_ELEMENTS // max(1, B * H * Tk)))


def _key_span(pos_q, window):
    """Keys [kstart, kend) that the queries at positions ``pos_q`` may see (causal, within the window)."""
    kend = int(pos_q[-1]) + 1
    kstart = max(0, int(pos_q[0]) - window + 1) if window else 0
    return kstart, kend


def _scores(qc, kh, c, zeros, pos_q, kstart, kend, seq_start, threshold, call: AttentionCall):
    """Masked logits for one query chunk at key positions ``pos_q`` over keys [kstart, kend): (B, H, C, K).

    ``c``, ``zeros`` (B, H, Tk): finite prefix sums and counts of zero gates (``finite_prefix_sums``), so a
    gate of exactly 0 masks the keys before it exactly; ``zeros`` None where there is none. With a pruning threshold, every score whose decay
    bias ``c_i - c_j`` is below it is dropped (the kernels drop whole blocks only when the test holds for
    every pair in the block).
    """
    if zeros is None:  # no gate of exactly 0 (a decoding cache)
        bias = c[..., pos_q, None] - c[..., None, kstart:kend]
    else:
        bias = decay_bias(c[..., pos_q], zeros[..., pos_q], c[..., kstart:kend], zeros[..., kstart:kend])
    s = torch.matmul(qc, kh.transpose(-1, -2)) * call.sm_scale + bias
    pos_k = torch.arange(kstart, kend, device=kh.device)
    allowed = pos_k[None, :] <= pos_q[:, None]
    if call.window:
        allowed = allowed & (pos_k[None, :] > pos_q[:, None] - call.window)
    allowed = allowed[None, None]
    if seq_start is not None:
        allowed = allowed & (pos_k >= seq_start[:, None])[:, None, None, :]
    if threshold is not None:
        allowed = allowed & (bias >= threshold[..., None, None])
    return s.masked_fill(~allowed, float("-inf"))


def _dense_fwd(q, k, v, log_fgate, call, threshold):
    c, zeros = _prefix_sums(log_fgate, call.seq_start, _acc_dtype(q))
    return _from_sums(q, k, v, c, zeros, call.seq_start, threshold, call)


def forward_from_sums(q, k, v, c, zeros, call: AttentionCall, lengths: list[int] | None = None):
    """``chunked_forward`` of one batch of rows given the gates' prefix sums ``c`` (B, H, Tk) and the counts
    of gates of exactly 0 ``zeros`` (B, H, Tk), or None where there is none (a decoding cache:
    ``decode.forgetting_attention_with_kvcache`` runs its CPU path here, on the cached sums). ``c`` is taken
    in float32 (float64 for float64 q). ``call.seq_start`` and ``call.threshold`` hold one row per batch row.

    ``lengths``: the keys each row holds (B ints, each at most Tk; None: every row Tk), the queries
    end-aligned with each row's own length; query rows before key position 0 return 0. One batched pass
    when every row holds as many keys (at least Tq), else one pass per row over its keys. Rows that see no
    key return 0 and lse +inf."""
    c = c.to(_acc_dtype(q))
    Tq = q.shape[1]
    if lengths is None:
        return _from_sums(q, k, v, c, zeros, call.seq_start, call.threshold, call)
    if len(set(lengths)) == 1 and lengths[0] >= Tq:
        L = lengths[0]
        return _from_sums(q, k[:, :L], v[:, :L], c[..., :L], None if zeros is None else zeros[..., :L],
                          call.seq_start, call.threshold, call)
    out = q.new_zeros(q.shape)
    lse = torch.full((q.shape[0], q.shape[2], Tq), float("inf"), dtype=c.dtype, device=q.device)
    for b, L in enumerate(lengths):
        n = max(0, min(Tq, L))  # the query rows at key positions >= 0
        if n:
            out[b:b + 1, Tq - n:], lse[b:b + 1, :, Tq - n:] = _from_sums(
                q[b:b + 1, Tq - n:], k[b:b + 1, :L], v[b:b + 1, :L], c[b:b + 1, :, :L],
                None if zeros is None else zeros[b:b + 1, :, :L], _row(call.seq_start, b), _row(call.threshold, b),
                call)
    return out, lse


def _from_sums(q, k, v, c, zeros, seq_start, threshold, call):
    """``forward_from_sums`` of rows of Tk keys each, with the rows' own ``seq_start`` and threshold."""
    B, Tq, H, D = q.shape
    Tk, group = k.shape[1], H // k.shape[2]
    acc = _acc_dtype(q)
    qh = q.permute(0, 2, 1, 3).to(acc)
    kh = k.permute(0, 2, 1, 3).to(acc).repeat_interleave(group, dim=1)
    vh = v.permute(0, 2, 1, 3).to(acc).repeat_interleave(group, dim=1)
    out = torch.empty(B, H, Tq, D, dtype=acc, device=q.device)
    lse = torch.empty(B, H, Tq, dtype=acc, device=q.device)
    rows = _chunk_rows(B, H, Tq, Tk)
    for start in range(0, Tq, rows):
        end = min(Tq, start + rows)
        pos_q = torch.arange(start, end, device=q.device) + (Tk - Tq)
        ks, ke = _key_span(pos_q, call.window)
        s = _scores(qh[:, :, start:end], kh[:, :, ks:ke], c, zeros, pos_q, ks, ke, seq_start, threshold, call)
        m = torch.logsumexp(s, dim=-1)
        m = torch.where(torch.isneginf(m), torch.full_like(m, float("inf")), m)
        p = torch.exp(s - m[..., None])
        out[:, :, start:end] = torch.matmul(p, vh[:, :, ks:ke])
        lse[:, :, start:end] = m
    return out.permute(0, 2, 1, 3).to(q.dtype), lse


def _dense_bwd(do, q, k, v, log_fgate, out, lse, call, threshold):
    B, Tq, H, D = q.shape
    seq_start, sm_scale = call.seq_start, call.sm_scale
    Tk, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    acc = _acc_dtype(q)
    c, zeros = _prefix_sums(log_fgate, seq_start, acc)
    qh = q.permute(0, 2, 1, 3).to(acc)
    kh = k.permute(0, 2, 1, 3).to(acc).repeat_interleave(group, dim=1)
    vh = v.permute(0, 2, 1, 3).to(acc).repeat_interleave(group, dim=1)
    doh = do.permute(0, 2, 1, 3).to(acc)
    delta = (doh * out.permute(0, 2, 1, 3).to(acc)).sum(-1)  # (B, H, Tq)
    lse = lse.to(acc)
    dq = torch.empty_like(qh)
    dk = torch.zeros_like(kh)
    dv = torch.zeros_like(vh)
    dc = torch.zeros(B, H, Tk, dtype=acc, device=q.device)
    rows = _chunk_rows(B, H, Tq, Tk)
    for start in range(0, Tq, rows):
        end = min(Tq, start + rows)
        pos_q = torch.arange(start, end, device=q.device) + (Tk - Tq)
        ks, ke = _key_span(pos_q, call.window)
        s = _scores(qh[:, :, start:end], kh[:, :, ks:ke], c, zeros, pos_q, ks, ke, seq_start, threshold, call)
        p = torch.exp(s - lse[:, :, start:end, None])
        do_c = doh[:, :, start:end]
        dv[:, :, ks:ke] += torch.matmul(p.transpose(-1, -2), do_c)
        dp = torch.matmul(do_c, vh[:, :, ks:ke].transpose(-1, -2))
        ds = p * (dp - delta[:, :, start:end, None])
        dq[:, :, start:end] = torch.matmul(ds, kh[:, :, ks:ke]) * sm_scale
        dk[:, :, ks:ke] += torch.matmul(ds.transpose(-1, -2), qh[:, :, start:end]) * sm_scale
        # d score_ij / d c_i = 1 and / d c_j = -1.
        dc[:, :, ks:ke] -= ds.sum(dim=-2)
        dc[:, :, pos_q] += ds.sum(dim=-1)
    dg = gate_grad_from_dc(dc, seq_start, None)  # log f_t enters every c_u with u >= t
    dk = dk.view(B, Hkv, group, Tk, D).sum(2)
    dv = dv.view(B, Hkv, group, Tk, D).sum(2)
    return (
        dq.permute(0, 2, 1, 3).to(q.dtype),
        dk.permute(0, 2, 1, 3).to(k.dtype),
        dv.permute(0, 2, 1, 3).to(v.dtype),
        dg.to(log_fgate.dtype),
    )


def chunked_forward(q, k, v, log_fgate, call: AttentionCall):
    """Returns (out (B, Tq, H, D), lse (B, H, Tq) float32, float64 for float64 q). ``call.threshold``: (B or N, H)
    or None (a resolved bound: the call carries no "auto" tolerance here)."""
    if call.cu_seqlens is None:
        return _dense_fwd(q, k, v, log_fgate, call, call.threshold)
    parts = [
        _dense_fwd(q[:, s:e], k[:, s:e], v[:, s:e], log_fgate[:, s:e], call, _row(call.threshold, n))
        for n, (s, e) in enumerate(_sequences(call.cu_seqlens, q.shape[1]))
    ]
    return torch.cat([o for o, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=2)


def chunked_backward(do, q, k, v, log_fgate, out, lse, call: AttentionCall):
    """Returns (dq, dk, dv, dlog_fgate) in the dtypes of q, k, v, log_fgate."""
    if call.cu_seqlens is None:
        return _dense_bwd(do, q, k, v, log_fgate, out, lse, call, call.threshold)
    parts = [
        _dense_bwd(do[:, s:e], q[:, s:e], k[:, s:e], v[:, s:e], log_fgate[:, s:e], out[:, s:e], lse[:, :, s:e], call,
                   _row(call.threshold, n))
        for n, (s, e) in enumerate(_sequences(call.cu_seqlens, q.shape[1]))
    ]
    return tuple(torch.cat(grads, dim=1) for grads in zip(*parts))


def _row(x, n):
    """Row ``n`` of a per-row tensor (seq_start, threshold), kept 2-D / 1-D; None stays None."""
    return None if x is None else x[n : n + 1]
