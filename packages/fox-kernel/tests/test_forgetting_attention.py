"""Forgetting Attention vs the float64 reference: outputs and all four gradients.

On the CPU this exercises the chunked PyTorch path; with TRITON_INTERPRET=1 (see test_interpreted.py)
the same tests run the Triton kernels through the interpreter; on a GPU, the compiled kernels in
bf16, fp16 and fp32.
"""

import math
import os

import pytest
import torch

from fox_kernel import KernelOptions, forgetting_attention
from fox_kernel.reference import forgetting_attention_ref
from fox_kernel.testing import assert_close_to_reference, random_log_fgate
from fox_kernel.testing import attention_inputs as _inputs

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check(device, dtype, B, Tq, Tk, H, Hkv, D, speed="fast", grad=True, inputs=None, options=None, **kw):
    q, k, v, lf = inputs if inputs is not None else _inputs(B, Tq, Tk, H, Hkv, D, device, dtype, speed)
    out = forgetting_attention(q, k, v, lf, options=options, **kw)
    exact_in = [x.detach().double().requires_grad_() for x in (q, k, v, lf)]
    same_in = [x.detach().clone().requires_grad_() for x in (q, k, v, lf)]
    exact = forgetting_attention_ref(*exact_in, **kw)
    same = forgetting_attention_ref(*same_in, **kw)
    assert_close_to_reference(out, exact, same, name="out")
    if not grad:
        return out
    # seeded on the CPU, so a case sees the same dO whichever tests ran before it
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grads = torch.autograd.grad(out, (q, k, v, lf), do)
    exact_grads = torch.autograd.grad(exact, exact_in, do.double())
    same_grads = torch.autograd.grad(same, same_in, do)
    for name, a, e, s in zip(("dq", "dk", "dv", "dlog_fgate"), grads, exact_grads, same_grads):
        assert_close_to_reference(a, e, s, name=name, factor=3.0)
    return out


@pytest.mark.parametrize("T", [1, 7, 63, 200, 1000])
def test_odd_lengths(device_dtype, T):
    if INTERPRET and T > 200:
        pytest.skip("long sequence: too slow in the interpreter")
    _check(*device_dtype, B=2, Tq=T, Tk=T, H=3, Hkv=3, D=32)


@pytest.mark.parametrize("D", [16, 48, 64, 80, 128, 256])
def test_head_dims(device_dtype, D):
    _check(*device_dtype, B=1, Tq=77, Tk=77, H=2, Hkv=2, D=D)


@pytest.mark.parametrize("speed", ["fast", "slow"])
def test_gate_speeds(device_dtype, speed):
    _check(*device_dtype, B=2, Tq=150, Tk=150, H=2, Hkv=2, D=64, speed=speed)


@pytest.mark.parametrize("Tq,Tk", [(1, 90), (5, 64), (33, 100), (64, 129)])
def test_queries_shorter_than_keys(device_dtype, Tq, Tk):
    _check(*device_dtype, B=2, Tq=Tq, Tk=Tk, H=2, Hkv=1, D=32)


def test_seq_start_left_padding(device_dtype):
    device, dtype = device_dtype
    seq_start = torch.tensor([0, 17, 70, 90], device=device)  # last row: every key is padding
    out = _check(device, dtype, B=4, Tq=90, Tk=90, H=2, Hkv=2, D=32, seq_start=seq_start)
    assert out[3].abs().max() == 0
    assert out[2, :70].abs().max() == 0


def test_seq_start_padding_gets_no_gradient(device_dtype):
    device, dtype = device_dtype
    q, k, v, lf = _inputs(3, 40, 50, 2, 2, 32, device, dtype)
    seq_start = torch.tensor([0, 20, 50], device=device)
    out = forgetting_attention(q, k, v, lf, seq_start=seq_start)
    out.backward(torch.randn_like(out))
    assert k.grad[1, :20].abs().max() == 0 and v.grad[1, :20].abs().max() == 0
    assert lf.grad[1, :20].abs().max() == 0
    for x in (q, k, v, lf):
        assert x.grad[2].abs().max() == 0
    assert lf.grad[1, 20:].abs().max() > 0


def test_seq_start_with_short_queries(device_dtype):
    device, _ = device_dtype
    _check(*device_dtype, B=2, Tq=9, Tk=60, H=2, Hkv=1, D=32, seq_start=torch.tensor([5, 55], device=device))


def test_gqa_equals_mha_with_repeated_kv(device_dtype):
    device, dtype = device_dtype
    H, Hkv = 8, 2
    q, k, v, lf = _inputs(2, 70, 70, H, Hkv, 64, device, dtype)
    out = forgetting_attention(q, k, v, lf)
    k_rep, v_rep = (x.detach().repeat_interleave(H // Hkv, dim=2).requires_grad_() for x in (k, v))
    out_mha = forgetting_attention(q, k_rep, v_rep, lf)
    torch.testing.assert_close(out, out_mha, rtol=0, atol=0)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    dk, dv = torch.autograd.grad(out, (k, v), do)
    dk_mha, dv_mha = torch.autograd.grad(out_mha, (k_rep, v_rep), do)
    fold = lambda x: x.float().view(*x.shape[:2], Hkv, H // Hkv, -1).sum(3)
    rtol, atol = (1e-2, 1e-2) if dtype != torch.float32 else (1e-5, 1e-5)
    for name, g, g_mha in (("dk", dk, dk_mha), ("dv", dv, dv_mha)):
        # the MHA side rounds each head's gradient before the sum: the tolerance scales with the
        # summands (a sum that cancels to near zero keeps their rounding), not with the sum
        err = (g.float() - fold(g_mha)).abs()
        assert (err <= atol + rtol * fold(g_mha.abs())).all(), f"{name}: max error {err.max().item():.3e}"
    _check(device, dtype, B=2, Tq=70, Tk=70, H=H, Hkv=1, D=32)  # MQA


@pytest.mark.parametrize("case, D", [("plain", 64), ("plain", 128), ("seq_start_short_queries", 128),
                                     ("varlen", 128), ("pruning", 128)])
def test_gqa_launch_orders_agree_and_match_the_reference(device_dtype, case, D):
    """The dK/dV pass of GQA launches all heads' heaviest blocks first at D=128 (one head's blocks
    together otherwise): both orders give the same gradients, bit for bit, and the reference's, with
    left padding and short queries, packed sequences and pruning too."""
    device, dtype = device_dtype
    T = 40 if INTERPRET else 150  # the interpreter runs 16x16 tiles: 40 is three key blocks, one partial
    B, Tq, kw = 2, T, {}
    if case == "seq_start_short_queries":
        Tq, kw = T - 13, dict(seq_start=torch.tensor([0, 7], device=device))
    elif case == "varlen":
        B, kw = 1, dict(cu_seqlens=torch.tensor([0, 5, T - 9, 2 * T], dtype=torch.int32, device=device))
        Tq = T = 2 * T
    elif case == "pruning":
        kw = dict(adaptive_threshold=-4.0)
    inputs = _inputs(B, Tq, T, 8, 2, D, device, dtype, seed=3)
    do = torch.randn(B, Tq, 8, D, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    grads = []
    for order in ("blocks", "heads"):
        out = forgetting_attention(*inputs, **kw, options=KernelOptions(order_dkdv=order))
        grads.append(torch.autograd.grad(out, inputs, do))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    if case != "pruning":  # a pruned result is checked against its bound elsewhere, not the exact one
        _check(device, dtype, B=B, Tq=Tq, Tk=T, H=8, Hkv=2, D=D, inputs=inputs, **kw)


def test_fixed_bound_softmax_and_its_fallback(device_dtype):
    """Query tiles whose fixed softmax bound |q_i| max|k| s is far above their scores (large q here)
    must fall back to the online softmax; the rest take the bound. Both against float64, and each
    half against an all-online run: identical where the fallback ran, not identical where it did not."""
    device, dtype = device_dtype
    if device.type == "cpu" and not INTERPRET:
        pytest.skip("the fixed bound is a Triton forward path")
    options = KernelOptions(gluon=False)  # the Triton forward's fallback, tile by tile
    T = 256
    q, k, v, lf = _inputs(1, T, T, 2, 1, 32, device, dtype, speed="bench", seed=4)
    big = torch.ones(1, T, 1, 1, device=device, dtype=dtype)
    big[:, : T // 2] = 5.0  # 2 |q| max|k| s log2(e) > 120, over the allowed gap; 128 rows: whole tiles
    q = (q.detach() * big).requires_grad_()
    _check(device, dtype, 1, T, T, 2, 1, 32, speed="bench", inputs=(q, k, v, lf), options=options)
    with torch.no_grad():
        out = forgetting_attention(q, k, v, lf, options=options)
        online = forgetting_attention(q, k, v, lf, options=options.replace(fixed_bound=False))
    assert torch.equal(out[:, : T // 2], online[:, : T // 2])
    if dtype == torch.float16:  # float16 never takes the bound
        assert torch.equal(out, online)
    else:
        assert not torch.equal(out[:, T // 2 :], online[:, T // 2 :])


@pytest.mark.parametrize("rows", [0, 1, 2])
def test_fixed_bound_per_row_under_fast_decay(device_dtype, rows):
    """Gates that decay by more than the allowed gap across one query tile (~110 log2 units) and small
    queries: the tile-wide bound is too loose (ROWS 0: the online fallback runs), a per-row bound is
    tight (ROWS 1 always, ROWS 2 for such tiles). The output and the log-sum-exp the backward uses,
    each against float64 (the backward itself does not depend on the mode)."""
    device, dtype = device_dtype
    if device.type == "cpu" and not INTERPRET:
        pytest.skip("the fixed bound is a Triton forward path")
    from fox_kernel.ops.constants import LOG2E
    from fox_kernel.ops.triton.launch import config

    options = KernelOptions(gluon=False, fixed_rows=rows)  # the Triton forward's ways to take the bound
    T, D = 300, 64
    q, k, v, lf = _inputs(1, T, T, 2, 2, D, device, dtype, speed="bench", seed=9)
    per_token = 110.0 / (config("fwd", D, dtype, device)["BLOCK_M"] * LOG2E.value)  # this run's query tiles
    g = torch.Generator().manual_seed(10)
    lf = (-per_token * (1 + 0.2 * torch.randn(1, T, 2, generator=g))).clamp(max=-0.01).to(device).requires_grad_()
    q = (q.detach() * 0.3).requires_grad_()
    _check(device, dtype, 1, T, T, 2, 2, D, inputs=(q, k, v, lf), grad=False, options=options)
    with torch.no_grad():
        _, lse, _ = torch.ops.fox_kernel.forgetting_attention_fwd(q, k, v, lf, None, None, D**-0.5, None, None, 0,
                                                                  options.key)
        c = lf.double().cumsum(1)  # (1, T, H)
        scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * D**-0.5
        scores = scores + c.transpose(1, 2)[..., :, None] - c.transpose(1, 2)[..., None, :]
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=device).tril(), float("-inf"))
        want = torch.logsumexp(scores, dim=-1)  # (1, H, T)
    # float32 sums, measured from a tile anchor ~110 log2 units away (its rounding is ~5e-6); in 16-bit
    # the bound's diagonal block sums the rounded weights its PV product uses (so the output is normalised
    # by exactly those), which moves the log-sum-exp by up to 2^-8 (3e-3 measured on an H200)
    tol = 5e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("varlen", [False, True], ids=["3 rows", "4 packed sequences"])
def test_grids_past_the_axis_limit_launch_otherwise(device_dtype, varlen, monkeypatch):
    """(row, head) pairs past the programs CUDA allows on a grid's second axis (``launch.MAX_GRID_YZ``,
    65,535, lowered here to 5, which 3 rows or 4 packed sequences of 4 heads pass): the attention passes
    take the other axis order and the local sums and row dots launch in parts of rows, and forward and
    backward stay as close to float64 as ever. ``launch.run`` refuses any launch past the limit, so none
    of this call's launches did."""
    device, dtype = device_dtype
    if device.type == "cpu" and not INTERPRET:
        pytest.skip("the grids are the Triton kernels'")
    from fox_kernel.ops.triton import launch

    monkeypatch.setattr(launch, "MAX_GRID_YZ", 5)
    options = KernelOptions(gluon=False)  # the Gluon passes' grids are one-dimensional
    if varlen:
        cu = torch.tensor([0, 7, 27, 28, 41], dtype=torch.int32, device=device)
        _check(device, dtype, 1, 41, 41, 4, 2, 16, options=options, cu_seqlens=cu)
    else:
        _check(device, dtype, 3, 37, 37, 4, 2, 16, options=options)


def test_a_launch_past_the_grid_limit_is_refused_naming_the_kernel():
    from fox_kernel.ops.triton import launch, sums

    launch.check_grid(sums._delta_kernel, (70000, 65535, 1))
    with pytest.raises(ValueError, match=r"^_delta_kernel: launch grid \(1, 65536\) passes the 65,535 programs "
                                         r"that CUDA allows on grid axes 1 and 2$"):
        launch.check_grid(sums._delta_kernel, (1, 65536))
    assert launch.grid("dq", 70000, 3, order="blocks") == ((70000, 3), True)
    assert launch.grid("dq", 12, 3, order="blocks") == ((3, 12), False)


def test_varlen_equals_each_sequence_alone(device_dtype):
    device, dtype = device_dtype
    # Packed batches take the pointer loads; the single sequences must too for a bit-exact comparison
    # (Hopper TMA loads round differently; each path is checked against float64 elsewhere); and the
    # two-pass backward: the one-pass form adds dQ with atomics, in no fixed order
    options = KernelOptions(tma=False, backward="two-pass")
    lengths = [1, 37, 64, 5, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total = sum(lengths)
    q, k, v, lf = _inputs(1, total, total, 4, 2, 32, device, dtype)
    out = forgetting_attention(q, k, v, lf, cu_seqlens=cu, options=options)
    # seeded on the CPU, so a case sees the same dO whichever tests ran before it
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grads = torch.autograd.grad(out, (q, k, v, lf), do)
    b = cu.tolist()
    for s, e in zip(b[:-1], b[1:]):
        piece = [x.detach()[:, s:e].clone().requires_grad_() for x in (q, k, v, lf)]
        alone = forgetting_attention(*piece, options=options)
        torch.testing.assert_close(out[:, s:e], alone, rtol=0, atol=0)
        alone_grads = torch.autograd.grad(alone, piece, do[:, s:e])
        for name, g_all, g_one in zip(("dq", "dk", "dv", "dlog_fgate"), grads, alone_grads):
            torch.testing.assert_close(g_all[:, s:e].float(), g_one.float(), rtol=1e-4, atol=1e-4, msg=name)
    # the bounds (softmax and "auto" pruning) are taken per packed sequence, as for each alone
    pruned = forgetting_attention(q, k, v, lf, cu_seqlens=cu, adaptive_threshold="auto", options=options)
    for s, e in zip(b[:-1], b[1:]):
        alone = forgetting_attention(*(x.detach()[:, s:e] for x in (q, k, v, lf)), adaptive_threshold="auto",
                                     options=options)
        torch.testing.assert_close(pruned[:, s:e], alone, rtol=0, atol=0)
    for mode in ("two-pass", "fused"):
        _check(device, dtype, B=1, Tq=total, Tk=total, H=4, Hkv=2, D=32, cu_seqlens=cu,
               options=KernelOptions(backward=mode))


# The rest of this file runs the default (two-pass) backward; these cases run the one-pass ("fused") one.
@pytest.mark.parametrize("case", [
    dict(B=2, Tq=150, Tk=150, H=4, Hkv=2, D=48),
    dict(B=2, Tq=33, Tk=100, H=2, Hkv=1, D=32),
    dict(B=2, Tq=90, Tk=90, H=2, Hkv=2, D=32, seq_start=[0, 17]),
    dict(B=1, Tq=77, Tk=77, H=2, Hkv=2, D=128),
])
def test_fused_backward(device_dtype, case):
    device, dtype = device_dtype
    case = dict(case)
    if "seq_start" in case:
        case["seq_start"] = torch.tensor(case["seq_start"], device=device)
    _check(device, dtype, **case, options=KernelOptions(backward="fused"))


def test_backward_mode_is_checked():
    from fox_kernel.ops.dispatch import one_pass_backward

    with pytest.raises(ValueError, match="FOX_KERNEL_BACKWARD"):
        KernelOptions.from_env({"FOX_KERNEL_BACKWARD": "fast"})
    with pytest.raises(ValueError, match="backward"):
        KernelOptions(backward="fast")
    fused = KernelOptions.from_env({"FOX_KERNEL_BACKWARD": "fused"})
    assert fused == KernelOptions(backward="fused") and one_pass_backward(fused)
    torch.use_deterministic_algorithms(True)
    try:
        assert not one_pass_backward(fused)
    finally:
        torch.use_deterministic_algorithms(False)


def test_gluon_switch_is_checked():
    from fox_kernel.ops.call import AttentionCall
    from fox_kernel.ops.dispatch import Backend, backward_plan, forward_backend

    with pytest.raises(ValueError, match="FOX_KERNEL_GLUON"):
        KernelOptions.from_env({"FOX_KERNEL_GLUON": "off"})
    assert not KernelOptions.from_env({"FOX_KERNEL_GLUON": "0"}).gluon
    q = torch.randn(1, 4, 1, 64).to(torch.bfloat16)  # a CPU tensor never takes the Gluon kernels
    want = Backend.TRITON if INTERPRET else Backend.TORCH
    assert forward_backend(q, q, AttentionCall(1.0, options=KernelOptions())) is want
    assert backward_plan(q, AttentionCall(1.0, options=KernelOptions(backward="fused"))) == (want, INTERPRET)


def test_which_calls_take_the_gluon_kernels(monkeypatch):
    """The routing rules on a Hopper GPU, with the device checks stood in for (``_gluon_applies`` reads only
    the dtype, the head dim, the device's major version and the call): 16-bit, head dim 64 or 128, no
    ``seq_start`` or packing, a sliding window of any width; the forward and the backward agree."""
    import types

    from fox_kernel.ops import dispatch, gluon
    from fox_kernel.ops.call import AttentionCall
    from fox_kernel.ops.dispatch import Backend

    monkeypatch.setattr(dispatch, "INTERPRET", False)
    monkeypatch.setattr(dispatch, "runs_triton", lambda x: True)
    monkeypatch.setattr(dispatch, "sm_major", lambda device: 9)
    monkeypatch.setattr(gluon, "available", lambda: True)

    def backend(D=64, dtype=torch.bfloat16, **call):
        q = types.SimpleNamespace(is_cuda=True, device="cuda", dtype=dtype, shape=(1, 100, 2, D))
        c = AttentionCall(D**-0.5, options=KernelOptions(), **call)
        forward, (backward, _) = dispatch.forward_backend(q, q, c), dispatch.backward_plan(q, c)
        assert forward is backward, (D, dtype, call)
        return forward

    assert backend() is backend(D=128) is backend(dtype=torch.float16) is Backend.GLUON
    assert backend(D=80) is backend(dtype=torch.float32) is Backend.TRITON
    assert backend(seq_start=torch.zeros(1, dtype=torch.int32)) is Backend.TRITON
    assert backend(cu_seqlens=torch.tensor([0, 100], dtype=torch.int32)) is Backend.TRITON
    for D in (64, 128):
        for window in (1, 45, 512, 2048):
            assert backend(D=D, window=window) is Backend.GLUON
    assert backend(D=64, window=512, seq_start=torch.zeros(1, dtype=torch.int32)) is Backend.TRITON


def test_options_from_the_environment_and_in_a_block():
    """Every switch has its variable; a call without options takes the innermost kernel_options block's,
    and its backward runs with them (the key a call passes through the custom op)."""
    from fox_kernel import current_options, kernel_options
    from fox_kernel.options import FixedRows

    env = {"FOX_KERNEL_GLUON": "0", "FOX_KERNEL_BACKWARD": "fused", "FOX_KERNEL_FIXED_BOUND": "0",
           "FOX_KERNEL_FIXED_ROWS": "1", "FOX_KERNEL_TMA": "0", "FOX_KERNEL_ORDER_FWD": "heads",
           "FOX_KERNEL_ORDER_DKDV": "blocks", "FOX_KERNEL_ORDER_DQ": "heads"}
    options = KernelOptions.from_env(env)
    assert options == KernelOptions(gluon=False, backward="fused", fixed_bound=False, fixed_rows=FixedRows.ROW,
                                    tma=False, order_fwd="heads", order_dkdv="blocks", order_dq="heads")
    assert KernelOptions.from_key(options.key) == options
    assert KernelOptions.from_env({}) == KernelOptions()
    for name, bad in (("FOX_KERNEL_FIXED_ROWS", "3"), ("FOX_KERNEL_TMA", "no"), ("FOX_KERNEL_ORDER_DQ", "rows")):
        with pytest.raises(ValueError, match=name):
            KernelOptions.from_env({name: bad})
    # values of the wrong kind are refused where the options are made, naming the field
    for kwargs, error, message in (
        (dict(tma="false"), TypeError, r"^tma must be True or False, got 'false'$"),
        (dict(check_gates=1), TypeError, r"^check_gates must be True or False, got 1$"),
        (dict(gluon=None), TypeError, r"^gluon must be True or False, got None$"),
        (dict(fixed_rows=3), ValueError, r"^fixed_rows must be None or one of \[0, 1, 2\] \(FixedRows\), got 3$"),
        (dict(fixed_rows=True), ValueError, r"^fixed_rows must be None or one of .* got True$"),
    ):
        with pytest.raises(error, match=message):
            KernelOptions(**kwargs)
    assert KernelOptions(fixed_rows=2).fixed_rows is FixedRows.TILE_OR_ROW
    with pytest.raises(TypeError, match=r"^KernelOptions has no field nope; its fields: gluon, backward"):
        KernelOptions().replace(nope=1)
    with pytest.raises(TypeError, match=r"^options must be None or a fox_kernel.KernelOptions, got dict$"), \
            kernel_options({"tma": False}):
        pass
    before = current_options()
    with kernel_options(backward="fused", tma=False) as inside:
        assert current_options() == inside == before.replace(backward="fused", tma=False)
        with kernel_options(options):
            assert current_options() == options
        assert current_options() == inside
    assert current_options() == before


def test_gluon_launch_grid():
    """The Gluon passes launch on one grid axis (no 65,535 limit on the blocks of very long sequences), heads
    in the groups asked for, at most all of them; a benchmark's override of a pass's group size applies to
    that pass only. ``wave_group``: the fewest heads whose blocks fill two waves."""
    from fox_kernel.ops.gluon import tiles

    assert tiles.launch_grid("fwd", 86, 12, 12) == ((86 * 12,), 12)
    assert tiles.launch_grid("fwd", 86, 12, 1) == ((86 * 12,), 1)
    assert tiles.launch_grid("dq", 65536, 3, 8) == ((65536 * 3,), 3)
    try:
        tiles.HEAD_GROUPS["dkdv"] = 8
        assert tiles.launch_grid("dkdv", 32, 64, 1) == ((32 * 64,), 8)
        assert tiles.launch_grid("dkdv", 32, 5, 1) == ((32 * 5,), 5)
        assert tiles.launch_grid("fwd", 32, 64, 1) == ((32 * 64,), 1)
    finally:
        tiles.HEAD_GROUPS.clear()
    assert tiles.wave_group(22, 132) == 12  # 4 x 4k at D=64: 12 heads of 22 blocks = 264 programs
    assert tiles.wave_group(86, 132) == 4
    assert tiles.wave_group(264, 132) == 1
    assert tiles.wave_group(10000, 132) == 1


def test_sm_scale_and_head_first(device_dtype):
    device, dtype = device_dtype
    _check(device, dtype, B=2, Tq=45, Tk=45, H=2, Hkv=2, D=32, sm_scale=0.3)
    q, k, v, lf = _inputs(2, 45, 60, 4, 2, 32, device, dtype)
    out = forgetting_attention(q, k, v, lf)
    out_hf = forgetting_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), lf.transpose(1, 2), head_first=True
    )
    torch.testing.assert_close(out_hf.transpose(1, 2), out, rtol=0, atol=0)


def test_plain_attention_when_gates_are_one(device_dtype):
    device, dtype = device_dtype
    q, k, v, lf = _inputs(2, 50, 50, 2, 2, 32, device, dtype)
    zero_gates = torch.zeros_like(lf)
    out = forgetting_attention(q, k, v, zero_gates)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).double(), k.transpose(1, 2).double(), v.transpose(1, 2).double(), is_causal=True
    ).transpose(1, 2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), sdpa, rtol=tol, atol=tol)


def test_pruning_stays_within_its_bound(device_dtype):
    device, dtype = device_dtype
    q, k, v, lf = _inputs(2, 300, 300, 2, 1, 32, device, dtype, speed="fast")
    exact = forgetting_attention(q, k, v, lf)
    pruned = forgetting_attention(q, k, v, lf, adaptive_threshold="auto")
    # Each output row is a convex combination; pruning drops at most eps = e^-10 of the weight,
    # so the change is at most 2 * eps * max|v| (plus rounding).
    bound = 2 * torch.exp(torch.tensor(-10.0)).item() * v.abs().max().item()
    rounding = 1e-5 if dtype == torch.float32 else 2e-2
    assert (pruned.float() - exact.float()).abs().max().item() <= bound + rounding
    # With slow gates and a tight threshold, off-diagonal blocks carry real weight: pruning must show.
    q, k, v, lf = _inputs(2, 300, 300, 2, 1, 32, device, dtype, speed="slow")
    exact = forgetting_attention(q, k, v, lf)
    loose = forgetting_attention(q, k, v, lf, adaptive_threshold=-0.1)
    assert (loose.float() - exact.float()).abs().max().item() > 0.05


@pytest.mark.parametrize("varlen", [False, True])
def test_auto_pruning_bound_of_the_forward(device_dtype, varlen):
    """With "auto" the forward op prunes by a bound it takes itself and hands the per-head (per-sequence)
    bound ln eps - ln Tk - 2 max|q| max|k| |s| to the backward: that bound against float64 torch, and
    the pruned output within eps of the exact one, on rows whose norms vary (a few large query rows)."""
    device, dtype = device_dtype
    from fox_kernel.pruning import pruning_threshold

    B, T, H, Hkv, D = (1, 333, 4, 2, 32) if varlen else (2, 301, 4, 2, 32)
    q, k, v, lf = _inputs(B, T, T, H, Hkv, D, device, dtype, speed="fast", seed=7)
    g = torch.Generator().manual_seed(8)
    scale_rows = torch.where(torch.rand(B, T, H, 1, generator=g) < 0.02, 3.0, 0.5).to(device, dtype)
    q = (q.detach() * scale_rows).requires_grad_()
    cu = torch.tensor([0, 100, 101, 333], dtype=torch.int32, device=device) if varlen else None
    sm_scale = D**-0.5
    out, _, thr = torch.ops.fox_kernel.forgetting_attention_fwd(q, k, v, lf, None, cu, sm_scale, None, -10.0)
    qd, kd = q.detach().double().cpu(), k.detach().double().cpu()
    rows = cu.cpu() if varlen else None
    want = pruning_threshold(qd, kd, sm_scale, T, -10.0, rows=rows).double()
    assert thr.shape == want.shape
    torch.testing.assert_close(thr.double().cpu(), want, rtol=1e-4, atol=1e-4)
    exact = forgetting_attention(q, k, v, lf, cu_seqlens=cu)
    bound = 2 * math.exp(-10.0) * v.abs().max().item()
    rounding = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - exact.float()).abs().max().item() <= bound + rounding
    pruned = forgetting_attention(q, k, v, lf, cu_seqlens=cu, adaptive_threshold="auto")
    assert torch.equal(pruned, out)


@pytest.mark.parametrize("log_tolerance", [-10.0, -3.0])
def test_auto_threshold_takes_any_tolerance(device_dtype, log_tolerance):
    """AutoThreshold(ln eps) prunes by the q/k-norm bound with that eps: "auto" is AutoThreshold(-10), the
    per-head bound handed to the backward is pruning_threshold's with that eps, and the output stays within
    eps of the exact one (a loose eps drops more)."""
    from fox_kernel import AutoThreshold
    from fox_kernel.pruning import pruning_threshold

    device, dtype = device_dtype
    q, k, v, lf = (x.detach() for x in _inputs(2, 300, 300, 2, 1, 32, device, dtype, speed="fast", seed=4))
    sm_scale = 32**-0.5
    out, _, thr = torch.ops.fox_kernel.forgetting_attention_fwd(q, k, v, lf, None, None, sm_scale, None,
                                                                log_tolerance)
    want = pruning_threshold(q.double().cpu(), k.double().cpu(), sm_scale, 300, log_tolerance).double()
    torch.testing.assert_close(thr.double().cpu(), want, rtol=1e-4, atol=1e-4)
    pruned = forgetting_attention(q, k, v, lf, adaptive_threshold=AutoThreshold(log_tolerance))
    assert torch.equal(pruned, out)
    if log_tolerance == -10.0:
        assert torch.equal(pruned, forgetting_attention(q, k, v, lf, adaptive_threshold="auto"))
    exact = forgetting_attention(q, k, v, lf)
    rounding = 1e-5 if dtype == torch.float32 else 2e-2
    bound = 2 * math.exp(log_tolerance) * v.abs().max().item()
    assert (pruned.float() - exact.float()).abs().max().item() <= bound + rounding
    with pytest.raises(ValueError, match="log_pruning_tolerance"):
        AutoThreshold(0.0)


@pytest.mark.parametrize("mode", ["fused", "two-pass"])
def test_pruning_in_the_backward_pass(device_dtype, mode):
    device, dtype = device_dtype
    options = KernelOptions(backward=mode)
    # long enough that the range searches cross several vector loads (small tiles in the interpreter)
    q, k, v, lf = _inputs(1, 700, 700, 2, 1, 16, device, dtype, speed="fast", seed=3)
    do = torch.randn_like(q)
    exact = torch.autograd.grad(forgetting_attention(q, k, v, lf, options=options), (q, k, v, lf), do)
    pruned = torch.autograd.grad(forgetting_attention(q, k, v, lf, adaptive_threshold="auto", options=options),
                                 (q, k, v, lf), do)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(["q", "k", "v", "gates"], exact, pruned):
        scale = a.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= tol * max(scale, 1.0), name
    # a threshold that drops real weight must change the gradients (the pruned passes really skip work)
    loose = torch.autograd.grad(forgetting_attention(q, k, v, lf, adaptive_threshold=-0.5, options=options),
                                (q, k, v, lf), do)
    assert max((a.float() - b.float()).abs().max().item() for a, b in zip(exact, loose)) > 0.05


def test_max_row_norms_and_auto_bound(device_dtype):
    device, dtype = device_dtype
    if device.type == "cpu" and not INTERPRET:
        pytest.skip("the Triton reduction runs on CUDA or in the interpreter")
    from fox_kernel.ops.triton.norms import key_sq_norms, max_row_norms, max_sq_row_norms
    from fox_kernel.pruning import auto_threshold, auto_threshold_and_key_norms, pruning_threshold

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 131, 5, 40, generator=g) * torch.rand(3, 131, 5, 1, generator=g) * 4).to(device, dtype)
    want = torch.linalg.vector_norm(x.double(), dim=-1).amax(dim=1)
    torch.testing.assert_close(max_row_norms(x).double(), want, rtol=1e-5, atol=1e-5)
    # a strided view (head-first storage) gives the same
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(max_row_norms(xt), max_row_norms(x))
    # two tensors in one launch (q and k: other lengths and head counts), and the "auto" bound from them
    y = (torch.randn(3, 70, 2, 40, generator=g) * 3).to(device, dtype)
    want_y = torch.linalg.vector_norm(y.double(), dim=-1).amax(dim=1)
    nx, ny = max_sq_row_norms(x, y)
    torch.testing.assert_close(nx.double(), want**2, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ny.double(), want_y**2, rtol=1e-5, atol=1e-4)
    # the same maxima as each tensor read alone, bit for bit (the Gluon forward's fixed bound takes ny)
    assert torch.equal(ny, max_sq_row_norms(y)) and torch.equal(nx, max_sq_row_norms(x))
    rows = max_sq_row_norms(x[1:2], per_row=True).double()  # every row's (T, H), as packed batches use
    torch.testing.assert_close(rows, torch.linalg.vector_norm(x[1].double(), dim=-1) ** 2, rtol=1e-5, atol=1e-4)
    assert torch.equal(rows.amax(0).float(), max_sq_row_norms(x[1:2])[0])
    q4 = x[:, :, :4]  # 4 query heads over 2 key heads
    u = want[:, :4] * want_y.repeat_interleave(2, dim=1) * 0.3
    bound = -(2 * u + math.log(70)) - 10.0
    torch.testing.assert_close(auto_threshold(q4, y, 0.3, 70, -10.0).double(), bound, rtol=1e-5, atol=1e-4)
    threshold, kn2 = auto_threshold_and_key_norms(q4, y, 0.3, 70, -10.0)
    assert torch.equal(threshold, auto_threshold(q4, y, 0.3, 70, -10.0)) and torch.equal(kn2, key_sq_norms(y, None))
    if device.type == "cuda":  # the CUDA bound (Triton reduction) equals the torch formula on the CPU
        k = x[:, :, :1]
        got = pruning_threshold(x, k, 0.3, 131)
        ref = pruning_threshold(x.cpu(), k.cpu(), 0.3, 131)
        torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-4)


def test_row_norms_past_the_grid_limit_take_several_blocks_a_program(device_dtype, monkeypatch):
    """Past CUDA's limit on grid axis 1 (``launch.MAX_GRID_YZ``, lowered to 2 here: 5 blocks of rows) a
    program of the norms kernel takes every second block: the same maxima and per-row norms, bit for bit."""
    device, dtype = device_dtype
    if device.type == "cpu" and not INTERPRET:
        pytest.skip("the Triton reduction runs on CUDA or in the interpreter")
    from fox_kernel.ops.triton import launch
    from fox_kernel.ops.triton.norms import NORM_ROWS, max_sq_row_norms

    g = torch.Generator().manual_seed(11)
    T = 4 * NORM_ROWS + 9
    x = (torch.randn(2, T, 3, 24, generator=g) * torch.rand(2, T, 3, 1, generator=g) * 4).to(device, dtype)
    y = (torch.randn(2, T - 70, 2, 24, generator=g) * 3).to(device, dtype)
    x[1, 4 * NORM_ROWS + 2, 1] *= 9  # the largest norm of a row in the last block, which a program reaches second
    whole = max_sq_row_norms(x, y), max_sq_row_norms(x[1:], per_row=True)
    monkeypatch.setattr(launch, "MAX_GRID_YZ", 2)
    parts = max_sq_row_norms(x, y), max_sq_row_norms(x[1:], per_row=True)
    for a, b in zip([*whole[0], whole[1]], [*parts[0], parts[1]]):
        assert torch.equal(a, b)
    want = torch.linalg.vector_norm(x.double(), dim=-1).amax(dim=1) ** 2
    torch.testing.assert_close(parts[0][0].double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("varlen", [False, True])
def test_local_prefix_sums(device_dtype, varlen):
    """The float32 tile-local sums the kernels read: (c_p - c_a) * log2(e), a = start of p's tile,
    tiles at origin + k * seg of every sequence, against the same thing in float64 torch."""
    device, _ = device_dtype
    if device.type == "cpu" and not INTERPRET:
        pytest.skip("the Triton kernel runs on CUDA or in the interpreter")
    from fox_kernel.ops.triton.sums import local_sums
    from fox_kernel.reference import gate_prefix_sum

    g = torch.Generator().manual_seed(7)
    lengths = [37, 70, 5] if varlen else [83, 83]
    T = sum(lengths) if varlen else lengths[0]
    B = 1 if varlen else len(lengths)
    lf = random_log_fgate((B, T, 3), speed="fast", generator=g).to(device)
    c = gate_prefix_sum(lf.double()).transpose(1, 2).contiguous()  # (B, H, T) float64, as the kernels read it
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device) if varlen else None
    bounds = [(int(cu[i]), int(cu[i + 1])) for i in range(len(lengths))] if varlen else [(0, T)]
    for seg, origin in [(16, 0), (32, 0), (16, 5)]:
        got = local_sums(c, cu, len(lengths) if varlen else B, max(lengths), seg, origin)
        want = torch.empty_like(c)
        for bos, eos in bounds:
            for p in range(eos - bos):
                a = 0 if p < origin else origin + (p - origin) // seg * seg
                want[..., bos + p] = (c[..., bos + p] - c[..., bos + a]) * math.log2(math.e)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        assert got.abs().max() > 0.5  # gates are fast: the sums within a tile are far from zero


@pytest.mark.parametrize("T,Tq,padded", [(83, 83, False), (1500, 1500, True), (70, 29, False), (1, 1, False)])
def test_gate_prefix_and_suffix_sum_kernels(device_dtype, T, Tq, padded):
    """The one-launch float64 prefix sums of the gates and the gate gradient (suffix sums of dc plus the
    row term on the last Tq keys, zero on left padding, as (B, T, H)) against float64 torch built from
    first principles, on random data, odd lengths, several chunks (T=1500) and a padded batch."""
    device, _ = device_dtype
    if device.type == "cpu" and not INTERPRET:
        pytest.skip("the Triton kernels run on CUDA or in the interpreter")
    from fox_kernel.ops.triton.sums import prefix_sums, suffix_sums

    g = torch.Generator().manual_seed(11)
    B, H = 2, 3
    lf = random_log_fgate((B, T, H), speed="fast", generator=g).to(device)
    seq_start = torch.tensor([0, min(5, T - 1)], device=device) if padded else None
    keep = torch.ones(B, T, dtype=torch.float64)
    if padded:
        keep[1, : int(seq_start[1])] = 0
    want_c = torch.cumsum(lf.double().cpu() * keep[..., None], dim=1).transpose(1, 2)
    c = prefix_sums(lf, seq_start)
    assert c.dtype == torch.float64 and c.shape == (B, H, T)
    torch.testing.assert_close(c.cpu(), want_c, rtol=1e-12, atol=1e-9)

    dc = torch.randn(B, H, T, generator=g).to(device)
    dc_row = torch.randn(B, H, Tq, generator=g).to(device)
    total = dc.double().cpu().clone()
    total[..., T - Tq :] += dc_row.double().cpu()
    want = torch.flip(torch.cumsum(torch.flip(total, [-1]), -1), [-1]).transpose(1, 2) * keep[..., None]
    got = suffix_sums(dc, dc_row, seq_start)
    assert got.dtype == torch.float32 and got.shape == (B, T, H) and got.is_contiguous()
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 1.0


@pytest.mark.parametrize("shape", [(2, 0, 0), (2, 0, 9), (0, 5, 5)], ids=["T=0", "Tq=0<Tk", "B=0"])
@pytest.mark.parametrize("pruning", [None, "auto"])
def test_empty_inputs_give_empty_outputs_and_zero_gradients(device_dtype, shape, pruning):
    """No query row launches nothing: the Triton kernels in the interpreter died of SIGSEGV at T=0, and the
    "auto" bound failed in a reduction over zero rows; the plain reference's outputs and gradients are
    empty or zero."""
    device, dtype = device_dtype
    B, Tq, Tk = shape
    q, k, v, lf = (x.requires_grad_() for x in _inputs(B, Tq, Tk, 4, 2, 16, device, dtype))
    out = forgetting_attention(q, k, v, lf, adaptive_threshold=pruning)
    ins = [x.detach().double().requires_grad_() for x in (q, k, v, lf)]
    ref = forgetting_attention_ref(*ins)
    assert out.shape == ref.shape == q.shape
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grads = torch.autograd.grad(out, (q, k, v, lf), do, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, ins, do.double(), allow_unused=True)
    for g, r, x in zip(grads, ref_grads, (q, k, v, lf)):
        r = torch.zeros_like(x, dtype=torch.float64) if r is None else r
        assert g.shape == x.shape and g.dtype == x.dtype
        torch.testing.assert_close(g.double().cpu(), r.cpu(), rtol=0, atol=0)  # compared on the host


def test_float64_outputs_and_gradients_have_float64_accuracy():
    """float64 q/k/v (the PyTorch path) sum the gates' prefix sums and keep the log-sum-exp in float64: the
    decay terms c_i - c_j of float32 sums were off by ~2e-7, as was every output. Reference: the plain
    formula with float64 gates."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 4, 16, generator=g, dtype=torch.float64) for _ in range(3))
    lf = torch.nn.functional.logsigmoid(torch.randn(2, 40, 4, generator=g) + 2)
    ins = [x.clone().requires_grad_() for x in (q, k, v, lf)]
    refs = [x.detach().double().requires_grad_() for x in (q, k, v, lf)]
    out = forgetting_attention(*ins)
    ref = forgetting_attention_ref(*refs)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    do = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, e in zip(torch.autograd.grad(out, ins, do), torch.autograd.grad(ref, refs, do)):
        torch.testing.assert_close(a.double(), e, rtol=1e-6 if a.dtype == torch.float32 else 1e-11, atol=1e-11)


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("Tq, Tk, blocks_first", [(53, 53, False), (29, 70, True)])
def test_kept_ranges_of_both_passes_from_one_launch(device, Tq, Tk, blocks_first):
    """The one launch that fills both backward passes' pruned-range tables (the Gluon backward's) equals the
    two tables built alone, and the dQ table equals a plain search: for each query block, the first key block
    whose last key's decay from the block's first query reaches the bound (else the diagonal block)."""
    if device == "cpu" and not INTERPRET:
        pytest.skip("the range kernel runs on CUDA or under TRITON_INTERPRET=1")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fox_kernel.ops.triton.ranges import kept_ranges, kept_ranges_pair
    from fox_kernel.ops.triton.sums import prefix_sums

    B, H = 2, 3
    g = torch.Generator().manual_seed(Tq + Tk)
    lf = random_log_fgate((B, Tk, H), speed="fast", generator=g).to(device)
    c = prefix_sums(lf, None)  # (B, H, Tk) float64
    threshold = (-torch.rand(B, H, generator=g) * 6 - 0.5).to(device)
    key_blocks, query_blocks = dict(BLOCK_M=16, BLOCK_N=32), dict(BLOCK_M=32, BLOCK_N=16)
    keys, queries = kept_ranges_pair(c, None, None, threshold, B, H, Tq, Tk, Tk, key_blocks, query_blocks,
                                     blocks_first=blocks_first)  # both grid orientations
    alone_keys = kept_ranges(c, None, None, threshold, B, H, Tq, Tk, Tk, key_blocks, False)
    alone_queries = kept_ranges(c, None, None, threshold, B, H, Tq, Tk, Tk, query_blocks, True)
    torch.testing.assert_close(keys, alone_keys, rtol=0, atol=0)
    # rows past Tq's last query block are never written (nor read)
    n_query_blocks = math.ceil(Tq / query_blocks["BLOCK_M"])
    torch.testing.assert_close(queries[:, :n_query_blocks], alone_queries[:, :n_query_blocks], rtol=0, atol=0)
    cc, bound = c.cpu().view(B * H, Tk), threshold.cpu().view(B * H)
    bm, bn = query_blocks["BLOCK_M"], query_blocks["BLOCK_N"]
    pruned_somewhere = False
    for r in range(B * H):
        for i in range(n_query_blocks):
            first = i * bm + Tk - Tq
            mid = (min(first, Tk) // bn) * bn
            want = next((j for j in range(0, mid, bn) if cc[r, first] - cc[r, j + bn - 1] >= bound[r]), mid)
            assert int(queries[r, i]) == want, (r, i, int(queries[r, i]), want)
            pruned_somewhere |= want > 0
    assert pruned_somewhere  # the case prunes: a search that kept every block would not pass unnoticed
