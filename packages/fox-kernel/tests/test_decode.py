"""Decoding against a cache of prefix sums equals the full forward, step by step and chunk by chunk."""

import os

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
    _check_rows_against_reference(out, q, k, v, lf, lengths, seq_start)


def _check_rows_against_reference(out, q, k, v, lf, lengths, seq_start):
    """Each row's decoded ``Tq`` queries, the last of its ``lengths[b]`` tokens, vs the float64 reference."""
    Tq, H, D = q.shape[1:]
    for b, L in enumerate(lengths):
        qb = torch.zeros(1, L, H, D, dtype=torch.float64)
        qb[:, L - Tq :] = q[b : b + 1].double()
        ref = forgetting_attention_ref(qb, k[b : b + 1, :L].double(), v[b : b + 1, :L].double(), lf[b : b + 1, :L].double(),
                                       seq_start=seq_start[b : b + 1])[:, L - Tq :]
        tol = 1e-4 if out.dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[b : b + 1].double().cpu(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("device_dtype", DEVICES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_batch_past_the_grid_limit_decodes_in_parts(device_dtype, paged, monkeypatch):
    """(sequence, KV head) pairs past the programs CUDA allows on a grid's second axis
    (``launch.MAX_GRID_YZ``, 65,535, lowered here to 64, which 3 rows x 24 KV heads pass): the Triton kernel
    decodes the batch in parts of 2 rows (``launch.run`` refuses any launch past the limit), with rows of
    different lengths, left padding and GQA; vs the float64 reference."""
    device, dtype = device_dtype
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fox_kernel import append_to_paged_cache, gate_cache
    from fox_kernel.ops.triton import launch

    monkeypatch.setattr(launch, "MAX_GRID_YZ", 64)
    B, Tmax, H, Hkv, D, Tq = 3, 100, 48, 24, 16, 5
    lengths, seq_start = [100, 57, 31], torch.tensor([0, 4, 0])
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, Tq, H, D, generator=g)
    k = torch.randn(B, Tmax, Hkv, D, generator=g)
    v = torch.randn(B, Tmax, Hkv, D, generator=g)
    lf = random_log_fgate((B, Tmax, H), generator=g)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if paged:  # 12 pages of 32 tokens, 4 a row, shuffled
        table = torch.randperm(12, generator=g).view(B, 4).to(device, torch.int32)
        kc = torch.zeros(12, 32, Hkv, D, device=device, dtype=dtype)
        vc, cc = torch.zeros_like(kc), torch.zeros(12, 32, H, device=device)
        start = torch.zeros(B, dtype=torch.int32, device=device)
        append_to_paged_cache(kc, vc, cc, table, start, k.to(device, dtype), v.to(device, dtype), lf.to(device),
                              seq_start=seq_start.to(device))
        out = forgetting_attention_with_kvcache(q.to(device, dtype), kc, vc, cc, lens, seq_start=seq_start.to(device),
                                                block_table=table)
    else:
        kc, vc = k.to(device, dtype), v.to(device, dtype)
        cc = gate_cache(B, Tmax, H, device)
        cc.copy_(append_to_cache(None, None, None, k, v, lf, seq_start=seq_start)[2])
        out = forgetting_attention_with_kvcache(q.to(device, dtype), kc, vc, cc, lens, seq_start=seq_start.to(device))
    _check_rows_against_reference(out, q, k, v, lf, lengths, seq_start)


@pytest.mark.parametrize("device_dtype", DEVICES)
@pytest.mark.parametrize("page_size", [16, 5, 128])
def test_paged_cache_equals_contiguous_decoding(device_dtype, page_size):
    """Pages in a shuffled pool, rows of different lengths, GQA, left padding, prefill then steps: the
    paged cache gives what the float64 reference gives on the same tokens."""
    device, dtype = device_dtype
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fox_kernel import append_to_paged_cache

    B, H, Hkv, D = 3, 4, 2, 32
    lengths, seq_start = [70, 33, 51], torch.tensor([0, 6, 0])
    g = torch.Generator().manual_seed(4)
    T = max(lengths)
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.randn(B, T, Hkv, D, generator=g)
    v = torch.randn(B, T, Hkv, D, generator=g)
    lf = random_log_fgate((B, T, H), generator=g)
    per_row = -(-T // page_size) + 1
    pool = torch.randperm(B * per_row, generator=g).to(torch.int32)
    table = pool.view(B, per_row).to(device)
    n_pages = B * per_row
    kc = torch.zeros(n_pages, page_size, Hkv, D, dtype=dtype, device=device)
    vc, cc = torch.zeros_like(kc), torch.zeros(n_pages, page_size, H, device=device)
    lens = torch.zeros(B, dtype=torch.int32, device=device)
    to = lambda x: x.to(device)
    starts = to(seq_start)
    # prefill the first 20 tokens of every row, then one token at a time up to each row's length
    lens = append_to_paged_cache(kc, vc, cc, table, lens, to(k[:, :20]).to(dtype), to(v[:, :20]).to(dtype),
                                 to(lf[:, :20]), seq_start=starts)
    out = forgetting_attention_with_kvcache(to(q[:, :20]).to(dtype), kc, vc, cc, lens, seq_start=starts,
                                            block_table=table)
    for b in range(B):
        ref = forgetting_attention_ref(q[b:b + 1, :20].double(), k[b:b + 1, :20].double(), v[b:b + 1, :20].double(),
                                       lf[b:b + 1, :20].double(), seq_start=seq_start[b:b + 1])
        rows = slice(seq_start[b].item(), 20)
        torch.testing.assert_close(out[b:b + 1, rows].double().cpu(), ref[:, rows], rtol=2e-2, atol=2e-2)
    for t in range(20, T):
        live = torch.tensor([t < n for n in lengths])
        idx = live.nonzero()[:, 0]
        sub_table, sub_lens, sub_starts = table[to(idx)], lens[to(idx)], starts[to(idx)]
        new_lens = append_to_paged_cache(kc, vc, cc, sub_table, sub_lens, to(k[idx, t:t + 1]).to(dtype),
                                         to(v[idx, t:t + 1]).to(dtype), to(lf[idx, t:t + 1]), seq_start=sub_starts)
        lens[to(idx)] = new_lens
        step = forgetting_attention_with_kvcache(to(q[idx, t:t + 1]).to(dtype), kc, vc, cc, new_lens,
                                                 seq_start=sub_starts, block_table=sub_table)
        if t % 9 == 0 or t == T - 1:
            for j, b in enumerate(idx.tolist()):
                ref = forgetting_attention_ref(q[b:b + 1, :t + 1].double(), k[b:b + 1, :t + 1].double(),
                                               v[b:b + 1, :t + 1].double(), lf[b:b + 1, :t + 1].double(),
                                               seq_start=seq_start[b:b + 1])
                torch.testing.assert_close(step[j].double().cpu(), ref[0, t:t + 1], rtol=2e-2, atol=2e-2)
    assert lens.tolist() == lengths


def test_paged_cache_errors_name_the_argument():
    from fox_kernel import append_to_paged_cache

    kc = torch.zeros(4, 8, 1, 16)
    cc = torch.zeros(4, 8, 2)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    q = torch.randn(2, 1, 2, 16)
    with pytest.raises(ValueError, match="cache_seqlens is required"):
        forgetting_attention_with_kvcache(q, kc, kc, cc, block_table=table)
    with pytest.raises(ValueError, match="block_table must be int32"):
        forgetting_attention_with_kvcache(q, kc, kc, cc, torch.ones(2, dtype=torch.int32), block_table=table.long())
    with pytest.raises(ValueError, match="paged c_cache must be float32"):
        forgetting_attention_with_kvcache(q, kc, kc, cc.double(), torch.ones(2, dtype=torch.int32), block_table=table)
    with pytest.raises(ValueError, match="block_table holds 16 tokens"):
        append_to_paged_cache(kc, kc.clone(), cc, table, torch.tensor([10, 0], dtype=torch.int32),
                              torch.zeros(2, 7, 1, 16), torch.zeros(2, 7, 1, 16), torch.zeros(2, 7, 2))


def test_fill_empty_cache_writes_what_the_paged_append_writes():
    """The prefill form (slice copies into empty rows) leaves the cache exactly as the general scattered
    append does, left padding included, and refuses a prefill longer than the cache."""
    from fox_kernel import append_to_paged_cache, fill_empty_cache

    torch.manual_seed(3)
    B, Tn, cap, Hkv, H, D = 3, 13, 17, 2, 4, 8
    k, v = torch.randn(B, Tn, Hkv, D), torch.randn(B, Tn, Hkv, D)
    lf = torch.nn.functional.logsigmoid(torch.randn(B, Tn, H))
    seq_start = torch.tensor([0, 5, 12], dtype=torch.int32)
    caches = [(torch.randn(B, cap, Hkv, D), torch.randn(B, cap, Hkv, D), torch.randn(B, cap, H)) for _ in range(2)]
    for a, b in zip(*caches):
        b.copy_(a)
    lens = fill_empty_cache(*caches[0], k, v, lf, seq_start)
    rows = torch.arange(B, dtype=torch.int32)[:, None]
    ref_lens = append_to_paged_cache(*caches[1], rows, torch.zeros(B, dtype=torch.int32), k, v, lf, seq_start)
    assert lens.tolist() == ref_lens.tolist() == [Tn] * B
    for a, b in zip(*caches):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="holds 17 tokens per row; 18 new"):
        fill_empty_cache(*caches[0], torch.randn(B, 18, Hkv, D), torch.randn(B, 18, Hkv, D), torch.zeros(B, 18, H))
    with pytest.raises(ValueError, match=r"k_new must be shaped like its cache with 13 positions, \(3, 13, 2, 8\), got \(1, 13, 2, 8\)"):
        fill_empty_cache(*caches[0], k[:1], v, lf)  # a batch of 1 is not broadcast over the cache's rows
    with pytest.raises(ValueError, match=r"log_fgate_new must be shaped .* got \(3, 12, 4\)"):
        fill_empty_cache(*caches[0], k, v, lf[:, :12])


@pytest.mark.parametrize("device_dtype", DEVICES)
def test_decode_pruning_of_cache_tiles(device_dtype):
    """Fast gates and a long cache: skipping decayed tiles stays within the weight bound; a loose threshold
    really skips (the output changes), and slow gates skip nothing."""
    device, dtype = device_dtype
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fox_kernel.options import INTERPRET

    if device == "cpu" and not INTERPRET:
        pytest.skip("pruning is a feature of the Triton kernel (CUDA or the interpreter)")
    B, T, H, Hkv, D = 2, 400, 4, 2, 32
    g = torch.Generator().manual_seed(9)
    q = torch.randn(B, 2, H, D, generator=g).to(device, dtype)
    k = torch.randn(B, T, Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(B, T, Hkv, D, generator=g).to(device, dtype)
    for speed in ("fast", "slow"):
        lf = random_log_fgate((B, T, H), speed=speed, generator=g).to(device)
        _, _, c = append_to_cache(None, None, None, k, v, lf)
        exact = forgetting_attention_with_kvcache(q, k, v, c)
        # the bound with eps = e^-10: -(2 max|q| max|k| scale + ln T) - 10
        u = q.float().norm(dim=-1).amax() * k.float().norm(dim=-1).amax() * D**-0.5
        bound = float(-(2 * u + torch.log(torch.tensor(float(T)))) - 10)
        pruned = forgetting_attention_with_kvcache(q, k, v, c, adaptive_threshold=bound)
        tol = 2 * torch.exp(torch.tensor(-10.0)).item() * v.abs().max().item() + (1e-5 if dtype == torch.float32 else 2e-2)
        assert (pruned.float() - exact.float()).abs().max().item() <= tol, speed
        # a loose threshold: the kernel must drop exactly the leading tiles the rule names, per (row, KV head)
        thr, block_n = -0.05, (16 if INTERPRET else 64)
        loose = forgetting_attention_with_kvcache(q, k, v, c, adaptive_threshold=thr)
        cd, group, skipped = c.double().cpu(), H // Hkv, []
        for b in range(B):
            for hk in range(Hkv):
                heads = list(range(hk * group, (hk + 1) * group))
                c_q = cd[b, T - 2:, heads]  # (2 queries, group)
                j0 = 0
                while j0 < T and (c_q - cd[b, min(j0 + block_n, T) - 1, heads]).max() < thr:
                    j0 += block_n
                for i in range(2):
                    pos = T - 2 + i
                    for h in heads:
                        s_ = (q[b, i, h].double().cpu() @ k[b, j0:pos + 1, hk].double().cpu().T) * D**-0.5
                        p_ = torch.softmax(s_ + cd[b, pos, h] - cd[b, j0:pos + 1, h], 0)
                        want = p_ @ v[b, j0:pos + 1, hk].double().cpu()
                        torch.testing.assert_close(loose[b, i, h].double().cpu(), want, rtol=2e-2, atol=2e-2)
                skipped.append(j0)
        assert max(skipped) > 0, speed  # the rule did name tiles to skip, and the kernel skipped exactly those
    with pytest.raises(ValueError, match="adaptive_threshold must"):
        forgetting_attention_with_kvcache(q, k, v, c, adaptive_threshold="auto")


@pytest.mark.parametrize("device_dtype", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
def test_one_slice_per_row_writes_what_the_merge_writes(device_dtype, paged, monkeypatch):
    """A cache cut into one slice per row (as at 64 x 4k on an H200) is decoded and written by one kernel,
    without the merge: the output is the float64 reference's, as the merged output of three slices is. GQA,
    three new tokens, rows of different lengths (one of just the new tokens), left padding, a NaN prefix sum
    (a NaN row)."""
    from fox_kernel.ops.triton import decode as triton_decode
    from fox_kernel.options import INTERPRET

    device, dtype = device_dtype
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if device == "cpu" and not INTERPRET:
        pytest.skip("the slices are the Triton kernel's (CUDA or the interpreter)")
    B, T, H, Hkv, D, Tq, page = 4, 37, 6, 2, 24, 3, 5
    q, k, v, lf = _data(B, T, H, Hkv, D, seed=11)
    lengths, seq_start = torch.tensor([37, 20, 3, 29], dtype=torch.int32), torch.tensor([0, 3, 0, 0])
    c = torch.zeros(B, T, H, dtype=torch.float64)
    for b in range(B):
        c[b, seq_start[b]:] = torch.cumsum(lf[b, seq_start[b]:].double(), dim=0)
    c = c.float()
    c[3, 10, 1] = float("nan")  # row 3's head 1 reads it: NaN
    kc, vc, cc = k.to(dtype), v.to(dtype), c
    table = None
    if paged:  # pages of 5 tokens, 8 a row, in a shuffled pool
        perm = torch.randperm(B * 8, generator=torch.Generator().manual_seed(2))
        table = perm.view(B, 8).to(torch.int32)

        def pool(x):
            pages = torch.nn.functional.pad(x, [0, 0] * (x.dim() - 2) + [0, 8 * page - T])
            out = torch.empty(B * 8, page, *x.shape[2:], dtype=x.dtype)
            out[perm] = pages.reshape(B * 8, page, *x.shape[2:])
            return out

        kc, vc, cc = pool(kc), pool(vc), pool(cc)
    qs = torch.stack([q[b, n - Tq:n] for b, n in enumerate(lengths.tolist())]).to(dtype)
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    outs = {}
    for splits in (1, 3):
        monkeypatch.setattr(triton_decode, "_num_splits", lambda *args, n=splits, **kwargs: n)
        outs[splits] = forgetting_attention_with_kvcache(to(qs), to(kc), to(vc), to(cc), to(lengths),
                                                         seq_start=to(seq_start), block_table=to(table)).cpu()
    assert torch.isnan(outs[1][3, :, 1]).all() and not torch.isnan(outs[1][3, :, 0]).any()
    for b in range(B):
        n = int(lengths[b])
        ref = forgetting_attention_ref(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], lf[b:b + 1, :n].double(),
                                       seq_start=seq_start[b:b + 1])
        for got in (outs[1], outs[3]):
            heads = [0, 2, 3, 4, 5] if b == 3 else list(range(H))  # row 3's head 1 is NaN
            torch.testing.assert_close(got[b][:, heads].double(), ref[0, n - Tq:][:, heads], rtol=2e-2, atol=2e-2)


def _head_major(c):
    return c.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("device_dtype", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
def test_head_major_prefix_sums_decode_as_token_major_ones(device_dtype, paged):
    """The decoding kernel takes the prefix sums in any layout: the same values stored head-major (the layout
    of the caches made here) and token-major give the same output, and it is the float64 reference's.
    Odd shapes, GQA, rows of different lengths, left padding, two new tokens."""
    device, dtype = device_dtype
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    B, T, H, Hkv, D, Tq, page = 3, 45, 6, 2, 24, 2, 5
    q, k, v, lf = _data(B, T, H, Hkv, D, seed=7)
    lengths, seq_start = torch.tensor([45, 31, 38], dtype=torch.int32), torch.tensor([0, 4, 0])
    c = torch.zeros(B, T, H, dtype=torch.float64)
    for b in range(B):  # the cache's prefix sums: gates before a row's start do not count
        c[b, seq_start[b]:] = torch.cumsum(lf[b, seq_start[b]:].double(), dim=0)
    c = c.float()
    kc, vc = k.to(dtype), v.to(dtype)
    table = None
    if paged:  # pages of 5 tokens in a shuffled pool
        perm = torch.randperm(B * T // page, generator=torch.Generator().manual_seed(1))
        table = perm.view(B, T // page).to(torch.int32).to(device)
        kc, vc, c = ((torch.empty_like(x.reshape(-1, page, *x.shape[2:])).index_copy_(
            0, perm, x.reshape(-1, page, *x.shape[2:]))) for x in (kc, vc, c))
    qs = torch.stack([q[b, lengths[b] - Tq:lengths[b]] for b in range(B)]).to(dtype)
    to = lambda x: x.to(device)  # noqa: E731
    outs = [forgetting_attention_with_kvcache(to(qs), to(kc), to(vc), to(cache), to(lengths), seq_start=to(seq_start),
                                              block_table=table) for cache in (c, _head_major(c))]
    assert _head_major(c).stride() != c.stride()
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for b in range(B):
        n = int(lengths[b])
        ref = forgetting_attention_ref(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], lf[b:b + 1, :n],
                                       seq_start=seq_start[b:b + 1])
        torch.testing.assert_close(outs[1][b:b + 1].double().cpu(), ref[:, n - Tq:], rtol=2e-2, atol=2e-2)


def test_caches_made_here_hold_the_prefix_sums_head_major():
    """``append_to_cache`` grows c head-major whatever layout it is given, with the float64 prefix sums'
    values; ``gate_cache`` makes a zeroed head-major one and names a bad size."""
    from fox_kernel import gate_cache

    B, H, Hkv, D = 2, 5, 1, 8
    q, k, v, lf = _data(B, 23, H, Hkv, D, seed=3)
    cache = append_to_cache(None, None, None, k[:, :9], v[:, :9], lf[:, :9])
    assert cache[2].stride(1) == 1
    token_major = tuple(x.contiguous() for x in cache)  # a reordered cache (beam search) comes back token-major
    assert token_major[2].stride(2) == 1
    for grown in (append_to_cache(*cache, k[:, 9:], v[:, 9:], lf[:, 9:]),
                  append_to_cache(*token_major, k[:, 9:], v[:, 9:], lf[:, 9:])):
        assert grown[2].shape == (B, 23, H) and grown[2].stride(1) == 1
        torch.testing.assert_close(grown[2].double(), torch.cumsum(lf.double(), dim=1), rtol=1e-6, atol=1e-5)
    made = gate_cache(4, 7, 3)
    assert made.shape == (4, 7, 3) and made.dtype == torch.float32 and made.stride() == (21, 1, 7)
    assert not made.any()
    with pytest.raises(ValueError, match=r"^tokens must be an int >= 0, got -1$"):
        gate_cache(4, -1, 3)


def test_appending_to_a_cuda_cache_reads_nothing_on_the_host():
    """A CUDA graph capture refuses every host read of a device value, so the appends of a decoding step
    read none (values are checked on CPU tensors only). Run on fake CUDA tensors (``FakeTensorMode``, which
    needs no GPU and raises on any read of a value: ``.item()``, ``bool()``, indexing with a 0-dim tensor):
    a paged append with left padding, a row past its table and a page outside the pool, then a contiguous
    prefill and a growing append."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fox_kernel import append_to_paged_cache, fill_empty_cache, gate_cache

    B, H, Hkv, D, page = 3, 4, 2, 8, 5
    with FakeTensorMode():
        dev = torch.device("cuda")
        kc = torch.zeros(6, page, Hkv, D, device=dev, dtype=torch.bfloat16)
        vc, cc = torch.zeros_like(kc), gate_cache(6, page, H, dev)
        table = torch.tensor([[0, 1], [2, 7], [4, 5]], dtype=torch.int32, device=dev)
        lens = torch.tensor([3, 4, 10], dtype=torch.int32, device=dev)
        k, v = (torch.randn(B, 2, Hkv, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        lf = torch.randn(B, 2, H, device=dev).clamp(max=-0.1)
        starts = torch.tensor([0, 1, 0], dtype=torch.int32, device=dev)
        new_lens = append_to_paged_cache(kc, vc, cc, table, lens, k, v, lf, seq_start=starts)
        assert new_lens.shape == (B,) and new_lens.device.type == "cuda"
        kb, vb, cb = torch.zeros(B, 9, Hkv, D, device=dev), torch.zeros(B, 9, Hkv, D, device=dev), gate_cache(
            B, 9, H, dev)
        fill_empty_cache(kb, vb, cb, k.float(), v.float(), lf, starts)
        grown = append_to_cache(k, v, lf, k, v, lf, seq_start=starts)
        assert grown[0].shape == (B, 4, Hkv, D)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_captures_a_paged_decoding_step():
    """One decoding step (append a token to a head-major paged cache, attend over it) is captured in a CUDA
    graph: nothing in it waits on the host, and every replay gives what the same step run eagerly gives, on
    a twin of the cache, bit for bit (output, K/V/prefix-sum pools and lengths)."""
    from fox_kernel import append_to_paged_cache, gate_cache

    B, H, Hkv, D, page, prompt = 3, 6, 2, 32, 16, 21
    dev, dtype = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(5)
    per_row = 4
    table = torch.randperm(B * per_row, device=dev, generator=g).to(torch.int32).view(B, per_row)
    kc = torch.zeros(B * per_row, page, Hkv, D, dtype=dtype, device=dev)
    vc, cc = torch.zeros_like(kc), gate_cache(B * per_row, page, H, dev)
    starts = torch.tensor([0, 6, 0], dtype=torch.int32, device=dev)
    lens = torch.zeros(B, dtype=torch.int32, device=dev)

    def new_tokens(n):
        return (torch.randn(B, n, Hkv, D, device=dev, generator=g, dtype=dtype),
                torch.randn(B, n, Hkv, D, device=dev, generator=g, dtype=dtype),
                random_log_fgate((B, n, H), generator=g, device=dev))

    lens.copy_(append_to_paged_cache(kc, vc, cc, table, lens, *new_tokens(prompt), seq_start=starts))
    q_in, (k_in, v_in, lf_in) = torch.randn(B, 1, H, D, device=dev, generator=g, dtype=dtype), new_tokens(1)

    def step(kc, vc, cc, lens):
        lens.copy_(append_to_paged_cache(kc, vc, cc, table, lens, k_in, v_in, lf_in, seq_start=starts))
        return forgetting_attention_with_kvcache(q_in, kc, vc, cc, lens, seq_start=starts, block_table=table)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels outside the capture
        step(kc, vc, cc, lens)
    torch.cuda.current_stream().wait_stream(side)
    twin = [kc.clone(), vc.clone(), cc.contiguous(), lens.clone()]
    assert twin[2].stride() != cc.stride()  # the twin's prefix sums are token-major: both layouts run
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(kc, vc, cc, lens)
    for _ in range(5):
        q_in.copy_(torch.randn(q_in.shape, device=dev, generator=g, dtype=dtype))
        for buf, x in zip((k_in, v_in, lf_in), new_tokens(1)):
            buf.copy_(x)
        graph.replay()
        eager = step(*twin)
        torch.testing.assert_close(captured, eager, rtol=0, atol=0)
        for x, y in zip((kc, vc, cc, lens), twin):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert lens.tolist() == [prompt + 6] * B


def _long_cache_error(T, how, device="cpu", dtype=torch.float32, H=2, Hkv=2, D=16, Tq=64, window=3000):
    """Relative error of decoding the last ``Tq`` tokens of a T-token cache filled ``how``, against float64 on
    the last ``window + Tq`` keys (fast gates: keys before them decay past e^-800, checked, and weigh
    exactly 0 in float64). ``how``: "one append" (``append_to_cache`` of all T tokens), "chunks" (of 65,536,
    then the last Tq one at a time), "fill" (``fill_empty_cache`` of all but the last Tq, which a paged
    append adds), "paged" (``append_to_paged_cache`` into empty rows of shuffled 256-token pages),
    "generated" (``fill_empty_cache`` of 1,024 tokens, then a paged append of one token at a time, as a
    static cache grows while generating: those sums are not shifted)."""
    from fox_kernel import append_to_paged_cache, fill_empty_cache, gate_cache

    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, T, Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(1, T, Hkv, D, generator=g).to(device, dtype)
    q = torch.randn(1, Tq, H, D, generator=g).to(device, dtype)
    lf = random_log_fgate((1, T, H), generator=g).to(device)
    lens = block_table = None
    if how == "one append":
        kc, vc, cc = append_to_cache(None, None, None, k, v, lf)
    elif how == "chunks":
        cache = (None, None, None)
        for s, e in [(s, min(s + 65536, T - Tq)) for s in range(0, T - Tq, 65536)] + [(t, t + 1) for t in range(T - Tq, T)]:
            cache = append_to_cache(*cache, k[:, s:e], v[:, s:e], lf[:, s:e])
        kc, vc, cc = cache
    elif how == "fill":
        kc, vc, cc = torch.empty_like(k), torch.empty_like(v), gate_cache(1, T, H, device)
        lens = fill_empty_cache(kc[:, :T - Tq], vc[:, :T - Tq], cc[:, :T - Tq], k[:, :-Tq], v[:, :-Tq], lf[:, :-Tq])
        block_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        lens = append_to_paged_cache(kc, vc, cc, block_table, lens, k[:, -Tq:], v[:, -Tq:], lf[:, -Tq:])
        block_table = None
    elif how == "generated":
        kc, vc, cc = torch.empty_like(k), torch.empty_like(v), gate_cache(1, T, H, device)
        lens = fill_empty_cache(kc[:, :1024], vc[:, :1024], cc[:, :1024], k[:, :1024], v[:, :1024], lf[:, :1024])
        block_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        for t in range(1024, T):
            lens = append_to_paged_cache(kc, vc, cc, block_table, lens, k[:, t:t + 1], v[:, t:t + 1], lf[:, t:t + 1])
        assert cc[0, -1].abs().min().item() > 0.3 * (T - 1024)  # the newest sums drifted as far as the gates went
    else:
        page, pages = 256, -(-T // 256)
        kc = torch.zeros(pages, page, Hkv, D, device=device, dtype=dtype)
        vc, cc = torch.zeros_like(kc), torch.zeros(pages, page, H, device=device)
        block_table = torch.randperm(pages, generator=g).to(device, torch.int32)[None]
        lens = append_to_paged_cache(kc, vc, cc, block_table, torch.zeros(1, dtype=torch.int32, device=device), k, v, lf)
    out = forgetting_attention_with_kvcache(q, kc, vc, cc, lens, block_table=block_table)

    s = T - Tq - window
    assert lf[0, s:T - Tq].double().sum(0).max().item() < -800
    c = torch.cumsum(lf[0, s:].double(), 0)  # (window + Tq, H)
    ks, vs = (x[0, s:].double().repeat_interleave(H // Hkv, dim=1) for x in (k, v))
    scores = torch.einsum("ihd,jhd->hij", q[0].double(), ks) * D**-0.5 + c[window:].T[:, :, None] - c.T[:, None, :]
    scores = scores.masked_fill(torch.arange(window + Tq, device=device)[None, :] > window + torch.arange(Tq, device=device)[:, None],
                                float("-inf"))
    exact = torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), vs)
    return ((out[0].double() - exact).norm() / exact.norm()).item()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreted kernel takes 2 minutes a case here; the shift is the caches' (the "
                           "GPU test runs the kernel on shifted sums)")
@pytest.mark.parametrize("how", ["one append", "chunks", "fill", "paged"])
def test_a_long_cache_decodes_as_exactly_as_a_short_one(how):
    """The cached prefix sums are kept near the newest token (``decode.RECENTER_STEP``): at 262,181 tokens of
    fast gates (|c| ~ 9e4 before the shift, where float32 keeps 1/128) decoding is as close to float64 as at
    8,229 (2.5e-7 to 6.8e-7 at both lengths; sums left unshifted read 4e-5 and 1.3e-3 to 1.5e-3)."""
    short, long = _long_cache_error(8192 + 37, how), _long_cache_error(2**18 + 37, how)
    assert long <= 4 * short + 1e-6, (short, long)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="65k steps of the interpreted kernel")
def test_a_generated_cache_drifts_by_far_less_than_bf16_resolution():
    """Tokens appended one at a time to a row that already holds some (a static cache while generating) are
    not re-centred (see decode.py's docstring): after 64k of them (|c| ~ 2.6e4) decoding loses float32's
    precision of re-centred sums (4.3e-4 relative error, against 9.3e-7 for the same cache filled at once)
    but stays well below bf16's resolution (3.9e-3)."""
    error = _long_cache_error(2**16 + 37, "generated")
    assert 1e-6 < error < 1e-3, error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_million_token_cache_past_int32_offsets_decodes_as_exactly_as_a_short_one():
    # T * Hkv * D = 2,281,767,936 elements per cache tensor, past 2^31: the kernel's offsets must be int64
    errors = {}
    for how in ("one append", "paged"):
        short = _long_cache_error(8192 + 37, how, "cuda", torch.bfloat16, H=34, Hkv=17, D=128)
        long = _long_cache_error(2**20 + 37, how, "cuda", torch.bfloat16, H=34, Hkv=17, D=128)
        errors[how] = (short, long)
        assert long <= 1.5 * short + 1e-4, (how, short, long)
    print("relative error, T = 8,229 / 1,048,613:", errors)
