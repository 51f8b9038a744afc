"""GPU-only properties: bit-reproducible gradients and long-context precision and launches."""

import pytest
import torch

from fox_kernel import forgetting_attention
from fox_kernel.reference import forgetting_attention_ref
from fox_kernel.testing import random_log_fgate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("Hkv", [8, 2])
def test_gradients_are_bit_identical_across_runs(Hkv):
    # deterministic mode selects the two-pass backward (no atomics)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _bit_identical(Hkv)
    finally:
        torch.use_deterministic_algorithms(False)


def _bit_identical(Hkv):
    torch.manual_seed(0)
    q = torch.randn(2, 1500, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 1500, Hkv, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 1500, Hkv, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lf = random_log_fgate((2, 1500, 8), device="cuda").requires_grad_()
    do = torch.randn_like(q)
    runs = []
    for _ in range(2):
        out = forgetting_attention(q, k, v, lf)
        runs.append(torch.autograd.grad(out, (q, k, v, lf), do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _rel_error_vs_float64(T, rows=256):
    """Forward error on the last `rows` queries of a length-T sequence with fast-forgetting gates.

    The float64 answer is computed directly for those rows only (T x rows scores)."""
    torch.manual_seed(0)
    H, D = 2, 64
    q = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    lf = torch.nn.functional.logsigmoid(torch.randn(1, T, H, device="cuda") - 1.0)  # mean log f ~ -1.5
    out = forgetting_attention(q, k, v, lf)[0, -rows:].double()
    c = torch.cumsum(lf[0].double(), dim=0)  # (T, H)
    qs = q[0, -rows:].double()
    s = torch.einsum("ihd,jhd->hij", qs, k[0].double()) * D**-0.5
    s = s + c[-rows:].T[:, :, None] - c.T[:, None, :]
    pos_q = torch.arange(T - rows, T, device="cuda")
    s = s.masked_fill(torch.arange(T, device="cuda")[None, :] > pos_q[:, None], float("-inf"))
    exact = torch.einsum("hij,jhd->ihd", torch.softmax(s, dim=-1), v[0].double())
    return ((out - exact).norm() / exact.norm()).item()


def test_long_context_precision_matches_short():
    short = _rel_error_vs_float64(4096)
    long = _rel_error_vs_float64(65536)
    assert long <= 1.5 * short + 1e-4, (short, long)


def _ends_errors(T, H=33, D=64, rows=192, window=3000):
    """Relative errors of the output and all four gradients at the first and the last ``rows`` positions of
    one length-T sequence, each against float64 on a slice of ``rows + window`` positions at its end.

    The slices are all the float64 answer needs (``do`` is random everywhere). At the first positions: their
    outputs see only earlier keys, and their keys' and gates' gradients come from queries at most ``window``
    past them. At the last: every gradient there comes from queries among them and keys before them. In both,
    the gates' log decay across the ``window`` positions beside the compared ones is checked below -800, so
    every query or key left out has a weight that float64 rounds to exactly 0 against those kept."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    lf = random_log_fgate((1, T, H), device="cuda").requires_grad_()
    do = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    out = forgetting_attention(q, k, v, lf)
    grads = torch.autograd.grad(out, (q, k, v, lf), do)
    ends = {"first": (slice(0, rows), slice(0, rows + window), slice(rows, rows + window)),
            "last": (slice(T - rows, T), slice(T - rows - window, T), slice(T - rows - window, T - rows))}
    ours = {end: [x[0, kept].double() for x in (out.detach(), *grads)] for end, (kept, _, _) in ends.items()}
    del out, grads

    errors = {}
    for end, (kept, piece, beside) in ends.items():
        assert lf[0, beside].double().sum(0).max().item() < -800
        sliced = [x.detach()[:, piece].double().requires_grad_() for x in (q, k, v, lf)]
        exact_out = forgetting_attention_ref(*sliced)
        exact = [exact_out.detach(), *torch.autograd.grad(exact_out, sliced, do[:, piece].double())]
        at = slice(kept.start - piece.start, kept.stop - piece.start)
        for name, a, b in zip(("out", "dq", "dk", "dv", "dlog_fgate"), ours[end], exact):
            errors[f"{name}, {end} positions"] = ((a - b[0, at]).norm() / b[0, at].norm()).item()
    return errors


def test_a_million_tokens_past_int32_offsets_match_float64_as_a_short_sequence_does():
    # T*H*D = 2,214,670,656 elements per tensor, past 2^31: the kernels' offsets must be int64. The prefix
    # sums reach about -367,000 at the last positions, where float32 would keep 1/32 of a unit, and the gate
    # gradient at the first positions is a suffix sum over a million positions
    short = _ends_errors(8192 + 37)
    long = _ends_errors(2**20 + 37)
    print("relative error, T = 8,229 / 1,048,613:", {name: f"{short[name]:.2e} / {long[name]:.2e}" for name in short})
    for name in short:
        assert long[name] <= 1.5 * short[name] + 1e-4, (name, short, long)


def test_row_norms_of_more_rows_than_one_grid_axis_holds():
    """4.3M tokens: more blocks of rows than CUDA's 65,535 programs on grid axis 1, so programs of the norms
    kernel take several blocks each; the maxima and every row's norm match PyTorch's float32 sums."""
    from fox_kernel.ops.triton import launch
    from fox_kernel.ops.triton.norms import NORM_ROWS, max_sq_row_norms

    T = launch.MAX_GRID_YZ * NORM_ROWS + 105_767
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, T, 3, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    x[0, T - 5, 2] *= 7  # the largest norm in the last block, past the first pass of axis 1
    y = torch.randn(1, T // 2, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    rows = x[0].float().pow(2).sum(-1)
    nx, ny = max_sq_row_norms(x, y)
    torch.testing.assert_close(nx[0], rows.amax(0), rtol=1e-5, atol=0)
    torch.testing.assert_close(ny[0], y[0].float().pow(2).sum(-1).amax(0), rtol=1e-5, atol=0)
    assert nx[0, 2] > 5 * nx[0, 1]
    torch.testing.assert_close(max_sq_row_norms(x, per_row=True), rows, rtol=1e-5, atol=1e-5)
