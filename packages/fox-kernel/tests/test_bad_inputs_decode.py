"""Bad inputs of the decoding calls: a one-line error naming the argument, the expected and the actual value
where the values can be read (CPU tensors), and on a device (or the Triton interpreter) never a read or
write outside the buffers: out-of-range page indices and lengths give NaN rows and writes that land nowhere."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fox_kernel import append_to_cache, append_to_paged_cache, forgetting_attention_with_kvcache
from fox_kernel.ops import checks
from fox_kernel.options import INTERPRET
from fox_kernel.testing import random_log_fgate

B, H, HKV, D, PAGE, PAGES = 3, 4, 2, 16, 8, 12


def _contiguous(T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, T, HKV, D, generator=g), torch.randn(B, T, HKV, D, generator=g)
    _, _, c = append_to_cache(None, None, None, k, v, random_log_fgate((B, T, H), generator=g))
    return torch.randn(B, 2, H, D, generator=g), k, v, c


def _paged(device="cpu", dtype=torch.float32, seed=1):
    """A pool of PAGES pages in shuffled order, 4 per row; rows of 30, 17 and 9 tokens."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(PAGES, generator=g).to(torch.int32).view(B, 4)
    kc = torch.randn(PAGES, PAGE, HKV, D, generator=g)
    vc = torch.randn(PAGES, PAGE, HKV, D, generator=g)
    cc = torch.cumsum(-torch.rand(PAGES, PAGE, H, generator=g), dim=1)
    lens = torch.tensor([30, 17, 9], dtype=torch.int32)
    q = torch.randn(B, 1, H, D, generator=g)
    to = lambda x: x.to(device)  # noqa: E731
    return to(q).to(dtype), to(kc).to(dtype), to(vc).to(dtype), to(cc), to(table), to(lens)


_KERNEL_DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _kernel_device(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if device == "cpu" and not INTERPRET:
        pytest.skip("the Triton kernel on the CPU runs through the interpreter only (TRITON_INTERPRET=1)")


def test_append_to_cache_refuses_mismatched_new_tokens():
    k, v = torch.randn(1, 2, HKV, D), torch.randn(1, 2, HKV, D)
    gates = random_log_fgate((1, 1, H))
    with pytest.raises(ValueError, match=r"log_fgate_new must have k_new's \(B, Tn\) = \(1, 2\) .*got \(1, 1\)"):
        append_to_cache(None, None, None, k, v, gates)
    kc, vc, cc = append_to_cache(None, None, None, k, v, random_log_fgate((1, 2, H)))
    with pytest.raises(ValueError, match=r"log_fgate_new must have k_new's \(B, Tn\) = \(1, 2\)"):
        append_to_cache(kc, vc, cc, k, v, gates)
    assert kc.shape[1] == cc.shape[1] == 2  # nothing grown
    with pytest.raises(ValueError, match=r"v_new must have k_new's shape \(1, 2, 2, 16\), got \(1, 3, 2, 16\)"):
        append_to_cache(kc, vc, cc, k, torch.randn(1, 3, HKV, D), random_log_fgate((1, 2, H)))
    with pytest.raises(ValueError, match=r"k_cache must have shape \(1, 2, 2, 16\) .*got \(1, 2, 2, 8\)"):
        append_to_cache(kc[..., :8], vc, cc, k, v, random_log_fgate((1, 2, H)))
    with pytest.raises(ValueError, match=r"c_cache must be float32 of shape \(1, 2, 4\), got torch.float32 \(1, 2, 3\)"):
        append_to_cache(kc, vc, cc[..., :3], k, v, random_log_fgate((1, 2, H)))
    with pytest.raises(ValueError, match=r"must all be None .*got k_cache a tensor, v_cache a tensor, c_cache None"):
        append_to_cache(kc, vc, None, k, v, random_log_fgate((1, 2, H)))
    with pytest.raises(TypeError, match=r"k_cache must be one of float16, bfloat16, float32, float64, got int32"):
        append_to_cache(kc.int(), vc, cc, k, v, random_log_fgate((1, 2, H)))
    with pytest.raises(TypeError, match=r"k_new must be one of .* got int64"):
        append_to_cache(None, None, None, k.long(), v, random_log_fgate((1, 2, H)))


def test_decode_refuses_integer_queries_and_caches():
    q, k, v, c = _contiguous()
    with pytest.raises(TypeError, match=r"q must be one of float16, bfloat16, float32, float64, got int64"):
        forgetting_attention_with_kvcache(q.long(), k, v, c)
    with pytest.raises(TypeError, match=r"k_cache must be one of .* got int32"):
        forgetting_attention_with_kvcache(q, k.int(), v, c)
    with pytest.raises(TypeError, match=r"v_cache must be one of .* got int32"):
        forgetting_attention_with_kvcache(q, k, v.int(), c)
    qp, kc, vc, cc, table, lens = _paged()
    with pytest.raises(TypeError, match=r"k_cache must be one of .* got int32"):
        append_to_paged_cache(kc.int(), vc, cc, table, lens, torch.randn(B, 1, HKV, D), torch.randn(B, 1, HKV, D),
                              random_log_fgate((B, 1, H)))


def test_fill_empty_cache_refuses_caches_it_would_cast_or_cannot_reach():
    """An integer K/V cache (copy_ truncated the keys to integers), float64 prefix sums, caches on another
    device and a list as k_new: one line naming the argument, and the caches are left as they were."""
    from fox_kernel import fill_empty_cache

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(B, 5, HKV, D, generator=g), torch.randn(B, 5, HKV, D, generator=g)
    gates = random_log_fgate((B, 5, H), generator=g)
    kc, vc, cc = torch.zeros(B, 8, HKV, D), torch.zeros(B, 8, HKV, D), torch.zeros(B, 8, H)
    cases = [
        ((kc.int(), vc, cc, k, v, gates), TypeError, r"^k_cache must be one of .* got int32$"),
        ((kc, vc.long(), cc, k, v, gates), TypeError, r"^v_cache must be one of .* got int64$"),
        ((kc, vc, cc.double(), k, v, gates), ValueError, r"^c_cache must be float32 of shape \(3, 8, 4\), got torch.float64"),
        ((kc.to("meta"), vc, cc, k, v, gates), ValueError, r"^k_cache must be on cpu like q, got meta$"),
        ((kc, vc, cc, k.tolist(), v, gates), TypeError, r"^k_new must be a torch.Tensor, got list$"),
        ((kc, vc, cc, k, v, gates.double()), TypeError, r"^log_fgate_new must be float32, got torch.float64$"),
        ((kc, vc, cc, k, None, gates), TypeError, r"^v_new must be a torch.Tensor, got NoneType$"),
        ((kc, vc.half(), cc, k, v, gates), TypeError, r"^v_cache must have k_cache's dtype torch.float32, got torch.float16$"),
        ((kc, vc, cc, k, v, gates, torch.tensor([-3, 0, 0])), ValueError, r"^seq_start must be >= 0, got values in \[-3, 0\]$"),
        ((kc, vc, cc, k, v, gates, torch.tensor([2.5, 0, 0])), TypeError, r"^seq_start must hold integers, got torch.float32$"),
        ((kc, vc, cc, k, v, gates, torch.tensor([4])), ValueError, r"^seq_start must have shape \(3,\), got \(1,\)$"),
    ]
    for args, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            fill_empty_cache(*args)
    assert not kc.any() and not vc.any() and not cc.any()
    lens = fill_empty_cache(kc, vc, cc, k, v, gates)  # the valid call writes the keys as they are
    assert lens.tolist() == [5] * B and torch.equal(kc[:, :5], k) and torch.equal(vc[:, :5], v)
    torch.testing.assert_close(cc[:, :5], torch.cumsum(gates.double(), 1).float(), rtol=0, atol=1e-6)


def test_decode_refuses_caches_of_another_dtype_than_q_and_bad_head_counts():
    """The kernels multiply q with the caches as they are: a K or V cache of another dtype is refused at the
    call (the Triton kernel failed to compile on it), as are a head dim outside [1, 256] and caches of no
    heads (``forgetting_attention``'s limits)."""
    q, k, v, c = _contiguous()
    with pytest.raises(TypeError, match=r"^k_cache must have q's dtype torch.float32, got torch.float16$"):
        forgetting_attention_with_kvcache(q, k.half(), v, c)
    with pytest.raises(TypeError, match=r"^v_cache must have q's dtype torch.float16, got torch.float32$"):
        forgetting_attention_with_kvcache(q.half(), k.half(), v, c)
    with pytest.raises(TypeError, match=r"^v_cache must have k_cache's dtype torch.float16, got torch.float32$"):
        append_to_cache(k.half(), v, c, k[:, :1], v[:, :1], random_log_fgate((B, 1, H)))
    with pytest.raises(ValueError, match=r"^head dim must be in \[1, 256\], got 0$"):
        forgetting_attention_with_kvcache(q[..., :0], k[..., :0], v[..., :0], c)
    wide = torch.randn(B, 12, HKV, 300)
    with pytest.raises(ValueError, match=r"^head dim must be in \[1, 256\], got 300$"):
        forgetting_attention_with_kvcache(torch.randn(B, 2, H, 300), wide, wide, c)
    with pytest.raises(ValueError, match=r"^q's 4 heads must be a multiple of the cache's heads, got Hkv=0$"):
        forgetting_attention_with_kvcache(q, k[:, :, :0], v[:, :, :0], c)


@pytest.mark.parametrize("device", _KERNEL_DEVICES)
def test_decode_kernel_takes_starts_past_int32_as_all_padding(device):
    """A start past the cache means a row that is all padding so far (its queries return 0); one past 2^31
    must not wrap around int32 on its way to the kernel."""
    _kernel_device(device)
    q, k, v, c = (x.to(device) for x in _contiguous())
    starts = torch.tensor([2**32 + 3, 0, 4], device=device)
    out = forgetting_attention_with_kvcache(q, k, v, c, seq_start=starts)
    same = forgetting_attention_with_kvcache(q, k, v, c, seq_start=torch.tensor([12, 0, 4], device=device))
    assert not out[0].any() and out[1:].abs().amax() > 0.1
    torch.testing.assert_close(out, same, rtol=0, atol=0)


def test_decode_arguments_that_are_no_tensors_are_named():
    q, k, v, c = _contiguous()
    with pytest.raises(TypeError, match=r"^seq_start must be a torch.Tensor, got list$"):
        forgetting_attention_with_kvcache(q, k, v, c, seq_start=[0, 0, 0])
    with pytest.raises(TypeError, match=r"^cache_seqlens must be a torch.Tensor, got list$"):
        forgetting_attention_with_kvcache(q, k, v, c, [12, 12, 12])
    with pytest.raises(TypeError, match=r"^seq_start must be a torch.Tensor, got tuple$"):
        append_to_cache(None, None, None, k, v, random_log_fgate((B, 12, H)), seq_start=(0, 0, 0))


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 0.0, -0.25, -float("inf"), True, "0.25"])
def test_decode_refuses_a_bad_sm_scale(scale):
    q, k, v, c = _contiguous()
    with pytest.raises(ValueError, match=rf"sm_scale must be None or a finite positive number, got {scale!r}$"):
        forgetting_attention_with_kvcache(q, k, v, c, sm_scale=scale)


def test_decode_takes_a_finite_positive_sm_scale():
    q, k, v, c = _contiguous()
    a = forgetting_attention_with_kvcache(q, k, v, c, sm_scale=0.5)
    b = forgetting_attention_with_kvcache(q * 2, k, v, c, sm_scale=0.25)
    torch.testing.assert_close(a, b)


def test_positive_log_gates_are_refused_where_read():
    k, v = torch.randn(B, 5, HKV, D), torch.randn(B, 5, HKV, D)
    gates = random_log_fgate((B, 5, H))
    gates[1, 3, 2] = 0.5
    with pytest.raises(ValueError, match=r"log_fgate_new must be <= 0 .*got 0.5 at \(b, t, h\) = \(1, 3, 2\)"):
        append_to_cache(None, None, None, k, v, gates)
    _, kc, vc, cc, table, lens = _paged()
    with pytest.raises(ValueError, match=r"log_fgate_new must be <= 0"):
        append_to_paged_cache(kc, vc, cc, table, torch.zeros_like(lens), k, v, gates)
    gates[1, 3, 2] = 0.0  # a gate of 1 is fine
    append_to_cache(None, None, None, k, v, gates)


@pytest.mark.parametrize("bad", [99, -1, 10**8, PAGES])
def test_block_table_entries_outside_the_pool_are_refused_on_the_cpu(bad):
    q, kc, vc, cc, table, lens = _paged()
    used, unused = table.clone(), table.clone()
    used[1, 1] = bad  # row 1 holds 17 tokens: pages 0..2
    unused[1, 3] = bad
    pattern = rf"block_table must hold page indices in \[0, {PAGES}\) .*got {bad} at \(b, j\) = \(1, "
    with pytest.raises(ValueError, match=pattern + r"1\)"):
        forgetting_attention_with_kvcache(q, kc, vc, cc, lens, block_table=used)
    # entries past a row's length are never read and may hold anything
    torch.testing.assert_close(forgetting_attention_with_kvcache(q, kc, vc, cc, lens, block_table=unused),
                               forgetting_attention_with_kvcache(q, kc, vc, cc, lens, block_table=table))
    new = torch.randn(B, 2, HKV, D), torch.randn(B, 2, HKV, D), random_log_fgate((B, 2, H))
    before = [x.clone() for x in (kc, vc, cc)]
    at_end = table.clone()
    at_end[1, 2] = bad  # row 1 appends tokens 17, 18: page 2
    with pytest.raises(ValueError, match=pattern + r"2\)"):
        append_to_paged_cache(kc, vc, cc, at_end, lens, *new)
    for x, y in zip(before, (kc, vc, cc)):
        assert torch.equal(x, y)  # nothing written
    append_to_paged_cache(kc, vc, cc, unused, lens, *new)


def test_paged_append_refuses_negative_lengths_and_bad_tables():
    _, kc, vc, cc, table, lens = _paged()
    new = torch.randn(B, 1, HKV, D), torch.randn(B, 1, HKV, D), random_log_fgate((B, 1, H))
    with pytest.raises(ValueError, match=r"cache_seqlens must be >= 0, got \[30, -2, 9\]"):
        append_to_paged_cache(kc, vc, cc, table, torch.tensor([30, -2, 9], dtype=torch.int32), *new)
    with pytest.raises(ValueError, match=r"block_table must be int32 of shape \(3, pages per row\), got torch.int64"):
        append_to_paged_cache(kc, vc, cc, table.long(), lens, *new)
    with pytest.raises(ValueError, match=r"cache_seqlens must be int32 of shape \(3,\), got torch.int32 \(2,\)"):
        append_to_paged_cache(kc, vc, cc, table, lens[:2], *new)
    with pytest.raises(ValueError, match=r"c_cache must be float32 of shape \(12, 8, 4\)"):
        append_to_paged_cache(kc, vc, cc[..., :2], table, lens, *new)


def _no_host_reads(monkeypatch):
    """What a CUDA call sees: no tensor value may be read on the host."""
    monkeypatch.setattr(checks, "values_checkable", lambda x: False)


def test_paged_append_off_the_host_writes_nothing_outside_the_row(monkeypatch):
    """Without host reads (as on CUDA) a page -1 no longer wraps to the last page (another row's): writes to
    pages outside the pool, and past the table, land nowhere; the other rows' tokens are written."""
    _, kc, vc, cc, table, lens = _paged()
    new = torch.randn(B, 2, HKV, D), torch.randn(B, 2, HKV, D), random_log_fgate((B, 2, H))
    expected = [x.clone() for x in (kc, vc, cc)]
    good_lens = append_to_paged_cache(*expected, table, lens, *new)
    _no_host_reads(monkeypatch)
    for bad in (-1, -PAGES, PAGES, 10**8):
        bad_table = table.clone()
        bad_table[1, 2] = bad
        caches = [x.clone() for x in (kc, vc, cc)]
        lens_after = append_to_paged_cache(*caches, bad_table, lens, *new)
        assert lens_after.tolist() == good_lens.tolist()
        page = int(table[1, 2])
        for got, want, old in zip(caches, expected, (kc, vc, cc)):
            rest = torch.ones(PAGES, dtype=torch.bool)
            rest[page] = False
            assert torch.equal(got[rest], want[rest])  # rows 0 and 2 written, no other page touched
            assert torch.equal(got[page], old[page])  # row 1's tokens 17, 18 not written anywhere
    # a row past its table (31 + 2 tokens in 32) and nothing ok at all: nothing written
    caches = [x.clone() for x in (kc, vc, cc)]
    append_to_paged_cache(*caches, table[:1], torch.tensor([31], dtype=torch.int32),
                          *(x[:1] for x in new))
    for got, old in zip(caches, (kc, vc, cc)):
        assert torch.equal(got[table[0, :3].long()], old[table[0, :3].long()])
        assert torch.equal(got[table[0, 3]][:7], old[table[0, 3]][:7])
    caches = [x.clone() for x in (kc, vc, cc)]
    all_bad = torch.full_like(table, -1)
    append_to_paged_cache(*caches, all_bad, lens, *new)
    for got, old in zip(caches, (kc, vc, cc)):
        assert torch.equal(got, old)


def test_decode_off_the_host_returns_nan_for_rows_of_bad_pages(monkeypatch):
    """The PyTorch path without host reads (float64 on CUDA runs it): a row using a page outside the pool,
    or longer than its table, returns NaN; the other rows are exact."""
    q, kc, vc, cc, table, lens = (x.double() if x.is_floating_point() and x.dim() == 4 else x for x in _paged())
    good = forgetting_attention_with_kvcache(q, kc, vc, cc, lens, block_table=table)
    _no_host_reads(monkeypatch)
    for bad in (-1, 99):
        bad_table = table.clone()
        bad_table[1, 1] = bad
        out = forgetting_attention_with_kvcache(q, kc, vc, cc, lens, block_table=bad_table)
        assert out[1].isnan().all()
        torch.testing.assert_close(out[[0, 2]], good[[0, 2]], rtol=0, atol=0)
    out = forgetting_attention_with_kvcache(q, kc, vc, cc, torch.tensor([30, 33, 9], dtype=torch.int32),
                                            block_table=table)
    assert out[1].isnan().all()
    torch.testing.assert_close(out[[0, 2]], good[[0, 2]], rtol=0, atol=0)


@pytest.mark.parametrize("device", _KERNEL_DEVICES)
@pytest.mark.parametrize("page", [PAGE, 16])  # 16: whole key tiles of the interpreter in one page
def test_decode_kernel_never_reads_outside_the_pool(device, page):
    """The Triton kernel called as the wrapper calls it on CUDA (no host check): page indices outside the
    pool (-1, past it, 1e8) and lengths past the table give NaN for the rows they touch; the other rows,
    and a bad entry past a row's length, change nothing."""
    _kernel_device(device)
    from fox_kernel.ops.triton.decode import decode

    g = torch.Generator().manual_seed(7)
    pool = torch.randperm(PAGES, generator=g).to(torch.int32).view(B, 4)
    kc = torch.randn(PAGES, page, HKV, D, generator=g)
    vc = torch.randn(PAGES, page, HKV, D, generator=g)
    cc = torch.cumsum(-torch.rand(PAGES, page, H, generator=g), dim=1)
    q = torch.randn(B, 2, H, D, generator=g)
    lens = torch.tensor([4 * page - 1, 2 * page + 1, page - 3], dtype=torch.int32)
    args = [x.to(device) for x in (q, kc, vc, cc)]
    table, lens = pool.to(device), lens.to(device)
    good = decode(*args, lens, None, D**-0.5, table)
    assert torch.isfinite(good).all()
    # (b, j) of the bad entry, and the (row, new token) pairs that see a key in that page or sit in it:
    # row 1's page 2 holds only its last token, which its first new token does not see; (2, 1) lies past
    # row 2's length
    for bad in (-1, PAGES, 10**8):
        for b, j, hit in ((1, 1, [(1, 0), (1, 1)]), (1, 2, [(1, 1)]), (0, 0, [(0, 0), (0, 1)]), (2, 1, [])):
            bad_table = table.clone()
            bad_table[b, j] = bad
            out = decode(*args, lens, None, D**-0.5, bad_table)
            nan = torch.zeros(B, 2, dtype=torch.bool, device=device)
            for r, i in hit:
                nan[r, i] = True
            assert out[nan].isnan().all(), (bad, b, j)
            torch.testing.assert_close(out[~nan], good[~nan], rtol=0, atol=0)
    too_long = lens.clone()
    too_long[2] = 4 * page + 5
    out = decode(*args, too_long, None, D**-0.5, table)
    assert out[2].isnan().all()
    torch.testing.assert_close(out[:2], good[:2], rtol=0, atol=0)
    # negative starts are those of 0; a length below the new tokens leaves rows before position 0 at 0
    short = torch.tensor([4 * page - 1, 1, page - 3], dtype=torch.int32, device=device)
    out = decode(*args, short, torch.tensor([-7, 0, -1], dtype=torch.int32, device=device), D**-0.5, table)
    torch.testing.assert_close(out[[0, 2]], good[[0, 2]], rtol=0, atol=0)
    assert out[1, 0].abs().max() == 0 and torch.isfinite(out[1, 1]).all()


@pytest.mark.parametrize("device", _KERNEL_DEVICES)
def test_decode_kernel_flags_bad_pages_with_pruning(device):
    """A page outside the pool is never skipped by the pruning scan (its prefix sums are not trusted)."""
    _kernel_device(device)
    from fox_kernel.ops.triton.decode import decode

    g = torch.Generator().manual_seed(8)
    table = torch.arange(PAGES, dtype=torch.int32).view(B, 4).to(device)
    kc = torch.randn(PAGES, PAGE, HKV, D, generator=g).to(device)
    vc = torch.randn(PAGES, PAGE, HKV, D, generator=g).to(device)
    # fast decay: in the interpreter (tiles of 16 keys) the first tile would be pruned by what page 1 holds
    cc = torch.cumsum(torch.full((B, 4 * PAGE, H), -3.0), dim=1).view(PAGES, PAGE, H).to(device)
    q = torch.randn(B, 1, H, D, generator=g).to(device)
    lens = torch.full((B,), 4 * PAGE, dtype=torch.int32, device=device)
    threshold = torch.full((B, H), -4.0, device=device)
    good = decode(q, kc, vc, cc, lens, None, D**-0.5, table, threshold)
    bad_table = table.clone()
    bad_table[0, 1] = -1
    out = decode(q, kc, vc, cc, lens, None, D**-0.5, bad_table, threshold)
    assert out[0].isnan().all()
    torch.testing.assert_close(out[1:], good[1:], rtol=0, atol=0)


@pytest.mark.interpret
def test_bad_inputs_in_the_interpreter():
    if INTERPRET:
        pytest.skip("already inside the interpreted run")
    pytest.importorskip("numpy")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)), "-k", "kernel"],
        env=env, capture_output=True, text=True, timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
