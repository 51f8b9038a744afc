"""Fused Triton kernels vs their PyTorch twins (float64), forward and gradients.

On the CPU these run only through the interpreter (test_interpreted_kernels below); on a GPU directly.
"""

import os
import re

import pytest
import torch

from fox_kernel.testing import run_interpreted
from fox_layers import GroupRMSNorm, RMSNorm, ShiftLinear, SwiGLUMLP
from fox_layers.kernels.norm_gate import _NormGate, norm_gate, norm_gate_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CAN_RUN = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def _rows_of(shape, layout, dtype, extra=5):
    """Random data shaped ``shape``: contiguous, or the first columns of a wider buffer (a slice of a fused
    projection's output, read in place by the kernels)."""
    if layout == "contiguous":
        return torch.randn(*shape, device=DEVICE, dtype=dtype)
    return torch.randn(*shape[:-1], shape[-1] + extra, device=DEVICE, dtype=dtype)[..., extra:]


@pytest.mark.skipif(not CAN_RUN, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("groups", [(4, 24), (1, 72)])
@pytest.mark.parametrize("layout", ["contiguous", "slice"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("act", ["sigmoid", "silu", None])
@pytest.mark.parametrize("dtype", [torch.float32] + ([] if INTERPRET else [torch.bfloat16]))
def test_norm_gate_matches_twin(groups, layout, shared, act, dtype):
    """Forward and gradients against the float64 twin; more rows than one tile holds, rows read in place or
    contiguous; the no-grad path (no autograd.Function) gives the same output."""
    torch.manual_seed(0)
    G, Dg = groups
    x = _rows_of((3, 29, G * Dg), layout, dtype).requires_grad_()
    gate = _rows_of((3, 29, G * Dg), layout, dtype).requires_grad_() if act else None
    w = (1 + 0.3 * torch.randn(Dg if shared else G * Dg, device=DEVICE)).requires_grad_()
    y = _NormGate.apply(x, w, gate, G, 1e-6, act or "sigmoid")
    leaves = [x, w] + ([gate] if act else [])
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = norm_gate_reference(ref_leaves[0], ref_leaves[1], ref_leaves[2] if act else None, G, 1e-6, act or "sigmoid")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    with torch.no_grad():
        torch.testing.assert_close(norm_gate(x, w, gate, G, 1e-6, act or "sigmoid"), y, rtol=0, atol=0)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.double())
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=tol * 5, atol=tol * 5)


def test_norm_gate_refuses_mismatched_weight_and_gate():
    x = torch.randn(2, 5, 12)
    with pytest.raises(ValueError, match=r"weight must have 12 or 4 elements .* got 5"):
        norm_gate(x, torch.ones(5), None, 3, 1e-6)
    with pytest.raises(ValueError, match=r"gate must be shaped like x \(2, 5, 12\), got \(1, 5, 12\)"):
        norm_gate(x, torch.ones(12), torch.randn(1, 5, 12), 3, 1e-6)
    with pytest.raises(ValueError, match=r"^weight must have 12 elements for x \(\.\.\., 12\) in 1 group, got 8$"):
        norm_gate(x, torch.ones(8), None, 1, 1e-6)
    with pytest.raises(ValueError, match=r"^act must be 'sigmoid' or 'silu', got 'relu'$"):  # it ran as sigmoid
        norm_gate(x, torch.ones(12), torch.randn(2, 5, 12), 3, 1e-6, "relu")


def test_shift_and_mlp_sizes_out_of_range_are_one_line():
    """A ZeroDivisionError for no heads, and an MLP of width 0 built without a word."""
    with pytest.raises(ValueError, match=r"^num_heads must be an int >= 1, got 0$"):
        ShiftLinear(8, 6, 0)
    for ratio in (0, -1.0):
        with pytest.raises(ValueError, match=rf"^hidden_ratio must be a finite number > 0, got {ratio}$"):
            SwiGLUMLP(8, hidden_ratio=ratio)
    with pytest.raises(ValueError, match=r"^hidden_ratio 0.01 gives an MLP of width 0 for hidden_size 8"):
        SwiGLUMLP(8, hidden_ratio=0.01)
    assert SwiGLUMLP(8, hidden_ratio=None, intermediate_size=16).intermediate_size == 16


@pytest.mark.parametrize("build, message", [
    # a ZeroDivisionError (no groups); a negative group count or an epsilon <= 0 was built (NaN outputs)
    (lambda: norm_gate(torch.randn(2, 8), torch.ones(8), None, 0, 1e-6), "num_groups must be an int >= 1, got 0"),
    (lambda: GroupRMSNorm(0, 8), "num_groups must be an int >= 1, got 0"),
    (lambda: GroupRMSNorm(-2, 8), "num_groups must be an int >= 1, got -2"),
    (lambda: GroupRMSNorm(2, 8, eps=-1.0), "eps must be a finite number > 0, got -1.0"),
    (lambda: RMSNorm(-1), "hidden_size must be an int >= 1, got -1"),  # "negative dimension -1" from torch.ones
    (lambda: RMSNorm(8, eps=0.0), "eps must be a finite number > 0, got 0.0"),
    # "negative dimension" from nn.Linear
    (lambda: ShiftLinear(-1, 8, 2), "input_dim must be an int >= 1, got -1"),
    (lambda: ShiftLinear(8, -2, 2), "output_dim must be an int >= 1, got -2"),
    # blamed hidden_ratio ("gives an MLP of width 0 for hidden_size -8"), or a TypeError from nn.Linear
    (lambda: SwiGLUMLP(-8), "hidden_size must be an int >= 1, got -8"),
    (lambda: SwiGLUMLP(8.0), "hidden_size must be an int >= 1, got 8.0"),
])
def test_norm_shift_and_mlp_sizes_and_epsilons_are_named(build, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build()


def test_shift_linear_inputs_of_another_shape_are_named():
    """A 2-D x failed to unpack, another width in the matmul, a state of another width in a concatenation."""
    shift = ShiftLinear(8, 6, 2)
    for x in (torch.randn(3, 8), torch.randn(1, 3, 5)):
        with pytest.raises(ValueError, match=f"^{re.escape(f'x must be (B, T, input_dim=8), got {tuple(x.shape)}')}$"):
            shift(x)
    with pytest.raises(ValueError, match=r"^state must be \(B, output_dim\) = \(2, 6\), got \(2, 4\)$"):
        shift(torch.randn(2, 3, 8), state=torch.randn(2, 4))


@pytest.mark.interpret
def test_interpreted_kernels():
    if INTERPRET:
        pytest.skip("already interpreted")
    run_interpreted(__file__)


@pytest.mark.skipif(not CAN_RUN, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", ["plain", "state", "seq_start", "seq_start_past", "varlen", "slice"])
def test_shift_matches_twin(case):
    """Forward and gradients against the float64 twin; "slice": cur and s are slices of one wider buffer (a
    fused projection's output), read in place; the no-grad path gives the same output."""
    from fox_layers.kernels.shift import shift_mix
    from fox_layers.shift import previous_tokens

    torch.manual_seed(1)
    B, T, H, D = (1, 20, 3, 16) if case == "varlen" else (3, 11, 3, 16)
    if case == "slice":
        both = torch.randn(B, T, H * D + H + 3, device=DEVICE)
        cur, s = both[..., : H * D].requires_grad_(), both[..., H * D : H * D + H].requires_grad_()
    else:
        cur = torch.randn(B, T, H * D, device=DEVICE, requires_grad=True)
        s = torch.randn(B, T, H, device=DEVICE, requires_grad=True)
    state = torch.randn(B, H * D, device=DEVICE, requires_grad=True) if case in ("state", "seq_start_past") else None
    seq_start = torch.tensor([0, 4, 11], device=DEVICE) if case.startswith("seq_start") else None
    past = 5 if case == "seq_start_past" else 0
    if seq_start is not None and past:
        seq_start = torch.tensor([0, 6, 16], device=DEVICE)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32, device=DEVICE) if case == "varlen" else None
    out = shift_mix(cur, s, state, seq_start, cu, past)
    with torch.no_grad():
        torch.testing.assert_close(shift_mix(cur, s, state, seq_start, cu, past), out, rtol=0, atol=0)
    leaves = [cur, s] + ([state] if state is not None else [])
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rc, rs = ref_leaves[0], ref_leaves[1]
    rstate = ref_leaves[2] if state is not None else None
    prev = previous_tokens(rc, rstate, seq_start, cu, past)
    a = torch.sigmoid(rs)[..., None]
    ref = (a * prev.view(B, T, H, D) + (1 - a) * rc.view(B, T, H, D)).view(B, T, H * D)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, leaves, dy), torch.autograd.grad(ref, ref_leaves, dy.double())):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not CAN_RUN, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("layout", ["contiguous", "slice"])
@pytest.mark.parametrize("dtype", [torch.float32] + ([] if INTERPRET else [torch.bfloat16]))
def test_swiglu_matches_twin(layout, dtype):
    """silu(gate) * up and the gradient of the whole (gate, up) input against the float64 twin; more rows and
    columns than one tile holds; the no-grad path gives the same output."""
    from fox_layers.kernels.swiglu import swiglu, swiglu_reference

    torch.manual_seed(2)
    h = (3 * _rows_of((2, 19, 2 * 300), layout, dtype)).requires_grad_()
    y = swiglu(h)
    ref_h = h.detach().double().requires_grad_()
    ref = swiglu_reference(ref_h)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    with torch.no_grad():
        torch.testing.assert_close(swiglu(h), y, rtol=0, atol=0)
    dy = torch.randn_like(y)
    (g,) = torch.autograd.grad(y, h, dy)
    (r,) = torch.autograd.grad(ref, ref_h, dy.double())
    torch.testing.assert_close(g.double(), r, rtol=tol * 5, atol=tol * 5)
