"""Gates of exactly 0 (log -inf) and NaN gates, against the float64 reference.

A gate of 0 at position z hides the keys before z from the queries at and after z; the rest stays
finite. Every path handles it exactly: the reference and the PyTorch (CPU) path mask across it, the GPU
kernels re-run the tiles it touches (``ops/dispatch.py``), unless the prefix-sums kernel has reported
that there is no such gate (``ops/zero_flags.py``). A NaN gate makes the rows that depend on it
NaN, never zeros. test_interpreted.py runs this file again with TRITON_INTERPRET=1, where the Triton
kernels run on the CPU.
"""

import os

import pytest
import torch

from fox_kernel import (
    KernelOptions,
    append_to_cache,
    forgetting_attention,
    forgetting_attention_with_kvcache,
    kernel_options,
)
from fox_kernel.ops import dispatch
from fox_kernel.ops.call import AttentionCall
from fox_kernel.reference import forgetting_attention_ref
from fox_kernel.testing import assert_close_to_reference, random_log_fgate

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _inputs(B, Tq, Tk, H, Hkv, D, seed=0, zeros=3):
    """Random float32 inputs with ``zeros`` gates of exactly 0 per (row, head) at random positions (drawn
    on the CPU: a case gets the same values on any device)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, H, D, generator=g)
    k = torch.randn(B, Tk, Hkv, D, generator=g)
    v = torch.randn(B, Tk, Hkv, D, generator=g)
    lf = random_log_fgate((B, Tk, H), generator=g)
    for b in range(B):
        for h in range(H):
            lf[b, torch.randperm(Tk, generator=g)[:zeros], h] = float("-inf")
    return q, k, v, lf


def _grads_against_reference(q, k, v, lf, options=None, device="cpu", dtype=torch.float32, zero_gates=True,
                             attend=forgetting_attention, **kw):
    """forgetting_attention's output and four gradients, with q, k, v in ``dtype`` on ``device``, vs the
    float64 reference and a same-precision one, both taking the same rounded inputs (a 16-bit call is
    held to the 16-bit reference's own error)."""
    ins = [x.to(device, dtype).clone().requires_grad_() for x in (q, k, v)] + [lf.to(device).clone().requires_grad_()]
    kw = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    exact_in = [x.detach().double().requires_grad_() for x in ins]
    same_in = [x.detach().clone().requires_grad_() for x in ins]
    out = attend(*ins, options=options, zero_gates=zero_gates, **kw)
    exact = forgetting_attention_ref(*exact_in, **kw)
    same = forgetting_attention_ref(*same_in, **kw)
    assert torch.isfinite(exact).all()
    assert_close_to_reference(out, exact, same, name="out")
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    for name, a, e, s in zip(("dq", "dk", "dv", "dlog_fgate"), torch.autograd.grad(out, ins, do),
                             torch.autograd.grad(exact, exact_in, do.double()), torch.autograd.grad(same, same_in, do)):
        assert_close_to_reference(a, e, s, name=name, factor=3.0)


def test_reference_zero_gate_restarts_the_sequence():
    """Independent of the reference's masking: the queries from a zero gate on see what the same tokens
    give as a sequence of their own, the earlier queries what the prefix gives; and a finite log gate of
    -300 (whose weights underflow float64) gives the same numbers."""
    q, k, v, lf = (x.double() for x in _inputs(2, 41, 41, 3, 1, 24, zeros=0))
    z = 17
    lf[:, z] = float("-inf")
    out = forgetting_attention_ref(q, k, v, lf)
    assert torch.isfinite(out).all()
    tail = forgetting_attention_ref(q[:, z:], k[:, z:], v[:, z:], lf[:, z:])
    head = forgetting_attention_ref(q[:, :z], k[:, :z], v[:, :z], lf[:, :z])
    torch.testing.assert_close(out[:, z:], tail, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[:, :z], head, rtol=1e-12, atol=1e-12)
    finite = lf.clone()
    finite[:, z] = -300.0
    torch.testing.assert_close(out, forgetting_attention_ref(q, k, v, finite), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("B, Tq, Tk, H, Hkv, D", [(2, 37, 37, 3, 3, 24), (1, 1, 9, 2, 1, 16), (2, 20, 53, 4, 2, 40),
                                                 (3, 130, 130, 2, 1, 8)])
@pytest.mark.parametrize("torch_path", [False, True], ids=["default", "torch-path"])
def test_zero_gates_are_exact(B, Tq, Tk, H, Hkv, D, torch_path):
    """Odd lengths, short queries, GQA; gates of 0 at random places (the first and last included), with
    no option: in the interpreter through the Triton kernels, on the CPU through the PyTorch path."""
    q, k, v, lf = _inputs(B, Tq, Tk, H, Hkv, D)
    lf[0, 0, 0] = lf[-1, -1, -1] = float("-inf")
    _grads_against_reference(q, k, v, lf, options=KernelOptions(torch_path=torch_path))


def test_zero_gates_with_padding_packing_windows_and_pruning():
    q, k, v, lf = _inputs(3, 45, 45, 2, 2, 16, seed=2)
    lf[1, :10] = float("-inf")  # in the padding: counts for nothing
    lf[2, 30] = float("-inf")  # on a row's first real token: hides only padding
    _grads_against_reference(q, k, v, lf, seq_start=torch.tensor([0, 10, 30]))
    q, k, v, lf = _inputs(1, 60, 60, 2, 1, 16, seed=3)
    lf[0, 7] = lf[0, 33] = float("-inf")  # on sequences' first tokens of a packed row
    _grads_against_reference(q, k, v, lf, cu_seqlens=torch.tensor([0, 7, 33, 60], dtype=torch.int32))
    _grads_against_reference(q, k, v, lf, window_size=11)
    with torch.no_grad():
        pruned = forgetting_attention(q, k, v, lf, adaptive_threshold=-30.0)
        auto = forgetting_attention(q, k, v, lf, adaptive_threshold="auto")
    want = forgetting_attention_ref(q.double(), k.double(), v.double(), lf.double())
    assert (pruned.double() - want).abs().max() < 1e-5  # only weights under e^-30 were dropped
    assert (auto.double() - want).abs().max() < 1e-3


def test_zero_gates_in_every_tile_and_documents_packed_by_them():
    """Gates of 0 at every 5th position (several per tile, on tile edges too), and a packed row whose
    documents are separated only by gates of 0: each document's output equals it run alone."""
    q, k, v, lf = _inputs(1, 70, 70, 2, 1, 16, seed=6, zeros=0)
    lf[:, ::5] = float("-inf")
    _grads_against_reference(q, k, v, lf)
    starts = [0, 13, 29, 64]
    marked = lf.clone()
    marked[:, starts[1:]] = float("-inf")
    out = forgetting_attention(q, k, v, marked)
    for s, e in zip(starts, starts[1:] + [70]):
        alone = forgetting_attention(q[:, s:e], k[:, s:e], v[:, s:e], lf[:, s:e])
        torch.testing.assert_close(out[:, s:e], alone, rtol=1e-5, atol=1e-5)


def _outputs_and_grads(q, k, v, lf, device="cpu", dtype=torch.float32, attend=forgetting_attention, **kw):
    """forgetting_attention's output and four gradients (a fixed random upstream gradient)."""
    ins = [x.to(device, dtype).clone().requires_grad_() for x in (q, k, v)] + [lf.to(device).clone().requires_grad_()]
    kw = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    out = attend(*ins, **kw)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    return (out.detach(), *torch.autograd.grad(out, ins, do))


@pytest.mark.parametrize("kw", [{}, {"adaptive_threshold": "auto"}, {"window_size": 9},
                                {"seq_start": torch.tensor([0, 6])},
                                {"cu_seqlens": torch.tensor([0, 19, 47], dtype=torch.int32)}],
                         ids=["plain", "auto", "window", "seq_start", "cu_seqlens"])
def test_promising_no_zero_gate_skips_its_passes_and_changes_nothing(zero_gate_passes, kw):
    """On gates without a 0, ``zero_gates=False`` gives the default call's output and gradients bit for bit
    (and the reference's), and launches neither zero-gate pass. Nor does the default call here: in the
    interpreter a kernel has run when its launch returns, so the prefix sums' report that there is no gate
    of 0 is in before the first pass is due (the PyTorch path has no passes). With a gate of 0 at the
    first position (which hides no key) the report is clean too; with one further on, both passes run."""
    B = 1 if "cu_seqlens" in kw else 2
    q, k, v, lf = _inputs(B, 47, 47, 4, 2, 16, seed=7, zeros=0)
    launched = zero_gate_passes
    default = _outputs_and_grads(q, k, v, lf, **kw)
    assert launched == []
    first = lf.clone()
    first[:, 0] = float("-inf")
    _outputs_and_grads(q, k, v, first, **kw)
    assert launched == []
    later = lf.clone()
    later[-1, 40, 1] = float("-inf")
    _outputs_and_grads(q, k, v, later, **kw)
    assert launched == (["forward_zero_gates", "backward_zero_gates"] if INTERPRET else [])
    launched.clear()
    promised = _outputs_and_grads(q, k, v, lf, zero_gates=False, **kw)
    assert launched == []
    for name, a, b in zip(("out", "dq", "dk", "dv", "dlog_fgate"), promised, default):
        assert torch.equal(a, b), name
    if "adaptive_threshold" not in kw:
        _grads_against_reference(q, k, v, lf, zero_gates=False, **kw)


def test_promising_no_zero_gate_refuses_one_it_can_read():
    q, k, v, lf = _inputs(2, 40, 40, 2, 1, 16, zeros=0)
    lf[1, 33, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"log_fgate must not hold -inf .*\(1, 33, 0\): zero_gates=False promises none"):
        forgetting_attention(q, k, v, lf, zero_gates=False)
    with pytest.raises(TypeError, match="zero_gates must be a bool, got int"):
        forgetting_attention(q, k, v, lf, zero_gates=0)


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels' behaviour: in the interpreter (and on CUDA below)")
def test_a_zero_gate_against_the_promise_gives_nan_rows_in_the_kernels():
    """What the kernels do with a gate of 0 they were promised not to get (public calls refuse it on the
    CPU, so the dispatch is called directly): that head's rows from the gate on are NaN, the rest exact."""
    q, k, v, lf = _inputs(2, 70, 70, 2, 1, 16, zeros=0)
    lf[0, 33, 1] = float("-inf")
    want = forgetting_attention_ref(q.double(), k.double(), v.double(), lf.double())
    for threshold in (None, torch.full((2, 2), -10.0)):
        call = AttentionCall(16**-0.5, threshold=threshold, options=KernelOptions(), zero_gates=False)
        out = dispatch.forward(q, k, v, lf, call)[0]
        assert out[0, 33:, 1].isnan().all()
        keep = torch.ones_like(out, dtype=torch.bool)
        keep[0, 33:, 1] = False
        assert not out[keep].isnan().any()
        assert (out.double()[keep] - want[keep]).abs().max() < 1e-4


@pytest.mark.parametrize("fn", ["reference", "forgetting_attention"])
def test_nan_gate_gives_nan_rows_not_zeros(fn):
    """A NaN gate at t (row 0, head 1): the queries from t on of that head are NaN; the earlier ones, the
    other head and the other row match the reference; padded query rows stay 0."""
    q, k, v, lf = _inputs(2, 30, 30, 2, 1, 16, zeros=0)
    t = 11
    lf[0, t, 1] = float("nan")
    seq_start = torch.tensor([0, 4])
    attend = forgetting_attention_ref if fn == "reference" else forgetting_attention
    out = attend(q, k, v, lf, seq_start=seq_start)
    assert out[0, t:, 1].isnan().all()
    clean = lf.clone()
    clean[0, t, 1] = -0.5
    want = forgetting_attention_ref(q.double(), k.double(), v.double(), clean.double(), seq_start=seq_start)
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[0, t:, 1] = False
    torch.testing.assert_close(out.double()[keep], want[keep], rtol=1e-4, atol=1e-4)
    assert out[1, :4].abs().max() == 0


def test_decode_nan_prefix_sums_give_nan_rows_and_zero_gates_are_refused():
    q, k, v, lf = _inputs(2, 25, 25, 2, 1, 16, zeros=0)
    _, _, c = append_to_cache(None, None, None, k, v, lf)
    c[1, 10:, 0] = float("nan")
    out = forgetting_attention_with_kvcache(q[:, -3:], k, v, c)
    assert out[1, :, 0].isnan().all()
    want = forgetting_attention_ref(q.double(), k.double(), v.double(), lf.double())[:, -3:]
    torch.testing.assert_close(out[0].double(), want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1, :, 1].double(), want[1, :, 1], rtol=1e-4, atol=1e-4)
    zero = lf.clone()
    zero[1, 7, 1] = float("-inf")
    with pytest.raises(ValueError, match=r"log_fgate_new must not hold -inf .* \(1, 7, 1\)"):
        append_to_cache(None, None, None, k, v, zero)
    from fox_kernel import append_to_paged_cache

    pool = torch.zeros(8, 16, 1, 16)
    with pytest.raises(ValueError, match=r"log_fgate_new must not hold -inf .* \(1, 7, 1\)"):
        append_to_paged_cache(pool, pool.clone(), torch.zeros(8, 16, 2), torch.arange(8, dtype=torch.int32).view(2, 4),
                              torch.zeros(2, dtype=torch.int32), k, v, zero)
    c[1, 10:, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"c_cache must not hold -inf .* \(1, 10, 0\)"):
        forgetting_attention_with_kvcache(q[:, -3:], k, v, c)
    # in the padding, or past a row's length in a preallocated cache: not part of the sums
    zero[1, :8] = float("-inf")
    _, _, c = append_to_cache(None, None, None, k, v, zero, seq_start=torch.tensor([0, 8]))
    assert torch.isfinite(c).all()
    c[0, 20:] = float("-inf")
    lens = torch.tensor([20, 25], dtype=torch.int32)
    out = forgetting_attention_with_kvcache(q[:, -1:], k, v, c, lens, seq_start=torch.tensor([0, 8]))
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_rows_after_a_nan_gate_are_nan_never_finite_and_wrong(dtype):
    """On CUDA a NaN gate makes the rows it changes NaN; the other rows match the reference. NaN prefix sums
    in the decode cache likewise."""
    q, k, v, lf = _inputs(2, 300, 300, 2, 1, 64, zeros=0)
    z = 137
    gates = lf.clone()
    gates[0, z, 1] = float("nan")
    out = forgetting_attention(*(x.cuda().to(dtype) for x in (q, k, v)), gates.cuda()).cpu()
    assert out[0, z:, 1].isnan().all()
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[0, z:, 1] = False
    want = forgetting_attention_ref(q.double(), k.double(), v.double(), lf.double())
    torch.testing.assert_close(out.double()[keep], want[keep], rtol=3e-2, atol=3e-2)
    _, _, c = append_to_cache(None, None, None, k, v, lf)
    c[1, 10:, 0] = float("nan")
    out = forgetting_attention_with_kvcache(*(x.cuda().to(dtype) for x in (q[:, -2:], k, v)), c.cuda()).cpu()
    assert out[1, :, 0].isnan().all() and torch.isfinite(out[0]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("options", [KernelOptions(), KernelOptions(gluon=False), KernelOptions(backward="fused"),
                                     KernelOptions(fixed_bound=False)], ids=["default", "triton", "fused", "online"])
def test_cuda_zero_gates_are_exact_on_every_backend(dtype, D, options):
    """Gates of 0 at random places and on a tile's first and last rows, with no option to read them: the
    Gluon kernels (Hopper, 16-bit), the Triton ones, the one-pass backward and the online forward all give
    the reference's output and gradients."""
    q, k, v, lf = _inputs(2, 300, 300, 4, 2, D, seed=4)
    lf[0, 128, 1] = lf[1, 255, 3] = lf[1, 0, 0] = float("-inf")
    _grads_against_reference(q, k, v, lf, options, "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_zero_gates_with_padding_packing_windows_and_pruning(dtype):
    q, k, v, lf = _inputs(3, 200, 200, 2, 1, 64, seed=5)
    lf[1, :40] = float("-inf")
    _grads_against_reference(q, k, v, lf, device="cuda", dtype=dtype, seq_start=torch.tensor([0, 40, 170]))
    _grads_against_reference(q, k, v, lf, device="cuda", dtype=dtype, window_size=70)
    q, k, v, lf = _inputs(1, 400, 400, 2, 2, 64, seed=6)
    lf[0, [70, 150, 151, 333]] = float("-inf")
    _grads_against_reference(q, k, v, lf, device="cuda", dtype=dtype,
                             cu_seqlens=torch.tensor([0, 70, 260, 400], dtype=torch.int32))
    with torch.no_grad():
        pruned = forgetting_attention(*(x.cuda().to(dtype) for x in (q, k, v)), lf.cuda(), adaptive_threshold="auto")
    want = forgetting_attention_ref(q.double(), k.double(), v.double(), lf.double())
    assert (pruned.cpu().double() - want).abs().max() < (1e-3 if dtype == torch.float32 else 5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("options", [KernelOptions(), KernelOptions(gluon=False), KernelOptions(backward="fused")],
                         ids=["default", "triton", "fused"])
def test_cuda_promising_no_zero_gate_changes_nothing_and_a_zero_gate_gives_nan_rows(D, options):
    """bf16 on every backend: on gates without a 0, ``zero_gates=False`` gives the default call's output and
    gradients (bit for bit, but dQ and the gates' gradient of the one-pass backward, summed with atomics),
    eagerly and compiled; a gate of 0 against the promise makes that head's rows NaN from it on, the rest
    the reference's."""
    q, k, v, lf = _inputs(2, 300, 300, 4, 2, D, seed=8, zeros=0)
    with kernel_options(options):
        default = _outputs_and_grads(q, k, v, lf, "cuda", torch.bfloat16)
        promised = _outputs_and_grads(q, k, v, lf, "cuda", torch.bfloat16, zero_gates=False)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dlog_fgate"), promised, default):
        if options.backward == "fused" and name in ("dq", "dlog_fgate"):  # summed with atomics: any order
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(a, b), name
    # compiled: the custom ops carry the promise (their tensors may take other kernel variants, so the
    # check is against the reference's bf16 noise, not bit equality)
    with kernel_options(options):  # the options as a compiled layer takes them: the current ones
        _grads_against_reference(q, k, v, lf, None, "cuda", torch.bfloat16, zero_gates=False,
                                 attend=torch.compile(forgetting_attention, fullgraph=True))
    lf[1, 200, 3] = float("-inf")
    with kernel_options(options), torch.no_grad():
        out = forgetting_attention(*(x.cuda().to(torch.bfloat16) for x in (q, k, v)), lf.cuda(),
                                   zero_gates=False).cpu()
    assert out[1, 200:, 3].isnan().all()
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[1, 200:, 3] = False
    want = forgetting_attention_ref(q.double(), k.double(), v.double(), lf.double())
    torch.testing.assert_close(out.double()[keep], want[keep], rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_decode_check_gates_refuses_zero_gates_in_the_cache():
    q, k, v, _ = _inputs(2, 150, 150, 4, 2, 64, seed=4)
    _, _, c = append_to_cache(None, None, None, k, v, random_log_fgate((2, 150, 4)))
    c[1, 20:, 3] = float("-inf")
    with kernel_options(check_gates=True), pytest.raises(ValueError, match=r"c_cache must not hold -inf .* \(1, 20, 3\)"):
        forgetting_attention_with_kvcache(*(x.cuda().to(torch.bfloat16) for x in (q[:, -1:], k, v)), c.cuda())


def test_torch_path_option_gives_the_kernels_math():
    """``torch_path`` runs a call on the chunked PyTorch path (in the interpreter instead of the Triton
    kernels): the same results as the default path, against float64, with pruning and a window too."""
    q, k, v, lf = _inputs(2, 33, 47, 4, 2, 16, seed=5, zeros=0)
    for kw in ({}, {"window_size": 9}, {"seq_start": torch.tensor([0, 6])}):
        _grads_against_reference(q, k, v, lf, options=KernelOptions(torch_path=True), **kw)
    with torch.no_grad():
        fast = forgetting_attention(q, k, v, lf, adaptive_threshold="auto")
        torch_path = forgetting_attention(q, k, v, lf, adaptive_threshold="auto", options=KernelOptions(torch_path=True))
    torch.testing.assert_close(torch_path, fast, rtol=1e-4, atol=1e-4)
