"""The fused linear + cross-entropy (Triton) against a float64 cross-entropy, values and gradients.

On the CPU it runs only through the interpreter (test_interpreted_fused_loss, float32); on a GPU also in
bf16 under autocast, as training runs it.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from fox_kernel.testing import run_interpreted
from fox_models.loss import per_token_cross_entropy

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CAN_RUN = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def _case(B, T, D, V, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :5] = -100
    labels[-1, -1] = V - 1  # the last real class, next to the padding
    cot = torch.randn(B, T, generator=g, dtype=torch.float64)
    return hidden, weight, labels, cot


def _reference(hidden, weight, labels, cot):
    h, w = (x.clone().requires_grad_() for x in (hidden, weight))
    B, T, _ = h.shape
    loss = F.cross_entropy((h @ w.T).reshape(B * T, -1), labels.reshape(-1), reduction="none").view(B, T)
    loss.backward(cot)
    return loss.detach(), h.grad, w.grad


@pytest.mark.skipif(not CAN_RUN, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("V, pad_multiple, chunk", [(101, 16, 16), (5000, 128, 50), (4096, 1, 1000)])
def test_fused_loss_matches_float64_cross_entropy(V, pad_multiple, chunk):
    """Odd and padded vocabularies, one or two vocabulary tiles (BLOCK_V = 4096), chunks that do not
    divide the tokens, ignored labels and a random cotangent."""
    hidden, weight, labels, cot = _case(2, 37, 24, V, seed=V)
    want, dh_want, dw_want = _reference(hidden, weight, labels, cot)
    h, w = (x.float().to(DEVICE).requires_grad_() for x in (hidden, weight))
    got = per_token_cross_entropy(h, w, labels.to(DEVICE), chunk_tokens=chunk, pad_multiple=pad_multiple, fused=True)
    assert got.dtype == torch.float32 and got.shape == labels.shape
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4)
    assert (got[0, :5] == 0).all()
    got.backward(cot.float().to(DEVICE))
    torch.testing.assert_close(h.grad.double().cpu(), dh_want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad.double().cpu(), dw_want, rtol=1e-4, atol=1e-4)
    assert w.grad.shape == (V, 24)


@pytest.mark.skipif(not CAN_RUN, reason="needs a GPU or TRITON_INTERPRET=1")
def test_fused_loss_flags_out_of_range_labels_and_skips_unneeded_grads():
    hidden, weight, labels, _ = _case(1, 9, 16, 50, seed=3)
    labels[0, 2] = 50  # outside the vocabulary (but inside the padding)
    h = hidden.float().to(DEVICE)
    w = weight.float().to(DEVICE).requires_grad_()
    got = per_token_cross_entropy(h, w, labels.to(DEVICE), pad_multiple=16, fused=True)
    assert torch.isnan(got[0, 2]) and torch.isfinite(got[0, 3:]).all()
    got[0, 3:].sum().backward()  # hidden needs no gradient: only the weight's is made
    assert w.grad is not None and torch.isfinite(w.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU (bf16 is not interpreted)")
def test_fused_loss_bf16_autocast_matches_unfused():
    """bf16 under autocast (training): the fused loss and gradients agree with the float64 reference as
    closely as the unfused chunked path does."""
    hidden, weight, labels, cot = _case(2, 1000, 64, 50257, seed=7)
    want, dh_want, dw_want = _reference(hidden, weight, labels, cot)
    errors = {}
    for fused in (True, False):
        h, w = (x.float().cuda().requires_grad_() for x in (hidden, weight))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = per_token_cross_entropy(h, w, labels.cuda(), chunk_tokens=700, fused=fused)
        got.backward(cot.float().cuda())
        errors[fused] = [(a.double().cpu() - b).abs().max().item() for a, b in
                         ((got, want), (h.grad, dh_want), (w.grad, dw_want))]
    scale = [want.abs().max().item(), dh_want.abs().max().item(), dw_want.abs().max().item()]
    for e_fused, e_plain, s in zip(errors[True], errors[False], scale):
        assert e_fused <= 2 * e_plain + 1e-3 * s, (errors, scale)


@pytest.mark.interpret
def test_interpreted_fused_loss():
    if INTERPRET:
        pytest.skip("already interpreted")
    run_interpreted(__file__)
