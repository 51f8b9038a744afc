"""Fused Triton kernels of the FoX layer (GPU, or CPU with TRITON_INTERPRET=1), each with a PyTorch twin."""

from __future__ import annotations

import torch

from fox_kernel.ops.dispatch import runs_triton


def use_triton(x: torch.Tensor) -> bool:
    """Fused kernels in eager mode where the attention's Triton kernels run (``runs_triton``: CUDA, or the
    interpreter). Under torch.compile the PyTorch twins run: inductor fuses them itself, and an opaque
    autograd.Function would break the graph (measured slower)."""
    if torch.compiler.is_compiling():
        return False
    return runs_triton(x)
