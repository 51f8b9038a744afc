"""Fused Triton kernels of the FoX layer (GPU, or CPU with TRITON_INTERPRET=1), each with a PyTorch twin."""

from __future__ import annotations

import contextlib

import torch

from fox_kernel import next_power_of_2, runs_triton


def use_triton(x: torch.Tensor) -> bool:
    """Fused kernels in eager mode where the attention's Triton kernels run (``runs_triton``: CUDA, or the
    interpreter). Under torch.compile the PyTorch twins run: inductor fuses them itself, and an opaque
    autograd.Function would break the graph (measured slower)."""
    if torch.compiler.is_compiling():
        return False
    return runs_triton(x)


def owned(t: torch.Tensor) -> torch.Tensor:
    """t, copied if it is a view into a larger buffer (a Python-level check of its metadata, no device sync).
    A kept slice of a fused matmul's output would keep the whole output alive."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def row_view(t: torch.Tensor, own: bool = False) -> torch.Tensor:
    """t (..., C) as rows (N, C) with unit column stride, the kernels' layout: a view where t's layout allows
    (a slice of the last axis of a contiguous tensor has it), else a contiguous copy. ``own``: also copy a
    view into a larger buffer (``owned``), for a tensor that is kept."""
    C = t.shape[-1]
    rows = None
    if t.stride(-1) == 1 or C == 1:
        with contextlib.suppress(RuntimeError):  # leading axes that do not merge into one stride
            rows = t.view(-1, C)
    if rows is None:
        return t.reshape(-1, C).contiguous()
    return owned(rows) if own else rows


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether a call must go through its autograd.Function: grad mode is on and an input requires grad.
    Otherwise (a prefill under no_grad) the kernels are launched directly."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def row_tiles(width: int) -> tuple[int, int]:
    """(rows, columns) of a row-wise kernel's tile for rows ``width`` wide: the columns the next power of 2
    (at least 16), as many rows as make about 4k elements (at most 64)."""
    block_d = max(16, next_power_of_2(width))
    return max(1, min(64, 4096 // block_d)), block_d
