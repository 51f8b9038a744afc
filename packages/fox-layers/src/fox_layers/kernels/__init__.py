"""Fused Triton kernels of the FoX layer (GPU, or CPU with TRITON_INTERPRET=1), each with a PyTorch twin."""

from __future__ import annotations

import os

import torch


def use_triton(x: torch.Tensor) -> bool:
    """Fused kernels in eager mode on CUDA (or the interpreter). Under torch.compile the PyTorch twins run:
    inductor fuses them itself, and an opaque autograd.Function would break the graph (measured slower)."""
    if torch.compiler.is_compiling():
        return False
    return x.is_cuda or (os.environ.get("TRITON_INTERPRET") == "1" and x.dtype != torch.float64)
