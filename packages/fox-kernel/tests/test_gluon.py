"""The Gluon (Hopper) kernels (forward, dK/dV and dQ passes, the one-pass backward) against the float64
reference and the Triton kernels."""

import pytest
import torch

from fox_kernel import KernelOptions, forgetting_attention
from fox_kernel.ops import dispatch, gluon
from fox_kernel.ops.call import AttentionCall
from fox_kernel.ops.gluon.tiles import GLUON_ONE_PASS_DIMS
from fox_kernel.reference import forgetting_attention_ref
from fox_kernel.testing import assert_close_to_reference, random_log_fgate

pytestmark = pytest.mark.gpu


def _hopper_with_gluon():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and gluon.available()


@pytest.fixture(autouse=True)
def _needs_gluon():
    if not _hopper_with_gluon():
        pytest.skip("needs an sm90 GPU and a Triton with Gluon")


def _inputs(B, Tq, Tk, H, Hkv, D, dtype, speed, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, H, D, generator=g)
    k = torch.randn(B, Tk, Hkv, D, generator=g)
    v = torch.randn(B, Tk, Hkv, D, generator=g)
    lf = random_log_fgate((B, Tk, H), speed=speed, generator=g)
    do = torch.randn(B, Tq, H, D, generator=g)
    cast = lambda x, dt: x.to("cuda", dt).requires_grad_()
    return [cast(q, dtype), cast(k, dtype), cast(v, dtype), cast(lf, torch.float32)], do.to("cuda", dtype)


def _reference(inputs, do, **kw):
    """(output, gradients) of the PyTorch reference in float64 and in the inputs' own types; ``kw``: the
    reference's options (``window_size``)."""
    results = []
    for cast in (lambda x: x.double(), lambda x: x.clone()):
        leaves = [cast(x.detach()).requires_grad_() for x in inputs]
        out = forgetting_attention_ref(*leaves, **kw)
        results.append((out.detach(), *torch.autograd.grad(out, leaves, cast(do))))
    return results


@pytest.mark.parametrize("backward", ["two-pass", "fused"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("B, Tq, Tk, H, Hkv, speed", [
    (2, 1000, 1000, 4, 4, "fast"),   # partial last blocks, batches read through one 2-D view
    (1, 777, 777, 8, 2, "slow"),     # GQA
    (3, 129, 129, 2, 2, "fast"),     # one key block and one row more
    (2, 333, 1000, 4, 2, "fast"),    # queries shorter than keys, GQA
    (1, 5, 300, 4, 4, "fast"),       # a few queries: every query block cut by its end
])
def test_gluon_matches_reference_and_triton(backward, D, dtype, B, Tq, Tk, H, Hkv, speed):
    """Output and gradients of the Gluon kernels (two-pass backward, or at D=64 the one-pass backward)
    against float64 and the reference in the inputs' type, and no further from float64 than the Triton
    kernels' (two passes)."""
    if backward == "fused" and D not in GLUON_ONE_PASS_DIMS:
        pytest.skip("the Gluon one-pass backward is for D=64")
    inputs, do = _inputs(B, Tq, Tk, H, Hkv, D, dtype, speed, seed=Tq + H)
    options = KernelOptions(backward=backward)
    plan = dispatch.backward_plan(inputs[0], AttentionCall(D**-0.5, options=options))
    assert plan == (dispatch.Backend.GLUON, backward == "fused")
    out = forgetting_attention(*inputs, options=options)
    grads = torch.autograd.grad(out, inputs, do)
    triton_out = forgetting_attention(*inputs, options=KernelOptions(gluon=False))
    triton_grads = torch.autograd.grad(triton_out, inputs, do)
    exact, same = _reference(inputs, do)
    names = ("out", "dq", "dk", "dv", "dlog_fgate")
    for name, a, t, e, s in zip(names, (out.detach(), *grads), (triton_out.detach(), *triton_grads), exact, same):
        assert_close_to_reference(a, e, s, name=name, factor=3.0)
        # and no further from float64 than the Triton pass, up to rounding
        err, err_triton = (a.double() - e).abs().max(), (t.double() - e).abs().max()
        assert err <= 1.5 * err_triton + 1e-3 * e.abs().max(), (name, err.item(), err_triton.item())


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("pruned", [False, True], ids=["exact", "pruned"])
def test_gluon_launch_order_changes_nothing(D, pruned):
    """Every launch order of the three passes (groups of 1, 3 and 10 heads of 24 (row, head) pairs, 12 of
    the dK/dV pass's (row, key/value head) pairs: a short last group), with one program per SM taking
    tiles until none is left (the default; 144-288 tiles a pass, so that a program runs several on 132
    SMs) or one program per tile, runs every block once: output and gradients are bit-identical to the
    default's, with and without pruning (whose kept-range tables the programs index by their tile)."""
    from fox_kernel.ops.gluon import tiles

    inputs, do = _inputs(3, 1500, 1500, 8, 4, D, torch.bfloat16, "fast", seed=D)
    kw = dict(adaptive_threshold="auto") if pruned else {}

    def outputs():
        out = forgetting_attention(*inputs, **kw)
        return (out.detach(), *torch.autograd.grad(out, inputs, do))

    expected = outputs()
    persistent = dict(tiles.PERSISTENT)
    try:
        for per_sm in (True, False):
            tiles.PERSISTENT.update({name: per_sm for name in persistent})
            for group in (1, 3, 10):
                tiles.HEAD_GROUPS.update(fwd=group, dkdv=group, dq=group)
                for name, a, e in zip(("out", "dq", "dk", "dv", "dlog_fgate"), outputs(), expected):
                    assert torch.equal(a, e), (per_sm, group, name)
    finally:
        tiles.HEAD_GROUPS.clear()
        tiles.PERSISTENT.update(persistent)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("regime", ["tile bound", "row bounds", "online"])
def test_gluon_forward_bound_regimes(D, regime):
    """The Gluon forward's three ways per consumer warpgroup: one fixed softmax bound for its rows (slow
    gates), one per row (gates decaying by far more than the gap across the rows) and the online softmax
    (query norms too large for any bound), against float64 and the Triton forward (online there)."""
    B, T, H = 1, 700, 4
    g = torch.Generator().manual_seed(D)
    q = torch.randn(B, T, H, D, generator=g) * (8.0 if regime == "online" else 1.0)
    k, v = torch.randn(B, T, H, D, generator=g), torch.randn(B, T, H, D, generator=g)
    if regime == "row bounds":  # log2 decay of ~185 across 64 rows: no bound fits them all within the gap
        lf = torch.full((B, T, H), -2.0) + 0.1 * torch.rand(B, T, H, generator=g)
    else:
        lf = random_log_fgate((B, T, H), speed="slow", generator=g)
    q, k, v = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
    lf = lf.cuda()
    with torch.no_grad():
        out = forgetting_attention(q, k, v, lf)
        out_triton = forgetting_attention(q, k, v, lf, options=KernelOptions(gluon=False, fixed_bound=False))
        exact = forgetting_attention_ref(q.double(), k.double(), v.double(), lf.double())
        same = forgetting_attention_ref(q, k, v, lf)
    assert_close_to_reference(out, exact, same, name="out", factor=3.0)
    err, err_triton = (out.double() - exact).abs().max(), (out_triton.double() - exact).abs().max()
    assert err <= 1.5 * err_triton + 1e-3 * exact.abs().max(), (err.item(), err_triton.item())


def test_gluon_reads_strided_and_head_first_inputs():
    """q/k/v as slices of one fused projection (rows wider than H*D) and in head-first layout (copied)."""
    B, T, H, D = 2, 300, 4, 64
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, 3 * H * D, generator=g).to("cuda", torch.bfloat16)
    q, k, v = (x.view(B, T, H, D).requires_grad_() for x in qkv.split(H * D, dim=-1))
    lf = random_log_fgate((B, T, H), speed="fast", generator=g).cuda().requires_grad_()
    do = torch.randn(B, T, H, D, generator=g).to("cuda", torch.bfloat16)
    hf = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v, lf)]

    def outputs(inputs, dout, **kw):
        out = forgetting_attention(*inputs, **kw)
        return (out.detach(), *torch.autograd.grad(out, inputs, dout))

    got, got_hf = outputs((q, k, v, lf), do), outputs(hf, do.transpose(1, 2), head_first=True)
    exact, same = _reference((q, k, v, lf), do)
    for name, a, b, e, s in zip(("out", "dq", "dk", "dv", "dlog_fgate"), got, got_hf, exact, same):
        assert torch.equal(a, b.transpose(1, 2)), name
        assert_close_to_reference(a, e, s, name=name, factor=3.0)


def _assert_pruned_close(exact, pruned, pruned_triton):
    """Output and gradients of a pruned call within the bound's tolerance of the exact call's and of the
    Triton kernels' pruned call's."""
    for name, e, p, t in zip(("out", "dq", "dk", "dv", "dlog_fgate"), exact, pruned, pruned_triton):
        scale = max(e.float().abs().max().item(), 1.0)
        assert (e.float() - p.float()).abs().max().item() <= 3e-2 * scale, name
        assert (t.float() - p.float()).abs().max().item() <= 3e-2 * scale, name


@pytest.mark.parametrize("backward", ["two-pass", "fused"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Tq", [1500, 732])
def test_gluon_with_pruning(backward, D, Tq):
    """Pruned key/query block pairs are skipped: within the bound's tolerance of the exact gradients, a
    loose threshold really changes them, and the Triton passes (other tiles) agree to the same tolerance.
    Tq < Tk: the dQ pass's table of kept ranges has a column per key-length block, more than its grid.
    (Tk - Tq is a multiple of the tiles: with queries off the key tiles' grid, the nearest prunable key
    lies tens of fast-decaying steps back and pruning it changes nothing, at any threshold.)"""
    if backward == "fused" and D not in GLUON_ONE_PASS_DIMS:
        pytest.skip("the Gluon one-pass backward is for D=64")
    inputs, do = _inputs(1, Tq, 1500, 4, 2, D, torch.bfloat16, "fast", seed=5)
    options = KernelOptions(backward=backward)

    def outputs(options=options, **kw):
        out = forgetting_attention(*inputs, options=options, **kw)
        return (out.detach(), *torch.autograd.grad(out, inputs, do))

    exact, pruned, loose = outputs(), outputs(adaptive_threshold="auto"), outputs(adaptive_threshold=-0.5)
    _assert_pruned_close(exact, pruned, outputs(KernelOptions(gluon=False), adaptive_threshold="auto"))
    assert max((e.float() - lo.float()).abs().max().item() for e, lo in zip(exact, loose)) > 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_pruned_forward_past_the_online_limit(dtype):
    """A pruned call at D=64 past GLUON_FWD_MAX_KEYS takes the Gluon forward with the fixed softmax bound
    (bf16) and the Triton forward with the online softmax (fp16), and either way its output stays within
    the bound's tolerance of the exact call's and of the Triton kernels' pruned output."""
    from fox_kernel.ops.gluon.tiles import GLUON_FWD_MAX_KEYS

    Tk = GLUON_FWD_MAX_KEYS[64] + 904
    inputs, _ = _inputs(1, Tk - 512, Tk, 4, 2, 64, dtype, "fast", seed=8)
    q, k = inputs[0], inputs[1]
    call = AttentionCall(64**-0.5, auto_log_eps=-10.0, options=KernelOptions())
    want = dispatch.Backend.GLUON if dtype == torch.bfloat16 else dispatch.Backend.TRITON
    assert dispatch.forward_backend(q, k, call) is want
    with torch.no_grad():
        exact = forgetting_attention(*inputs).float()
        pruned = forgetting_attention(*inputs, adaptive_threshold="auto").float()
        pruned_triton = forgetting_attention(*inputs, adaptive_threshold="auto",
                                             options=KernelOptions(gluon=False)).float()
        loose = forgetting_attention(*inputs, adaptive_threshold=-0.5).float()
    scale = max(exact.abs().max().item(), 1.0)
    assert (exact - pruned).abs().max().item() <= 3e-2 * scale
    assert (pruned_triton - pruned).abs().max().item() <= 3e-2 * scale
    assert (exact - loose).abs().max().item() > 0.05


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("B, Tq, Tk, H, Hkv, W", [
    (2, 1000, 1000, 4, 2, 1),      # each query sees only itself
    (2, 1000, 1000, 4, 2, 45),     # the window ends inside a tile (and inside a consumer's rows)
    (1, 777, 777, 4, 4, 128),      # a tile's width
    (1, 777, 777, 2, 2, 300),      # several tiles, the edge off the tile grid
    (2, 333, 1000, 4, 2, 200),     # queries shorter than keys
    (1, 500, 500, 2, 2, 5000),     # wider than the sequence: full attention
])
def test_gluon_sliding_window(D, dtype, B, Tq, Tk, H, Hkv, W):
    """A sliding window runs on the Gluon kernels, at every width: output and gradients against float64 and
    the reference in the inputs' type, no further from float64 than the Triton kernels' (which run windows
    on their own ranges), in both forward forms (fixed bound, online) and, at D=64, with the one-pass
    backward."""
    inputs, do = _inputs(B, Tq, Tk, H, Hkv, D, dtype, "fast", seed=Tq + W)
    exact, same = _reference(inputs, do, window_size=W)
    modes = [KernelOptions(), KernelOptions(fixed_bound=False)]
    if D in GLUON_ONE_PASS_DIMS:
        modes.append(KernelOptions(backward="fused"))
    triton_out = forgetting_attention(*inputs, window_size=W, options=KernelOptions(gluon=False))
    triton = (triton_out.detach(), *torch.autograd.grad(triton_out, inputs, do))
    for options in modes:
        call = AttentionCall(D**-0.5, window=W, options=options)
        assert dispatch.forward_backend(inputs[0], inputs[1], call) is dispatch.Backend.GLUON
        assert dispatch.backward_plan(inputs[0], call)[0] is dispatch.Backend.GLUON
        out = forgetting_attention(*inputs, window_size=W, options=options)
        got = (out.detach(), *torch.autograd.grad(out, inputs, do))
        # with W = 1 every weight is exactly 1 in the reference (dq, dk and the gate gradient exactly 0),
        # while the kernels recompute it from the stored log-sum-exp as 1 +- 2^-8: a floor of one such step
        # at the result's largest value, as in test_window.py
        floor = 2.0**-7
        for name, a, t, e, s in zip(("out", "dq", "dk", "dv", "dlog_fgate"), got, triton, exact, same):
            assert_close_to_reference(a, e, s, name=f"{name} ({options})", factor=3.0, rtol_floor=floor)
            err, err_triton = (a.double() - e).abs().max(), (t.double() - e).abs().max()
            bound = 1.5 * err_triton + 1e-3 * e.abs().max() + floor * max(e.abs().max(), 1.0)
            assert err <= bound, (name, options, err.item(), err_triton.item())


@pytest.mark.parametrize("D", [64, 128])
def test_gluon_sliding_window_with_pruning(D):
    """A window and "auto" pruning together on the Gluon kernels: the ranges of both narrow the blocks;
    within the bound's tolerance of the exact windowed call and of the Triton kernels' pruned windowed
    call."""
    inputs, do = _inputs(2, 1500, 1500, 4, 2, D, torch.bfloat16, "fast", seed=11)

    def outputs(options=None, **kw):
        out = forgetting_attention(*inputs, window_size=700, options=options or KernelOptions(), **kw)
        return (out.detach(), *torch.autograd.grad(out, inputs, do))

    _assert_pruned_close(outputs(), outputs(adaptive_threshold="auto"),
                         outputs(KernelOptions(gluon=False), adaptive_threshold="auto"))
