"""Sliding-window Forgetting Attention (``window_size``) vs the float64 reference, and the reference itself
against a banded softmax written out here.

On the CPU this runs the chunked PyTorch path; with TRITON_INTERPRET=1 (test_interpreted.py) the Triton
kernels through the interpreter (16-wide tiles, so the windows below cross tile edges in every way); on a
GPU the compiled kernels.
"""

import os

import pytest
import torch

from fox_kernel import KernelOptions, forgetting_attention, forgetting_attention_with_kvcache
from fox_kernel.pruning import pruning_threshold
from fox_kernel.reference import forgetting_attention_ref
from fox_kernel.testing import assert_close_to_reference, random_log_fgate
from fox_kernel.testing import attention_inputs as _inputs

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check(device, dtype, B, Tq, Tk, H, Hkv, D, speed="fast", inputs=None, **kw):
    """Outputs and gradients against float64, within what the same-precision reference misses. For 16-bit
    types also two units in the last place at the result's largest value: with a window of 1 every
    weight is exactly 1 in the reference (no error at all), while the kernels' backward recomputes it
    from the stored log-sum-exp as 1 +- 2^-8, one bfloat16 step."""
    floor = 2.0**-7 if dtype in (torch.bfloat16, torch.float16) else 2e-6
    q, k, v, lf = inputs if inputs is not None else _inputs(B, Tq, Tk, H, Hkv, D, device, dtype, speed)
    out = forgetting_attention(q, k, v, lf, **kw)
    ref_kw = {key: val for key, val in kw.items() if key not in ("adaptive_threshold", "options")}
    exact_in = [x.detach().double().requires_grad_() for x in (q, k, v, lf)]
    same_in = [x.detach().clone().requires_grad_() for x in (q, k, v, lf)]
    exact = forgetting_attention_ref(*exact_in, **ref_kw)
    same = forgetting_attention_ref(*same_in, **ref_kw)
    assert_close_to_reference(out, exact, same, name="out", rtol_floor=floor)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grads = torch.autograd.grad(out, (q, k, v, lf), do)
    exact_grads = torch.autograd.grad(exact, exact_in, do.double())
    same_grads = torch.autograd.grad(same, same_in, do)
    for name, a, e, s in zip(("dq", "dk", "dv", "dlog_fgate"), grads, exact_grads, same_grads):
        assert_close_to_reference(a, e, s, name=name, factor=3.0, rtol_floor=floor)
    return out


def test_reference_window_is_a_banded_softmax():
    """The reference's window against softmax(q k^T s + c_i - c_j) with the band i - W < j <= i written out."""
    g = torch.Generator().manual_seed(3)
    B, T, H, D, W = 2, 29, 3, 8, 6
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    lf = random_log_fgate((B, T, H), generator=g).double()
    c = lf.cumsum(1).permute(0, 2, 1)  # (B, H, T)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * D**-0.5 + c[..., :, None] - c[..., None, :]
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    band = (j <= i) & (j > i - W)
    expected = torch.einsum("bhij,bjhd->bihd", torch.softmax(s.masked_fill(~band, float("-inf")), -1), v)
    torch.testing.assert_close(forgetting_attention_ref(q, k, v, lf, window_size=W), expected)
    assert (forgetting_attention_ref(q, k, v, lf, window_size=W) - forgetting_attention_ref(q, k, v, lf)).abs().max() > 1e-3


@pytest.mark.parametrize("T,W", [(7, 3), (63, 1), (63, 16), (63, 17), (200, 5), (200, 40), (200, 100), (333, 64)])
def test_windows(device_dtype, T, W):
    _check(*device_dtype, B=2, Tq=T, Tk=T, H=3, Hkv=3, D=32, window_size=W)


@pytest.mark.parametrize("D", [16, 64, 80, 128])
def test_window_head_dims(device_dtype, D):
    _check(*device_dtype, B=1, Tq=150, Tk=150, H=2, Hkv=2, D=D, window_size=37)


def test_window_slow_gates_gqa(device_dtype):
    _check(*device_dtype, B=2, Tq=170, Tk=170, H=4, Hkv=2, D=32, speed="slow", window_size=50)


@pytest.mark.parametrize("Tq,Tk,W", [(1, 90, 20), (5, 64, 3), (33, 100, 40), (64, 129, 70)])
def test_window_queries_shorter_than_keys(device_dtype, Tq, Tk, W):
    _check(*device_dtype, B=2, Tq=Tq, Tk=Tk, H=2, Hkv=1, D=32, window_size=W)


def test_window_with_left_padding(device_dtype):
    device, dtype = device_dtype
    seq_start = torch.tensor([0, 17, 70, 90], device=device)
    out = _check(device, dtype, B=4, Tq=90, Tk=90, H=2, Hkv=2, D=32, seq_start=seq_start, window_size=25)
    assert out[3].abs().max() == 0


def test_window_varlen(device_dtype):
    device, dtype = device_dtype
    cu = torch.tensor([0, 5, 70, 71, 160], dtype=torch.int32, device=device)
    _check(device, dtype, B=1, Tq=160, Tk=160, H=2, Hkv=2, D=32, cu_seqlens=cu, window_size=30)


def test_window_head_first(device_dtype):
    device, dtype = device_dtype
    q, k, v, lf = _inputs(2, 80, 80, 3, 3, 32, device, dtype)
    out = forgetting_attention(q, k, v, lf, window_size=20)
    out_hf = forgetting_attention(*(x.transpose(1, 2) for x in (q, k, v)), lf.transpose(1, 2), head_first=True,
                                  window_size=20)
    torch.testing.assert_close(out_hf.transpose(1, 2), out)


@pytest.mark.parametrize("threshold", ["number", "auto"])
def test_window_with_pruning(device_dtype, threshold):
    """Pruning inside the window with the bound of fox_kernel.pruning (eps = e^-10): as a number (the least
    over heads) or "auto"; fast gates, so whole tiles inside the window are skipped. The dropped weight
    is within the reference tolerance."""
    device, dtype = device_dtype
    inputs = _inputs(2, 260, 260, 2, 2, 32, device, dtype, speed="fast")
    if threshold == "number":
        q, k = inputs[0].detach(), inputs[1].detach()
        threshold = float(pruning_threshold(q.float(), k.float(), 32**-0.5, 260).min())
    _check(device, dtype, 2, 260, 260, 2, 2, 32, inputs=inputs, window_size=150, adaptive_threshold=threshold)


def test_window_covering_every_key_is_full_attention(device_dtype):
    device, dtype = device_dtype
    q, k, v, lf = _inputs(2, 70, 70, 2, 2, 32, device, dtype)
    full = forgetting_attention(q, k, v, lf)
    torch.testing.assert_close(forgetting_attention(q, k, v, lf, window_size=70), full, atol=0, rtol=0)
    torch.testing.assert_close(forgetting_attention(q, k, v, lf, window_size=10**6), full, atol=0, rtol=0)


def test_sliding_window_without_forget_gate(device_dtype):
    """Log gates of 0: plain sliding-window softmax attention, against a banded softmax written out here."""
    device, dtype = device_dtype
    g = torch.Generator().manual_seed(5)
    B, T, H, D, W = 2, 130, 2, 32, 33
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    out = forgetting_attention(*(x.to(device, dtype) for x in (q, k, v)), torch.zeros(B, T, H, device=device),
                               window_size=W)
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    band = (j <= i) & (j > i - W)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * D**-0.5
    expected = torch.einsum("bhij,bjhd->bihd", torch.softmax(s.masked_fill(~band, float("-inf")), -1), v.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_bad_window_size_is_named(bad):
    q, k, v, lf = _inputs(1, 8, 8, 1, 1, 16, "cpu", torch.float32)
    with pytest.raises((ValueError, TypeError), match="window_size"):
        forgetting_attention(q, k, v, lf, window_size=bad)


@pytest.mark.parametrize("Tq", [1, 3])
@pytest.mark.parametrize("paged", [False, True])
def test_window_decode(device_dtype, Tq, paged):
    """The newest Tq tokens against a cache, windowed: equal to the windowed full forward's last rows."""
    device, dtype = device_dtype
    B, T, H, Hkv, D, W = 3, 75, 4, 2, 32, 19
    q, k, v, lf = (x.detach() for x in _inputs(B, T, T, H, Hkv, D, device, dtype))
    lens = torch.tensor([75, 50, 30], dtype=torch.int32, device=device)
    c = lf.cumsum(1)
    kw = dict(window_size=W)
    if paged:
        page = 16
        pages = -(-T // page)
        table = torch.randperm(B * pages, generator=torch.Generator().manual_seed(2)).view(B, pages).to(torch.int32)
        kp, vp, cp = (torch.zeros(B * pages, page, *x.shape[2:], dtype=x.dtype, device=device) for x in (k, v, c))
        for b in range(B):
            for p in range(pages):
                rows = slice(p * page, min(T, (p + 1) * page))
                n = rows.stop - rows.start
                kp[table[b, p], :n], vp[table[b, p], :n], cp[table[b, p], :n] = k[b, rows], v[b, rows], c[b, rows]
        kw["block_table"] = table.to(device)
        caches = (kp, vp, cp)
    else:
        caches = (k, v, c)
    qs = torch.stack([q[b, int(n) - Tq:int(n)] for b, n in enumerate(lens.tolist())])
    out = forgetting_attention_with_kvcache(qs, *caches, lens, **kw)
    for b, n in enumerate(lens.tolist()):
        ref = forgetting_attention_ref(q[b:b + 1, :n].double(), k[b:b + 1, :n].double(), v[b:b + 1, :n].double(),
                                       lf[b:b + 1, :n].double(), window_size=W)[0, n - Tq:]
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[b].double().cpu(), ref.cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("mode", ["fused", "two-pass"])
@pytest.mark.parametrize("fixed", [False, True])
def test_window_backward_modes_and_softmax_forms(device_dtype, mode, fixed):
    """The one-pass backward (dQ added in from the dK/dV programs) and both forward softmax forms (online,
    fixed bound) with a window that ends inside the diagonal tiles and one that spans several tiles."""
    options = KernelOptions(backward=mode, fixed_bound=fixed)
    for W in (7, 45):
        _check(*device_dtype, B=2, Tq=140, Tk=140, H=2, Hkv=1, D=64, window_size=W, options=options)
