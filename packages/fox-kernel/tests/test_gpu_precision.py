"""GPU-only properties: bit-reproducible gradients and long-context precision."""

import pytest
import torch

from fox_kernel import forgetting_attention
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
