"""The Gluon backward's one-launch prologue against the four launches it replaces and plain PyTorch."""

import math

import pytest
import torch
import torch.nn.functional as F
import triton

from fox_kernel.options import INTERPRET


@pytest.mark.parametrize("B, Tq, Tk, H, D, cl_seg, with_queries", [
    (2, 37, 53, 3, 16, 16, True),     # queries shorter than keys, partial blocks everywhere
    (1, 100, 100, 2, 32, None, False),  # the one-pass backward: no dQ pass's sums or table
    (1, 20, 90, 2, 16, 32, True),     # dQ tiles of other widths than the dK/dV pass's
    (8, 16, 16, 5, 16, 16, True),     # more (row, head) pairs than blocks: they take grid axis 0
])
@pytest.mark.parametrize("pruned", [True, False], ids=["pruned", "exact"])
def test_backward_prologue_equals_the_separate_launches(device_dtype, B, Tq, Tk, H, D, cl_seg, with_queries, pruned):
    device, dtype = device_dtype
    if device.type == "cpu" and not INTERPRET:
        pytest.skip("Triton kernels: CUDA or the interpreter")
    from fox_kernel.ops.triton import prologue, ranges, sums

    g = torch.Generator().manual_seed(B * Tq + Tk)
    out, do = (torch.randn(B, Tq, H, D, generator=g).to(device, dtype) for _ in range(2))
    lf = F.logsigmoid(torch.randn(B, Tk, H, generator=g) + 1.0).to(device)
    c = sums.prefix_sums(lf, None)
    threshold = torch.full((B, H), -3.0, device=device) - torch.rand(B, H, generator=g).to(device) if pruned else None
    key_blocks = dict(BLOCK_M=16, BLOCK_N=32)
    query_blocks = dict(BLOCK_M=32, BLOCK_N=cl_seg) if with_queries else None
    origin = (Tk - Tq) % 16
    got = prologue.backward_prologue(out, do, c, threshold, Tk, 16, origin, cl_seg, key_blocks, query_blocks)
    want = (sums.delta(out, do), sums.local_sums(c, None, B, Tk, 16, origin),
            None if cl_seg is None else sums.local_sums(c, None, B, Tk, cl_seg),
            *ranges.kept_ranges_pair(c, None, None, threshold, B, H, Tq, Tk, Tk, key_blocks, query_blocks))
    names = ("delta", "clq", "cl", "key ranges", "query ranges")
    for name, a, b in zip(names, got, want):
        assert (a is None) == (b is None), name
        if name == "query ranges" and a is not None:  # columns past the last query block are never written
            a, b = a[:, :triton.cdiv(Tq, 32)], b[:, :triton.cdiv(Tq, 32)]
        if a is not None:
            assert torch.equal(a, b), name
    # and against plain PyTorch: the row dots, and the local sums from each tile's first position
    row_dots = (out.double() * do.double()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(got[0].double(), row_dots, rtol=1e-4, atol=1e-4)
    pos = torch.arange(Tk, device=device)
    tile_start = torch.where(pos < origin, 0, origin + (pos - origin) // 16 * 16)
    local = (c - c[..., tile_start]) * (1 / math.log(2))
    torch.testing.assert_close(got[1].double(), local, rtol=1e-6, atol=1e-5)
    if pruned:  # the tables hold real block ends: at least one key block keeps fewer than all its queries
        assert got[3].min().item() >= 0 and got[3].max().item() <= Tq


@pytest.mark.parametrize("B, Tq, Tk, H, Hkv, D", [
    (2, 37, 53, 4, 2, 16),
    (1, 90, 90, 3, 3, 32),
    (9, 20, 20, 6, 3, 16),  # more (row, head) pairs than blocks: they take grid axis 0
])
@pytest.mark.parametrize("norms", ["q and k", "k", "none"])
@pytest.mark.parametrize("zeros", [True, False], ids=["zero gates", "no zero gates"])
def test_forward_prologue_equals_the_separate_launches(device_dtype, B, Tq, Tk, H, Hkv, D, norms, zeros):
    """forward_sums (prefix sums with the q/k norms' partial maxima) and forward_tables (the "auto" bound,
    kept ranges, local sums and the largest key norms) equal the launches they replace bit for bit, and the prefix sums, local
    sums and norms plain PyTorch."""
    device, dtype = device_dtype
    if device.type == "cpu" and not INTERPRET:
        pytest.skip("Triton kernels: CUDA or the interpreter")
    from fox_kernel.ops.triton import norms as norm_kernels
    from fox_kernel.ops.triton import prologue, ranges, sums
    from fox_kernel.pruning import auto_threshold, bound

    g = torch.Generator().manual_seed(7 * Tk + H)
    q = torch.randn(B, Tq, H, D, generator=g).to(device, dtype)
    k = (torch.randn(B, Tk, Hkv, D, generator=g) * 1.3).to(device, dtype)
    lf = F.logsigmoid(torch.randn(B, Tk, H, generator=g) + 1.0)
    if zeros:  # a gate of exactly 0 (calls promising none have none)
        lf[0, Tk // 3, 1] = float("-inf")
    lf = lf.to(device)
    tensors = {"q and k": (q, k), "k": (k,), "none": ()}[norms]
    counter = torch.tensor([12345], dtype=torch.int32, device=device)  # the launch sets it to 0
    c, z, seen, nx, ny = prologue.forward_sums(lf, zeros, *tensors, counter=counter)
    assert counter.item() == 0
    want = sums.prefix_sums(lf, None, zeros=zeros)
    want_c, want_z, want_seen = want if zeros else (want, None, None)
    assert torch.equal(c, want_c) and (z is None) == (seen is None) == (not zeros)
    if zeros:  # both kernels report the gate of 0
        assert torch.equal(z, want_z)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert not seen.clean() and not want_seen.clean() and seen.flag.item() == want_seen.flag.item() == -1
    summed = torch.where(torch.isneginf(lf), 0.0, lf).double()  # a gate of 0 adds 0
    torch.testing.assert_close(c, torch.cumsum(summed, dim=1).transpose(1, 2), rtol=1e-12, atol=1e-12)
    if norms == "q and k":
        wq, wk = norm_kernels.max_sq_row_norms(q, k)
        assert torch.equal(nx.amax(-1), wq) and torch.equal(ny.amax(-1), wk)
        torch.testing.assert_close(nx.amax(-1).double(), (q.double() ** 2).sum(-1).amax(1), rtol=1e-5, atol=1e-4)
    elif norms == "k":
        assert torch.equal(nx.amax(-1), norm_kernels.max_sq_row_norms(k)) and ny is None
    else:
        assert nx is None and ny is None

    blocks = dict(BLOCK_M=32, BLOCK_N=16)
    scale = D**-0.5
    if norms == "q and k":  # the "auto" bound from the norms, written out for the backward
        threshold, table, cl, kmax2 = prologue.forward_tables(c, None, nx, ny, scale, bound(0.0, Tk, -10.0), Tq,
                                                              blocks)
        want_threshold = auto_threshold(q, k, scale, Tk, -10.0)
        assert torch.equal(threshold, want_threshold)
    else:  # a given bound (one that prunes here), or none
        given = torch.full((B, H), -2.5, device=device) if norms == "k" else None
        threshold, table, cl, kmax2 = prologue.forward_tables(c, given, None, nx, scale, None, Tq, blocks)
        want_threshold = given
        assert threshold is given
    want_table = ranges.kept_ranges(c, None, None, want_threshold, B, H, Tq, Tk, Tq, blocks, True)
    assert (table is None) == (want_table is None)
    if table is not None:
        assert torch.equal(table, want_table)
    assert torch.equal(cl, sums.local_sums(c, None, B, Tk, 16))
    if norms == "none":
        assert kmax2 is None
    else:  # the largest squared key norms, reduced once per (row, key/value head)
        assert torch.equal(kmax2, norm_kernels.max_sq_row_norms(k))
    tile_start = torch.arange(Tk, device=device) // 16 * 16
    torch.testing.assert_close(cl.double(), (c - c[..., tile_start]) / math.log(2), rtol=1e-6, atol=1e-5)


def test_norm_parts_past_their_count(device_dtype, monkeypatch):
    """Longer inputs than NORM_PARTS blocks of rows: each part takes every NORM_PARTS-th block, and the
    maxima stay max_sq_row_norms's (here with 3 parts over 11 blocks, and q and k of other lengths)."""
    device, dtype = device_dtype
    if device.type == "cpu" and not INTERPRET:
        pytest.skip("Triton kernels: CUDA or the interpreter")
    from fox_kernel.ops.triton import norms as norm_kernels
    from fox_kernel.ops.triton import prologue

    monkeypatch.setattr(norm_kernels, "NORM_PARTS", 3)
    g = torch.Generator().manual_seed(11)
    B, Tq, Tk, H, Hkv, D = 2, 150, 11 * norm_kernels.NORM_ROWS - 5, 2, 1, 16
    q = torch.randn(B, Tq, H, D, generator=g).to(device, dtype)
    k = torch.randn(B, Tk, Hkv, D, generator=g).to(device, dtype)
    k[1, 9 * norm_kernels.NORM_ROWS + 3, 0] *= 4  # the largest key norm in the tenth block of rows (part 0)
    lf = F.logsigmoid(torch.randn(B, Tk, H, generator=g)).to(device)
    *_, nx, ny = prologue.forward_sums(lf, False, q, k)
    assert nx.shape == (B, H, 3) and ny.shape == (B, Hkv, 3)
    wq, wk = norm_kernels.max_sq_row_norms(q, k)
    assert torch.equal(nx.amax(-1), wq) and torch.equal(ny.amax(-1), wk)
    assert torch.equal(ny[1, 0, 0], wk[1, 0])
