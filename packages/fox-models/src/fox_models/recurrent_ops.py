"""Sequence mixers of the recurrent baselines: gated linear attention with a decay per key channel
(HGRN2) or one per head (Mamba-2's SSD), the delta rule (DeltaNet), and the causal depthwise short
convolution.

Each op takes (B, T, H, *) tensors and an optional float32 state, and returns (output, final state).
On CUDA with flash-linear-attention installed (``fox-models[baselines]``) its chunked Triton kernels
run; otherwise a plain PyTorch recurrence in float32 (the reference, and the CPU path: one step per
token, meant for tests and short prompts). Decoding steps (T small) also use the recurrence.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _fla_ops():
    try:
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception:  # not installed, or no working Triton backend
        return None
    return chunk_gla, chunk_delta_rule, chunk_simple_gla


@functools.cache
def _fla_conv():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:
        return None
    return causal_conv1d


@functools.cache
def _head_gated_backward_ok() -> bool:
    """flash-linear-attention refuses the backward of its head-gated kernel (chunk_simple_gla) on Hopper
    with Triton 3.4 to 3.7.0, which miscompile it; there the per-channel kernel (chunk_gla) trains."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:
        return False
    return not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def _use_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and x.shape[1] >= 16 and _fla_ops() is not None


def gla_recurrence(q, k, v, log_g, scale, state=None):
    """S_t = diag(exp(log_g_t)) S_{t-1} + k_t v_t^T;  o_t = scale * q_t S_t.

    q, k, log_g: (B, T, H, K); v: (B, T, H, V); state: (B, H, K, V) float32 or None.
    """
    B, T, H, K = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 inputs
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=acc) if state is None else state.to(acc)
    qf, kf, vf, gf = q.to(acc), k.to(acc), v.to(acc), log_g.to(acc)
    out = []
    for t in range(T):
        S = S * gf[:, t].exp().unsqueeze(-1) + kf[:, t].unsqueeze(-1) * vf[:, t].unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", qf[:, t], S) * scale)
    o = torch.stack(out, dim=1) if out else vf.new_zeros(B, 0, H, v.shape[-1])
    return o.to(v.dtype), S


def delta_rule_recurrence(q, k, v, beta, scale, state=None):
    """S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T;  o_t = scale * q_t S_t.

    q, k: (B, T, H, K); v: (B, T, H, V); beta: (B, T, H); state: (B, H, K, V) float32 or None.
    """
    B, T, H, K = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=acc) if state is None else state.to(acc)
    qf, kf, vf, bf = q.to(acc), k.to(acc), v.to(acc), beta.to(acc)
    out = []
    for t in range(T):
        kt = kf[:, t]
        err = vf[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + (bf[:, t, :, None, None] * kt.unsqueeze(-1)) * err.unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", qf[:, t], S) * scale)
    o = torch.stack(out, dim=1) if out else vf.new_zeros(B, 0, H, v.shape[-1])
    return o.to(v.dtype), S


def gated_linear_attention(q, k, v, log_g, scale, state=None):
    if _use_fla(q):
        chunk_gla = _fla_ops()[0]
        o, S = chunk_gla(q, k, v, log_g.float(), scale=scale,
                         initial_state=state, output_final_state=True)
        return o.to(v.dtype), S
    return gla_recurrence(q, k, v, log_g, scale, state)


def head_gated_linear_attention(q, k, v, log_g, scale, state=None):
    """Gated linear attention with one decay per head, log_g (B, T, H) (Mamba-2's SSD): the kernel takes q,
    k and v in q's dtype (bfloat16 under autocast, as Mamba-2's own kernel does) with float32 decays, so no
    float32 copies of q and k are stored for the backward. Where that kernel's backward is refused (see
    ``_head_gated_backward_ok``) and gradients are needed, the decay is broadcast over the key channels for
    the per-channel kernel. The output is in v's dtype."""
    if _use_fla(q):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, log_g))
        if grad and not _head_gated_backward_ok():
            o, S = gated_linear_attention(q, k, v.to(q.dtype), log_g.unsqueeze(-1).expand_as(q), scale, state)
            return o.to(v.dtype), S
        chunk_simple_gla = _fla_ops()[2]
        o, S = chunk_simple_gla(q, k, v.to(q.dtype), log_g.float(), scale=scale,
                                initial_state=state, output_final_state=True)
        return o.to(v.dtype), S
    return gla_recurrence(q, k, v, log_g.unsqueeze(-1).expand_as(q), scale, state)


def delta_rule(q, k, v, beta, scale, state=None, l2_normalize_qk: bool = False):
    """The delta rule; with ``l2_normalize_qk``, of ``l2_normalize(q)`` and ``l2_normalize(k)`` (inside
    flash-linear-attention's kernel, the same formula and eps, rather than as separate float32 ops)."""
    # flash-linear-attention's chunk_delta_rule takes 16-bit inputs only (0.6 refuses float32): float32
    # models run the float32 recurrence
    if _use_fla(q) and q.dtype in (torch.bfloat16, torch.float16):
        chunk_delta_rule = _fla_ops()[1]
        o, S = chunk_delta_rule(q, k, v, beta.to(q.dtype), scale=scale, initial_state=state, output_final_state=True,
                                use_qk_l2norm_in_kernel=l2_normalize_qk)
        return o.to(v.dtype), S
    if l2_normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    return delta_rule_recurrence(q, k, v, beta, scale, state)


def short_conv(x, weight, state=None, activation: bool = True, bias=None):
    """Causal depthwise convolution over time: x (B, T, C), weight (C, 1, W), optional bias (C,); state
    (B, W-1, C), the last W-1 inputs before x (zeros at the start). Returns (y, new state)."""
    W = weight.shape[-1]
    B, T, C = x.shape
    if T == 0:  # no new input: an empty output, and the window as it was
        return x.new_zeros(B, 0, C), (x.new_zeros(B, W - 1, C) if state is None else state.to(x.dtype))
    if state is None and T >= W - 1 and _use_fla(x) and _fla_conv() is not None:
        # flash-linear-attention's fused Triton convolution (+ SiLU): cuDNN's depthwise conv1d and its
        # backward cost DeltaNet's training step about as much as the delta rule itself
        y, _ = _fla_conv()(x.contiguous(), weight.view(C, W).to(x.dtype),
                           None if bias is None else bias.to(x.dtype), activation="silu" if activation else None)
        return y, x[:, T - (W - 1):].clone()
    prev = x.new_zeros(B, W - 1, C) if state is None else state.to(x.dtype)
    full = torch.cat([prev, x], dim=1)  # (B, W-1+T, C)
    y = F.conv1d(full.transpose(1, 2), weight.to(x.dtype), None if bias is None else bias.to(x.dtype),
                 groups=C).transpose(1, 2)
    if activation:
        y = F.silu(y)
    return y, full[:, -(W - 1):] if W > 1 else full[:, :0]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last axis, computed in (at least) float32."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
