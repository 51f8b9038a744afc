"""Mamba's selective scan (Gu & Dao 2023), the sequence mixer of SAMBA's Mamba layers.

    out, final_state = selective_scan(x, dt, A, B, C, D, z, dt_bias, initial_state)

For each batch row, channel e and state n, with delta_t = softplus(dt_t + dt_bias) per channel:

    h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t        (h_{-1} = initial_state, or 0)
    y_t = C_t . h_t + D x_t;   out_t = y_t * silu(z_t)

Shapes: x, dt, z (batch, T, E); A (E, N) (negative: -exp(A_log)); B, C (batch, T, N); D, dt_bias (E,);
initial_state and the returned final state (batch, E, N), float32 (float64 for float64 inputs). The
output has x's dtype; everything in between is computed in float32 (float64 for float64 inputs). The
time-step bias is added inside the scan in float32, as the reference implementation's CUDA path does.

Three implementations of the same function:

* ``selective_scan_reference``: one step per token, plainly the recurrence above (any float dtype; the
  yardstick of the tests);
* ``selective_scan_chunked``: PyTorch, CPU and float64: a Hillis-Steele scan inside chunks of 32 steps, the
  state carried from chunk to chunk (32x fewer Python steps than the reference);
* the Triton kernels (``selective_scan_triton``), forward and backward, for CUDA tensors (and CPU tensors
  under ``TRITON_INTERPRET=1``), as a ``torch.library`` custom op so ``torch.compile`` traces through it.

``selective_scan`` picks the Triton kernels for CUDA tensors of 16 or 32 bits and the chunked path
otherwise. ``initial_state`` carries a decoding cache's state and is not differentiated.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def _check(x, dt, A, B, C, D, z, dt_bias, initial_state) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be (batch, T, channels), got shape {tuple(x.shape)}")
    batch, T, E = x.shape
    if A.dim() != 2 or A.shape[0] != E:
        raise ValueError(f"A must be (channels, state) = ({E}, N), got shape {tuple(A.shape)}")
    N = A.shape[1]
    expected = {"dt": (dt, (batch, T, E)), "z": (z, (batch, T, E)), "B": (B, (batch, T, N)), "C": (C, (batch, T, N)),
                "D": (D, (E,)), "dt_bias": (dt_bias, (E,)), "initial_state": (initial_state, (batch, E, N))}
    for name, (t, shape) in expected.items():
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name} must be on {x.device} (x's device), got {t.device}")


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64 inputs


def _delta(dt, dt_bias, acc):
    return F.softplus(dt.to(acc) if dt_bias is None else dt.to(acc) + dt_bias.to(acc))


def _finish(y, x, D, z, acc):
    if D is not None:
        y = y + x.to(acc) * D.to(acc)
    if z is not None:
        y = y * F.silu(z.to(acc))
    return y.to(x.dtype)


def selective_scan_reference(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_state=None):
    """The recurrence, one step per token. -> (out, final state)."""
    _check(x, dt, A, B, C, D, z, dt_bias, initial_state)
    acc = _acc_dtype(x)
    batch, T, E = x.shape
    delta, A = _delta(dt, dt_bias, acc), A.to(acc)
    xf, Bf, Cf = x.to(acc), B.to(acc), C.to(acc)
    h = x.new_zeros(batch, E, A.shape[1], dtype=acc) if initial_state is None else initial_state.to(acc)
    ys = []
    for t in range(T):
        h = torch.exp(delta[:, t, :, None] * A) * h + (delta[:, t] * xf[:, t])[:, :, None] * Bf[:, t, None, :]
        ys.append((h * Cf[:, t, None, :]).sum(-1))
    y = torch.stack(ys, 1) if ys else xf.new_zeros(batch, 0, E)
    return _finish(y, x, D, z, acc), h


def selective_scan_chunked(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_state=None, chunk: int = 32):
    """The recurrence as a Hillis-Steele scan over each chunk of ``chunk`` steps (log2(chunk) passes over
    (batch, chunk, E, N) tensors), the state carried between chunks. -> (out, final state)."""
    _check(x, dt, A, B, C, D, z, dt_bias, initial_state)
    acc = _acc_dtype(x)
    batch, T, E = x.shape
    delta, A = _delta(dt, dt_bias, acc), A.to(acc)
    xf, Bf, Cf = x.to(acc), B.to(acc), C.to(acc)
    h = x.new_zeros(batch, E, A.shape[1], dtype=acc) if initial_state is None else initial_state.to(acc)
    ys = []
    for s in range(0, T, chunk):
        d = delta[:, s:s + chunk]
        a = torch.exp(d[..., None] * A)  # (batch, L, E, N): h_t = a_t h_{t-1} + b_t
        b = (d * xf[:, s:s + chunk])[..., None] * Bf[:, s:s + chunk, None, :]
        step = 1
        while step < a.shape[1]:  # after this pass, step t composes the 2 * step steps that end at t
            b = torch.cat([b[:, :step], a[:, step:] * b[:, :-step] + b[:, step:]], 1)
            a = torch.cat([a[:, :step], a[:, step:] * a[:, :-step]], 1)
            step *= 2
        hs = a * h[:, None] + b
        ys.append(torch.einsum("blen,bln->ble", hs, Cf[:, s:s + chunk]))
        h = hs[:, -1]
    y = torch.cat(ys, 1) if ys else xf.new_zeros(batch, 0, E)
    return _finish(y, x, D, z, acc), h


@torch.library.custom_op("fox_models::selective_scan_fwd", mutates_args=())
def _fwd_op(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    save_states: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, final state, chunk-start states for the backward: empty without ``save_states``)."""
    from fox_models.samba.selective_scan_triton import scan_forward

    return scan_forward(x, dt, A, B, C, D, z, dt_bias, initial_state, save_states)


@_fwd_op.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, initial_state, save_states):
    from fox_models.samba.selective_scan_triton import n_chunks

    batch, T, E = x.shape
    N = A.shape[1]
    states = x.new_empty((batch, n_chunks(T), E, N) if save_states else (0,), dtype=torch.float32)
    return x.new_empty(x.shape), x.new_empty(batch, E, N, dtype=torch.float32), states


@torch.library.custom_op("fox_models::selective_scan_bwd", mutates_args=())
def _bwd_op(
    dout: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """(dx, ddt, dA, dB, dC, dD, dz, ddt_bias); an empty tensor for an absent input."""
    from fox_models.samba.selective_scan_triton import scan_backward

    grads = scan_backward(dout, x, dt, A, B, C, D, z, dt_bias, states)
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@_bwd_op.register_fake
def _(dout, x, dt, A, B, C, D, z, dt_bias, states):
    like = lambda t, dtype=None: x.new_empty(0) if t is None else t.new_empty(t.shape, dtype=dtype)
    f32 = torch.float32
    return (like(x), like(dt), like(A, f32), like(B), like(C), like(D, f32), like(z), like(dt_bias, f32))


def _setup_context(ctx, inputs, output):
    x, dt, A, B, C, D, z, dt_bias, _initial_state, _save_states = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, output[2])


def _backward(ctx, dout, _dfinal, _dstates):
    x, dt, A, B, C, D, z, dt_bias, states = ctx.saved_tensors
    if states.numel() == 0:
        raise RuntimeError("selective_scan ran without saving its states (no input required a gradient then), "
                           "so it has no backward")
    dx, ddt, dA, dB, dC, dD, dz, dbias = _bwd_op(dout, x, dt, A, B, C, D, z, dt_bias, states)
    grads = [dx, ddt, dA.to(A.dtype), dB, dC]
    grads += [None if t is None else g.to(t.dtype) for t, g in ((D, dD), (z, dz), (dt_bias, dbias))]
    return (*grads, None, None)


torch.library.register_autograd("fox_models::selective_scan_fwd", _backward, setup_context=_setup_context)


def selective_scan_triton(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_state=None):
    """The Triton kernels (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``). -> (out, final state)."""
    _check(x, dt, A, B, C, D, z, dt_bias, initial_state)
    inputs = (x, dt, A, B, C, D, z, dt_bias)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    out, final, _ = _fwd_op(x, dt, A, B, C, D, z, dt_bias, initial_state, save)
    return out, final


def _use_triton(x: torch.Tensor) -> bool:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def selective_scan(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_state=None):
    """The selective scan (module docstring): the Triton kernels on CUDA, the chunked PyTorch scan on the
    CPU and in float64. -> (out (batch, T, E) in x's dtype, final state (batch, E, N))."""
    if _use_triton(x):
        return selective_scan_triton(x, dt, A, B, C, D, z, dt_bias, initial_state)
    return selective_scan_chunked(x, dt, A, B, C, D, z, dt_bias, initial_state)
