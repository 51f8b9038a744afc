"""Decoding against a cache of prefix sums equals the full forward, step by step and chunk by chunk."""

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
