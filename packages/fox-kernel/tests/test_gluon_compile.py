"""The Gluon kernels compile for Hopper (sm90) with the installed Triton, on a machine without a GPU.

Gluon's API moves between Triton releases (3.7 dropped ``thread_barrier`` for ``barrier``, 3.8 added
``tma.async_load``, 3.9 removed ``async_copy_global_to_shared``), and a kernel that no longer compiles fails
only on a Hopper GPU, at the first call. Here the launchers of ``fox_kernel.ops.gluon.host`` run as the
dispatcher calls them, with every launch replaced by Triton's compile-only ``warmup`` for an sm90 target: the
forward (fixed softmax bound and online), the two-pass backward and the one-pass backward where it exists,
at both head dims, with and without a sliding window, and the Triton kernels launched beside them. Each compiled kernel must fit in an H100's
shared memory per block. The numbers they compute are checked on a GPU (``test_gluon.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fox_kernel.ops import gluon
from fox_kernel.ops.triton import launch

pytestmark = pytest.mark.skipif(launch.INTERPRET or not gluon.available(),
                                reason="needs Triton's Gluon, not the interpreter")

SHARED_PER_BLOCK = 232448  # bytes an H100/H200 block may use (227 KiB)


@pytest.fixture
def compiled(monkeypatch, benchmark_script):
    """(kernel name, head dim of the call, shared bytes) of every kernel a launch compiled for sm90 (the
    driver of ``benchmarks/ptx_trees_ab.py``, which compiles the same way)."""
    from triton.runtime import driver

    kernels = []

    def compile_only(kernel, grid, *args, **kwargs):  # as launch.run, with its options, but no launch
        compiled_kernel = kernel.run(*args, grid=grid, warmup=True, **{**launch.LAUNCH_OPTIONS, **kwargs})
        assert compiled_kernel.metadata.enable_fp_fusion
        kernels.append((kernel.fn.__name__, kwargs.get("HEAD_D"), compiled_kernel.metadata.shared))

    previous = driver._active
    driver.set_active(benchmark_script("ptx_trees_ab").Sm90Driver())
    monkeypatch.setattr(launch, "run", compile_only)
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)  # an H100's or H200's
    try:
        yield kernels
    finally:
        driver._active = previous


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("D", [64, 128])
def test_every_gluon_kernel_compiles_for_sm90(compiled, D, window):
    from fox_kernel.ops.call import AttentionCall
    from fox_kernel.ops.gluon import host
    from fox_kernel.ops.gluon.tiles import GLUON_ONE_PASS_DIMS
    from fox_kernel.options import KernelOptions

    g = torch.Generator().manual_seed(D)
    B, T, H, Hkv = 1, 1000, 4, 2  # a partial last block and GQA
    q = torch.randn(B, T, H, D, generator=g).bfloat16()
    k, v = (torch.randn(B, T, Hkv, D, generator=g).bfloat16() for _ in range(2))
    log_fgate = F.logsigmoid(torch.randn(B, T, H, generator=g) + 4)
    call = AttentionCall(D**-0.5, window=window, options=KernelOptions(), zero_gates=False)
    for fixed in (True, False):
        out, lse, _, (c, _, _) = host.forward(q, k, v, log_fgate, call, fixed)
    one_pass_modes = (False, True) if D in GLUON_ONE_PASS_DIMS else (False,)
    for one_pass in one_pass_modes:
        host.backward(torch.randn(q.shape, generator=g).bfloat16(), q, k, v, c, lse, out, call, one_pass)

    gluon_kernels = [(name, d) for name, d, _ in compiled if name.startswith("gluon_")]
    assert gluon_kernels == ([("gluon_fwd_kernel", D)] * 2 + [("gluon_dkdv_kernel", D), ("gluon_dq_kernel", D)]
                             + [("gluon_dkdv_kernel", D)] * (len(one_pass_modes) - 1))
    assert {"_forward_sums_kernel", "_backward_prologue_kernel"} <= {name for name, _, _ in compiled}
    too_large = [(name, shared) for name, _, shared in compiled if shared > SHARED_PER_BLOCK]
    assert not too_large, f"kernels past an H100's shared memory per block: {too_large}"


def test_triton_before_3_6_keeps_the_triton_kernels(monkeypatch):
    """Triton 3.5's Gluon imports our kernels but cannot compile them (another ``warp_specialize``): below
    MIN_TRITON ``available()`` says no, so the dispatcher never picks them."""
    import triton

    assert gluon.available()
    try:  # the answer is kept after the first question: asked afresh for each version set here
        monkeypatch.setattr(triton, "__version__", "3.5.1")
        gluon._usable.cache_clear()
        assert gluon.triton_version() == (3, 5) and not gluon.available()
        monkeypatch.setattr(triton, "__version__", "3.10.0+git1234")
        gluon._usable.cache_clear()
        assert gluon.triton_version() == (3, 10) and gluon.available()
    finally:
        monkeypatch.undo()
        gluon._usable.cache_clear()


def _failing(error):
    def launcher(*args):
        raise error
    return launcher


def test_a_gluon_kernel_that_fails_to_compile_hands_over_to_the_triton_kernels(monkeypatch):
    """A Gluon compile error (a Triton whose Gluon moved on) turns the Gluon kernels off for the process
    with one warning, and the call takes the Triton kernels; any other error from a Gluon launch is raised.
    The Triton forward is stood in for by the chunked PyTorch forward (no GPU here), so the test checks
    the hand-over, not the kernels."""
    import ast

    from triton.compiler.errors import CompilationError

    from fox_kernel.ops import dispatch
    from fox_kernel.ops.call import AttentionCall
    from fox_kernel.ops.chunked import chunked_forward
    from fox_kernel.ops.gluon import host
    from fox_kernel.ops.triton import fwd
    from fox_kernel.options import KernelOptions

    monkeypatch.setattr(gluon, "_failure", None)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 37, 2, 16, generator=g) for _ in range(3))
    log_fgate = F.logsigmoid(torch.randn(1, 37, 2, generator=g) + 2)
    call = AttentionCall(16**-0.5, options=KernelOptions(), zero_gates=False)
    expected, _ = chunked_forward(q, k, v, log_fgate, call)
    monkeypatch.setattr(dispatch, "forward_backend", lambda q, k, call: dispatch.Backend.GLUON)
    monkeypatch.setattr(dispatch, "_prefix_sums", lambda log_fgate, call: (None, None, None))
    monkeypatch.setattr(fwd, "forward", lambda q, k, v, c, call, fixed: (*chunked_forward(q, k, v, log_fgate, call), None))

    monkeypatch.setattr(host, "forward", _failing(ValueError("a bad launch")))
    with pytest.raises(ValueError, match="a bad launch"):
        dispatch.forward(q, k, v, log_fgate, call)
    assert gluon.available()

    broken = CompilationError("gl.thread_barrier()", ast.parse("gl.thread_barrier()").body[0],
                              "module 'triton.experimental.gluon.language' has no attribute 'thread_barrier'")
    monkeypatch.setattr(host, "forward", _failing(broken))
    with pytest.warns(RuntimeWarning, match="failed to compile.*thread_barrier.*Triton kernels"):
        out, lse, threshold = dispatch.forward(q, k, v, log_fgate, call)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not gluon.available()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is given once
        dispatch.forward(q, k, v, log_fgate, call)
