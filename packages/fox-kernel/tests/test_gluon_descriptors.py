"""The Gluon launchers' kept TMA descriptors (``ops/gluon/host._descriptor``), on the CPU: a kept descriptor
is the one a fresh build gives (same fields, same specialisation key), is found again only for a tensor of
the same address, device, shape, strides, dtype and tile, and holds no tensor alive. The launches themselves
are covered on a GPU by test_gluon.py and every other Gluon test."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch


@pytest.fixture
def host(gluon_host):
    return gluon_host


def _spec(desc):
    """Triton's specialisation of a descriptor argument (what picks the compiled kernel)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    return native_specialize_impl(make_backend(GPUTarget("cuda", 90, 32)), desc, False, True, True)


def _fields(desc):
    return (desc.base.data_ptr(), desc.base.dtype, list(desc.shape), list(desc.strides), list(desc.block_shape),
            repr(desc.layout), desc.padding)


@pytest.mark.parametrize("shape, dtype, rows", [((2, 37, 3, 64), torch.bfloat16, 64),
                                                ((1, 130, 5, 128), torch.float16, 128)])
def test_a_kept_descriptor_is_a_fresh_ones_twin_and_holds_no_tensor(host, shape, dtype, rows):
    x = torch.randn(shape).to(dtype)
    fresh = host._new_descriptor(x, rows)
    kept = host._descriptor(x, rows)
    assert fresh.base is x and kept.base is not x
    assert _fields(kept) == _fields(fresh)
    assert _spec(kept) == _spec(fresh)
    assert host._descriptor(x, rows) is kept
    alive = weakref.ref(x)
    del x, fresh
    gc.collect()
    assert alive() is None  # the table keeps the address, not the tensor


def test_another_address_layout_or_tile_builds_another(host):
    g = torch.Generator().manual_seed(0)
    buffer = torch.randn(2, 40, 4, 64, generator=g).to(torch.bfloat16)
    kept = host._descriptor(buffer, 64)
    others = [
        host._descriptor(buffer[1:], 64),  # another address (and batch)
        host._descriptor(buffer[:1], 64),  # same address and strides, one batch: another shape
        host._descriptor(buffer, 128),  # another tile
        host._descriptor(buffer.view(2, 40, 2, 128), 64),  # same bytes read as another head dim
        host._descriptor(buffer.float(), 64),  # another dtype (and address)
    ]
    assert all(d is not kept for d in others)
    assert len({id(d) for d in others}) == len(others) and len(host._DESCRIPTORS) == 6
    for d, x in zip(others, (buffer[1:], buffer[:1], buffer, buffer.view(2, 40, 2, 128), None)):
        if x is not None:
            assert _fields(d) == _fields(host._new_descriptor(x, d.block_shape[0]))


def test_a_strided_copy_is_held_by_its_descriptor_and_not_kept(host):
    """Heads not adjacent in memory: the launcher reads a contiguous copy, which only its descriptor
    holds until the launch, so that descriptor keeps it and is not put in the table."""
    x = torch.randn(2, 33, 64, 3).to(torch.bfloat16).transpose(2, 3)  # (B, T, H=3, D=64), D not innermost
    desc = host._descriptor(x, 64)
    assert isinstance(desc.base, torch.Tensor) and desc.base.is_contiguous()
    assert torch.equal(desc.base, x) and host._DESCRIPTORS == {}


def test_the_table_is_emptied_when_full_and_can_be_switched_off(host, monkeypatch):
    monkeypatch.setattr(host, "_MAX_DESCRIPTORS", 3)
    xs = [torch.randn(1, 16, 1, 64).to(torch.bfloat16) for _ in range(4)]
    for x in xs[:3]:
        host._descriptor(x, 64)
    assert len(host._DESCRIPTORS) == 3
    host._descriptor(xs[3], 64)
    assert len(host._DESCRIPTORS) == 1
    monkeypatch.setattr(host, "CACHED_DESCRIPTORS", False)
    fresh = host._descriptor(xs[3], 64)
    assert fresh.base is xs[3] and len(host._DESCRIPTORS) == 1
