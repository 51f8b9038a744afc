"""The Gluon kernels compile for Hopper (sm90) with the installed Triton, on a machine without a GPU.

Gluon's API moves between Triton releases (3.7 dropped ``thread_barrier`` for ``barrier``, 3.8 added
``tma.async_load``, 3.9 removed ``async_copy_global_to_shared``), and a kernel that no longer compiles fails
only on a Hopper GPU, at the first call. Here the launchers of ``fox_kernel.ops.gluon.host`` run as the
dispatcher calls them, with every launch replaced by Triton's compile-only ``warmup`` for an sm90 target: the
forward (fixed softmax bound and online), the two-pass backward and the one-pass backward where it exists,
at both head dims, and the Triton kernels launched beside them. Each compiled kernel must fit in an H100's
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


class _Sm90Driver:
    """The driver Triton's JIT asks for the device, stream and target: an sm90 GPU that is never launched on."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


@pytest.fixture
def compiled(monkeypatch):
    """(kernel name, head dim of the call, shared bytes) of every kernel a launch compiled for sm90."""
    from triton.runtime import driver

    kernels = []

    def compile_only(kernel, grid, *args, **kwargs):
        compiled_kernel = kernel.run(*args, grid=grid, warmup=True, **kwargs)
        kernels.append((kernel.fn.__name__, kwargs.get("HEAD_D"), compiled_kernel.metadata.shared))

    previous = driver._active
    driver.set_active(_Sm90Driver())
    monkeypatch.setattr(launch, "run", compile_only)
    try:
        yield kernels
    finally:
        driver._active = previous


@pytest.mark.parametrize("D", [64, 128])
def test_every_gluon_kernel_compiles_for_sm90(compiled, D):
    from fox_kernel.ops.call import AttentionCall
    from fox_kernel.ops.gluon import host
    from fox_kernel.ops.gluon.tiles import GLUON_ONE_PASS_DIMS
    from fox_kernel.options import KernelOptions

    g = torch.Generator().manual_seed(D)
    B, T, H, Hkv = 1, 1000, 4, 2  # a partial last block and GQA
    q = torch.randn(B, T, H, D, generator=g).bfloat16()
    k, v = (torch.randn(B, T, Hkv, D, generator=g).bfloat16() for _ in range(2))
    log_fgate = F.logsigmoid(torch.randn(B, T, H, generator=g) + 4)
    call = AttentionCall(D**-0.5, options=KernelOptions(), zero_gates=False)
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
