"""Decoding against a cache of prefix sums equals the full forward, step by step and chunk by chunk."""

import pytest
import torch

from fox_kernel import append_to_cache, forgetting_attention_with_kvcache
from fox_kernel.reference import forgetting_attention_ref
from fox_kernel.testing import random_log_fgate


def _data(B=2, T=40, H=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, Hkv, D, generator=g, dtype=torch.float64)
    return q, k, v, random_log_fgate((B, T, H), generator=g)


def test_step_by_step_and_chunks_equal_full_forward():
    q, k, v, lf = _data()
    full = forgetting_attention_ref(q, k, v, lf.double())
    for chunks in ([40], [1] * 40, [7, 1, 13, 19]):
        cache = (None, None, None)
        outs, start = [], 0
        for n in chunks:
            sl = slice(start, start + n)
            cache = append_to_cache(*cache, k[:, sl], v[:, sl], lf[:, sl])
            outs.append(forgetting_attention_with_kvcache(q[:, sl], *cache))
            start += n
        torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-5, atol=1e-5)


def test_left_padding_in_the_cache():
    q, k, v, lf = _data(B=3)
    seq_start = torch.tensor([0, 11, 39])
    full = forgetting_attention_ref(q, k, v, lf.double(), seq_start=seq_start)
    cache = append_to_cache(None, None, None, k[:, :30], v[:, :30], lf[:, :30], seq_start=seq_start)
    first = forgetting_attention_with_kvcache(q[:, :30], *cache, seq_start=seq_start)
    cache = append_to_cache(*cache, k[:, 30:], v[:, 30:], lf[:, 30:], seq_start=seq_start)
    rest = forgetting_attention_with_kvcache(q[:, 30:], *cache, seq_start=seq_start)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache[2][1, :11].abs().max() == 0  # padded gates do not enter the prefix sums


DEVICES = [pytest.param(("cpu", torch.float32), id="cpu-fp32"),
           pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=pytest.mark.gpu),
           pytest.param(("cuda", torch.float16), id="cuda-fp16", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device_dtype", DEVICES)
@pytest.mark.parametrize("Tq", [1, 3, 40])
def test_preallocated_cache_with_per_row_lengths(device_dtype, Tq):
    """Rows of different lengths in one preallocated cache, GQA, left padding; vs the float64 reference."""
    device, dtype = device_dtype
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    B, Tmax, H, Hkv, D = 3, 300, 8, 2, 64
    lengths = [300, 97, 41]
    seq_start = torch.tensor([0, 10, 0])
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, Tq, H, D, generator=g)
    k = torch.randn(B, Tmax, Hkv, D, generator=g)
    v = torch.randn(B, Tmax, Hkv, D, generator=g)
    lf = random_log_fgate((B, Tmax, H), speed="slow", generator=g)
    _, _, c = append_to_cache(None, None, None, k, v, lf, seq_start=seq_start)
    out = forgetting_attention_with_kvcache(
        q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), c.to(device),
        torch.tensor(lengths, dtype=torch.int32, device=device), seq_start=seq_start.to(device))
    for b, L in enumerate(lengths):
        qb = torch.zeros(1, L, H, D, dtype=torch.float64)
        qb[:, L - Tq :] = q[b : b + 1].double()
        ref = forgetting_attention_ref(qb, k[b : b + 1, :L].double(), v[b : b + 1, :L].double(), lf[b : b + 1, :L].double(),
                                       seq_start=seq_start[b : b + 1])[:, L - Tq :]
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[b : b + 1].double().cpu(), ref, rtol=tol, atol=tol)
