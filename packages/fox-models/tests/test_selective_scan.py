"""Mamba's selective scan (SAMBA's Mamba layers): the chunked PyTorch scan and the Triton kernels against the
one-step-per-token reference in float64, outputs and every gradient, on odd shapes.

On the CPU the Triton tests run through the interpreter (``test_triton_kernels_in_the_interpreter`` re-runs
this file with TRITON_INTERPRET=1, float32); on a GPU they run compiled, in float32 and bfloat16.
"""

import os

import pytest
import torch

from fox_kernel.testing import assert_close_to_reference, run_interpreted
from fox_models.samba import selective_scan_triton as kernels
from fox_models.samba.selective_scan import (
    selective_scan,
    selective_scan_chunked,
    selective_scan_reference,
    selective_scan_triton,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# where the Triton kernels run: the interpreter on the CPU (float32), or a GPU
TRITON_CASES = [
    pytest.param("cpu", torch.float32, id="interpreted-fp32",
                 marks=pytest.mark.skipif(not INTERPRET, reason="runs under TRITON_INTERPRET=1")),
    pytest.param("cuda", torch.float32, id="cuda-fp32", marks=[pytest.mark.gpu, CUDA]),
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=[pytest.mark.gpu, CUDA]),
]


def scan_inputs(batch, T, E, N, *, z=True, bias=True, skip=True, seed=0):
    """Float64 CPU inputs of a scan: decays exp(delta A) spread over (0, 1) (A = -exp(N(1, 0.5)), delta
    around softplus(-1)), everything else O(1)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    args = dict(x=r(batch, T, E), dt=r(batch, T, E) - 1, A=-torch.exp(1 + 0.5 * r(E, N)), B=r(batch, T, N),
                C=r(batch, T, N), D=r(E) if skip else None, z=r(batch, T, E) if z else None,
                dt_bias=0.5 * r(E) if bias else None)
    return args


def cast(args, device, dtype):
    """The inputs on ``device``, x/dt/z/B/C in ``dtype`` and A/D/dt_bias float32 (as the model passes them)."""
    out = {}
    for name, t in args.items():
        if t is not None:
            t = t.to(device=device, dtype=dtype if name in ("x", "dt", "z", "B", "C") else torch.float32)
        out[name] = t
    return out


def run(fn, args, dout, initial_state=None):
    """(out, final state, gradients of every input given, by name)."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in args.items() if v is not None}
    out, final = fn(**{**args, **leaves}, initial_state=initial_state)
    grads = torch.autograd.grad(out, list(leaves.values()), dout.to(out.dtype))
    return out, final, dict(zip(leaves, grads))


def test_reference_is_the_closed_form():
    """h_t = sum_{s<=t} exp((delta_{s+1} + ... + delta_t) A) delta_s B_s x_s, written out term by term."""
    a = scan_inputs(2, 9, 3, 4, z=False, skip=False)
    out, final = selective_scan_reference(**a)
    delta = torch.nn.functional.softplus(a["dt"] + a["dt_bias"])  # (b, t, e)
    cum = delta.cumsum(1)
    h = torch.zeros(2, 9, 3, 4, dtype=torch.float64)
    for t in range(9):
        for s in range(t + 1):
            decay = torch.exp((cum[:, t] - cum[:, s])[..., None] * a["A"])  # (b, e, n)
            h[:, t] += decay * (delta[:, s] * a["x"][:, s])[..., None] * a["B"][:, s, None, :]
    torch.testing.assert_close(out, torch.einsum("bten,btn->bte", h, a["C"]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, h[:, -1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch,T,E,N", [(2, 1, 3, 4), (1, 31, 5, 16), (2, 33, 7, 3), (2, 130, 6, 5)])
def test_chunked_equals_the_reference(batch, T, E, N):
    a = scan_inputs(batch, T, E, N)
    dout = torch.randn(batch, T, E, dtype=torch.float64)
    h0 = torch.randn(batch, E, N, dtype=torch.float64)
    want, want_h, want_g = run(selective_scan_reference, a, dout, h0)
    got, got_h, got_g = run(selective_scan_chunked, a, dout, h0)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_h, want_h, rtol=1e-10, atol=1e-10)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-10, atol=1e-10, msg=name)


def test_splitting_the_sequence_and_carrying_the_state():
    a = scan_inputs(2, 40, 5, 6)
    whole, final = selective_scan(**a)
    first = {k: v if v is None or v.dim() < 3 else v[:, :17] for k, v in a.items()}
    second = {k: v if v is None or v.dim() < 3 else v[:, 17:] for k, v in a.items()}
    y1, h1 = selective_scan(**first)
    y2, h2 = selective_scan(**second, initial_state=h1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h2, final, rtol=1e-12, atol=1e-12)


def test_bad_inputs_name_the_argument():
    a = scan_inputs(1, 5, 3, 4)
    with pytest.raises(ValueError, match=r"B must have shape \(1, 5, 4\)"):
        selective_scan(**{**a, "B": a["B"][:, :, :3]})
    with pytest.raises(ValueError, match=r"A must be \(channels, state\)"):
        selective_scan(**{**a, "A": a["A"].T})
    with pytest.raises(ValueError, match="x must be"):
        selective_scan(**{**a, "x": a["x"][0]})


# odd lengths (1, 7, 37, 130: partial tiles), odd channel counts (partial channel blocks), states not a power of 2
SHAPES = [(1, 1, 3, 4), (2, 7, 5, 16), (1, 37, 19, 16), (2, 130, 7, 3)]


def _check_triton(device, dtype, batch, T, E, N, initial_state=False, **flags):
    exact_in = scan_inputs(batch, T, E, N, **flags)
    dout = torch.randn(batch, T, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    h0 = torch.randn(batch, E, N, dtype=torch.float64) if initial_state else None
    exact, exact_h, exact_g = run(selective_scan_reference, exact_in, dout, h0)
    # the same-precision yardstick: the reference in the kernels' dtype (on the CPU)
    same_in = cast(exact_in, "cpu", dtype)
    same, same_h, same_g = run(selective_scan_reference, same_in, dout, None if h0 is None else h0.float())
    got_in = cast(exact_in, device, dtype)
    got, got_h, got_g = run(selective_scan_triton, got_in, dout.to(device),
                            None if h0 is None else h0.float().to(device))
    assert got.dtype == dtype and got_h.dtype == torch.float32
    assert_close_to_reference(got.cpu(), exact, same, name="out")
    assert_close_to_reference(got_h.cpu(), exact_h, same_h, name="final state")
    for name in exact_g:
        assert got_g[name].dtype == got_in[name].dtype, name
        assert_close_to_reference(got_g[name].cpu(), exact_g[name], same_g[name], name=f"d{name}")


@pytest.mark.parametrize("device,dtype", TRITON_CASES)
@pytest.mark.parametrize("batch,T,E,N", SHAPES)
def test_triton_forward_and_gradients(device, dtype, batch, T, E, N):
    _check_triton(device, dtype, batch, T, E, N)


@pytest.mark.parametrize("device,dtype", TRITON_CASES)
def test_triton_without_z_d_bias_and_from_a_state(device, dtype):
    _check_triton(device, dtype, 2, 21, 5, 4, initial_state=True, z=False, bias=False, skip=False)


@pytest.mark.parametrize("device,dtype", TRITON_CASES)
def test_triton_backward_across_saved_chunks(device, dtype, monkeypatch):
    """States saved every 32 steps (2 tiles of the backward, 4 of the forward): the backward recomputes each
    chunk from its own saved state; the passes need not share their tile shapes."""
    monkeypatch.setattr(kernels, "CHUNK", 32)
    monkeypatch.setattr(kernels, "FORWARD", (8, 4, 2))
    monkeypatch.setattr(kernels, "BACKWARD", (16, 8, 4))
    _check_triton(device, dtype, 2, 75, 11, 4)


@pytest.mark.parametrize("device,dtype", TRITON_CASES)
def test_triton_strided_b_c_and_z(device, dtype):
    """B and C as slices of one projection, z as half of another (the model's layout): no copies needed."""
    a = cast(scan_inputs(2, 20, 6, 4), device, dtype)
    bc = torch.cat([a["B"], a["C"], a["B"][..., :1]], -1)
    xz = torch.cat([a["x"], a["z"]], -1)
    views = dict(a, B=bc[..., :4], C=bc[..., 4:8], z=xz[..., 6:])
    torch.testing.assert_close(selective_scan_triton(**views)[0], selective_scan_triton(**a)[0], rtol=0, atol=0)


@pytest.mark.parametrize("device,dtype", TRITON_CASES)
@pytest.mark.parametrize("save_states", [True, False])
def test_triton_custom_op_opcheck(device, dtype, save_states):
    """The custom op's schema, fake tensors (torch.compile) and autograd registration."""
    from fox_models.samba import selective_scan as ops

    a = cast(scan_inputs(2, 20, 5, 4), device, dtype)
    args = [a[k].requires_grad_(save_states) for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")]
    torch.library.opcheck(ops._fwd_op, (*args, None, save_states))


@pytest.mark.gpu
@CUDA
def test_triton_large_offsets():
    """batch x T x E past 2^31 elements through z's strides: int64 offsets (a 16k context, 3072 channels)."""
    batch, T, E, N = 2, 16384, 3072, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)
    # z inside rows of width 2^31 / (batch T) + E: its last rows start past 2^31 elements
    wide = torch.zeros(batch, T, 2**31 // (batch * T) + E, device="cuda", dtype=torch.bfloat16)
    z = wide[..., :E]
    z.copy_(r(batch, T, E))
    assert (batch - 1) * z.stride(0) + (T - 1) * z.stride(1) >= 2**31
    x, dt = r(batch, T, E), r(batch, T, E) - 1
    A = -torch.exp(torch.randn(E, N, device="cuda"))
    B, C = r(batch, T, N), r(batch, T, N)
    out, _ = selective_scan_triton(x, dt, A, B, C, None, z)
    ref, _ = selective_scan_triton(x, dt, A, B, C, None, z.contiguous())
    assert torch.equal(out, ref)


@pytest.mark.interpret
def test_triton_kernels_in_the_interpreter():
    if INTERPRET:
        pytest.skip("already inside the interpreted run")
    pytest.importorskip("numpy")
    run_interpreted(__file__, select="triton and interpreted and not in_the_interpreter", timeout=1200)
