"""The op is a torch.library custom op: opcheck passes and torch.compile(fullgraph=True) traces it."""

import pytest
import torch

from fox_kernel import forgetting_attention
from fox_kernel.reference import forgetting_attention_ref

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _args(device, dtype=torch.float32, B=2, T=24, H=4, Hkv=2, D=32):
    g = torch.Generator().manual_seed(1)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype).requires_grad_()
    q, k, v = mk(B, T, H, D), mk(B, T, Hkv, D), mk(B, T, Hkv, D)
    lf = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=g) + 2).to(device).requires_grad_()
    return q, k, v, lf


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, k, v, lf = _args(device)
    seq_start = torch.tensor([0, 5], dtype=torch.int32, device=device)
    thr = torch.full((2, 4), -3.0, device=device)
    # (seq_start, threshold, auto_log_eps, window)
    for start, threshold, auto, window in ((None, None, None, 0), (seq_start, None, None, 0), (None, thr, None, 0),
                                           (None, None, -10.0, 0), (seq_start, None, None, 7), (None, thr, None, 5)):
        torch.library.opcheck(torch.ops.fox_kernel.forgetting_attention_fwd.default,
                              (q, k, v, lf, start, None, 32**-0.5, threshold, auto, window))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_forward_and_backward(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, k, v, lf = _args(device)

    def layer(q, k, v, lf):
        return (forgetting_attention(q * 1.5, k, v, lf) * 2).sum() + forgetting_attention(q, k, v, lf, window_size=5).sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    loss = compiled(q, k, v, lf)
    grads = torch.autograd.grad(loss, (q, k, v, lf))
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v, lf)]
    ref_loss = ((forgetting_attention_ref(ref_in[0] * 1.5, *ref_in[1:]) * 2).sum()
                + forgetting_attention_ref(*ref_in, window_size=5).sum())
    ref_grads = torch.autograd.grad(ref_loss, ref_in)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-4, atol=1e-3)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=1e-3, atol=1e-3)


def test_compile_fullgraph_with_thresholds():
    """The argument checks (threshold values on the CPU) stay out of the traced graph: no graph break."""
    q, k, v, lf = _args("cpu")
    thr = torch.full((2, 4), -3.0)
    for threshold in (-3.0, thr):
        compiled = torch.compile(lambda q, k, v, lf: forgetting_attention(q, k, v, lf, adaptive_threshold=threshold),
                                 fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            torch.testing.assert_close(compiled(q, k, v, lf), forgetting_attention(q, k, v, lf, adaptive_threshold=thr))


def test_compile_fullgraph_with_options():
    """Options given to the call or by a kernel_options block are read while tracing: no graph break, and
    the same result as eager."""
    from fox_kernel import KernelOptions, kernel_options

    q, k, v, lf = _args("cpu")
    options = KernelOptions(backward="fused", tma=False)
    eager = forgetting_attention(q, k, v, lf, options=options).sum()
    compiled = torch.compile(lambda q, k, v, lf: forgetting_attention(q, k, v, lf, options=options).sum(),
                             fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, lf), eager)
    with kernel_options(fixed_bound=False):
        compiled = torch.compile(lambda q, k, v, lf: forgetting_attention(q, k, v, lf).sum(), fullgraph=True,
                                 backend="aot_eager")
        loss = compiled(q, k, v, lf)
    grads = torch.autograd.grad(loss, (q, k, v, lf))
    want = torch.autograd.grad(eager, (q, k, v, lf))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_eager_function_equals_the_custom_ops(device):
    """Eager calls run a plain autograd.Function, compiled graphs the custom ops: both give the same output
    and gradients, bit for bit (the same dispatch underneath), with padding, pruning and a window."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, k, v, lf = _args(device, B=2, T=29, H=6, Hkv=3, D=24)
    seq_start = torch.tensor([0, 4], dtype=torch.int32, device=device)
    thr = torch.tensor([[-2.0, -3.0, -1.5, -4.0, -2.5, -3.5]] * 2, device=device)
    do = torch.randn_like(q)
    for start, threshold, auto, window in ((None, None, None, 0), (seq_start, thr, None, 0), (None, None, -10.0, 7)):
        kwargs = dict(seq_start=start, window_size=window or None,
                      adaptive_threshold=threshold if auto is None else "auto")
        eager = forgetting_attention(q, k, v, lf, **kwargs)
        eager_grads = torch.autograd.grad(eager, (q, k, v, lf), do)
        out, _, _ = torch.ops.fox_kernel.forgetting_attention_fwd(q, k, v, lf, start, None, 24**-0.5, threshold, auto,
                                                                  window)
        op_grads = torch.autograd.grad(out, (q, k, v, lf), do)
        torch.testing.assert_close(eager, out, rtol=0, atol=0)
        for a, b in zip(eager_grads, op_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert eager.abs().sum() > 0 and all(g.abs().sum() > 0 for g in eager_grads)
