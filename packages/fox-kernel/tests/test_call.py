"""The call's description (``ops/call.py``): frozen, built once per call at the public boundary and passed
down as the same object; the custom ops' primitive form and the autograd saved form rebuild it exactly."""

import dataclasses

import pytest
import torch

from fox_kernel import KernelOptions, forgetting_attention, forgetting_attention_with_kvcache, kernel_options
from fox_kernel.decode import append_to_cache
from fox_kernel.ops import chunked, dispatch
from fox_kernel.ops.call import AttentionCall
from fox_kernel.options import INTERPRET
from fox_kernel.testing import random_log_fgate


def _inputs(B=2, T=12, H=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, requires_grad=True)
    k = torch.randn(B, T, Hkv, D, generator=g, requires_grad=True)
    v = torch.randn(B, T, Hkv, D, generator=g, requires_grad=True)
    return q, k, v, random_log_fgate((B, T, H), generator=g).requires_grad_()


def test_frozen_and_derived_properties():
    threshold = torch.full((3, 4), -2.0)
    call = AttentionCall(0.5, cu_seqlens=torch.tensor([0, 4, 9, 12], dtype=torch.int32), threshold=threshold,
                         window=5, options=KernelOptions())
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.window = 0
    assert call.pruned and call.has_window and call.varlen and call.n_rows(1) == 3
    plain = AttentionCall(0.5, options=KernelOptions())
    assert not plain.pruned and not plain.has_window and not plain.varlen and plain.n_rows(7) == 7
    assert AttentionCall(0.5, auto_log_eps=-10.0).pruned


def test_op_args_and_saved_form_rebuild_the_call():
    """The custom ops' primitives (``op_args``) and the autograd split (``saved``) give back an equal call;
    the backward's carries the bound it is given and no "auto" tolerance."""
    options = KernelOptions(backward="fused", tma=False)
    seq_start = torch.tensor([0, 3], dtype=torch.int32)
    threshold = torch.full((2, 4), -3.0)
    call = AttentionCall(0.25, seq_start, None, threshold, None, 7, options, zero_gates=False)
    assert AttentionCall.from_op_args(*call.op_args()) == call
    assert AttentionCall.from_op_args(*call.op_args(backward=True)[:4], None, *call.op_args(backward=True)[4:]) == call
    auto = dataclasses.replace(call, threshold=None, auto_log_eps=-10.0)
    bound = torch.full((2, 4), -5.0)
    tensors, rest = auto.saved(bound)
    assert all(t is None or isinstance(t, torch.Tensor) for t in tensors)
    assert not any(isinstance(x, torch.Tensor) for x in rest)  # tensors go to save_for_backward only
    assert AttentionCall.from_saved(tensors, rest) == dataclasses.replace(auto, threshold=bound, auto_log_eps=None)
    # "" is the current options, resolved when the call is rebuilt
    with kernel_options(options):
        assert AttentionCall.from_op_args(None, None, 1.0, None, None).options == options


def _spy(monkeypatch, module, name, calls):
    original = getattr(module, name)

    def spy(*args):
        calls.append(next(a for a in args if isinstance(a, AttentionCall)))
        return original(*args)

    monkeypatch.setattr(module, name, spy)


@pytest.mark.skipif(INTERPRET, reason="CPU calls run the Triton kernels in the interpreter")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_one_description_from_the_boundary_to_the_backward(monkeypatch, compiled):
    """The eager op builds one call and hands that same object to the forward; the backward gets one equal
    to it but for the resolved "auto" bound. Under torch.compile the custom ops rebuild it from their
    primitives: equal to the eager call's."""
    fwd_calls, bwd_calls = [], []
    _spy(monkeypatch, dispatch, "chunked_forward", fwd_calls)
    _spy(monkeypatch, dispatch, "chunked_backward", bwd_calls)
    q, k, v, lf = _inputs()
    seq_start = torch.tensor([0, 2], dtype=torch.int32)
    options = KernelOptions(fixed_bound=False)

    def attend(q, k, v, lf):
        return forgetting_attention(q, k, v, lf, seq_start=seq_start, sm_scale=0.3, window_size=6,
                                    adaptive_threshold="auto", options=options, zero_gates=False)

    run = torch.compile(attend, fullgraph=True, backend="aot_eager") if compiled else attend
    out = run(q, k, v, lf)
    out.sum().backward()
    assert len(fwd_calls) == len(bwd_calls) == 1
    (fc,), (bc,) = fwd_calls, bwd_calls
    # the chunked twin gets the call with the resolved per-head bound in place of the "auto" tolerance
    assert (fc.sm_scale, fc.window, fc.options, fc.auto_log_eps, fc.zero_gates) == (0.3, 6, options, None, False)
    assert torch.equal(fc.seq_start, seq_start) and fc.threshold.shape == (2, 4)
    assert bc.auto_log_eps is None and torch.equal(bc.threshold, fc.threshold)
    assert dataclasses.replace(bc, seq_start=None, threshold=None) == dataclasses.replace(
        fc, seq_start=None, threshold=None)
    if not compiled:  # the eager path passes the boundary's own objects down, no copies
        assert fc.seq_start is bc.seq_start


def test_boundary_builds_the_call_once(monkeypatch):
    """One ``AttentionCall`` per eager forward (the boundary's), one more in its backward (from the saved
    form); none in between."""
    built = []
    original_init = AttentionCall.__init__

    def counting_init(self, *args, **kwargs):
        built.append(1)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(AttentionCall, "__init__", counting_init)
    q, k, v, lf = _inputs(seed=1)
    out = forgetting_attention(q, k, v, lf, window_size=4, adaptive_threshold=-3.0)
    assert len(built) == 1
    out.sum().backward()
    assert len(built) == 2


@pytest.mark.skipif(INTERPRET, reason="CPU calls run the Triton kernels in the interpreter")
def test_decode_on_cpu_is_the_chunked_twin(monkeypatch):
    """The decoding call's PyTorch path is ``chunked.forward_from_sums``: ragged rows, a window and starts
    give what the full chunked forward gives on each row's own tokens."""
    calls = []
    import fox_kernel.decode as decode

    original = chunked.forward_from_sums

    def spy(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(decode, "forward_from_sums", spy)
    B, T, H, Hkv, D, Tq = 3, 20, 4, 2, 8, 3
    q, k, v, lf = (x.detach() for x in _inputs(B, T, H, Hkv, D, seed=2))
    seq_start = torch.tensor([0, 5, 1])
    _, _, c = append_to_cache(None, None, None, k, v, lf, seq_start=seq_start)
    lens = [20, 11, 3]
    out = forgetting_attention_with_kvcache(q[:, -Tq:], k, v, c, torch.tensor(lens, dtype=torch.int32),
                                            seq_start=seq_start, window_size=6, adaptive_threshold=-1.0)
    assert len(calls) == 1
    call = calls[0][5]
    assert isinstance(call, AttentionCall) and call.window == 6 and call.threshold is None  # the CPU path is exact
    for b, L in enumerate(lens):
        qb = torch.zeros(1, L, H, D)
        qb[:, L - Tq:] = q[b:b + 1, -Tq:]
        row_call = AttentionCall(D**-0.5, seq_start[b:b + 1], window=6, options=KernelOptions())
        want, _ = chunked.chunked_forward(qb, k[b:b + 1, :L], v[b:b + 1, :L], lf[b:b + 1, :L], row_call)
        torch.testing.assert_close(out[b:b + 1], want[:, L - Tq:], rtol=1e-5, atol=1e-5)
