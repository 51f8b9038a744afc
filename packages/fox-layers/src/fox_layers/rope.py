"""Rotary position embedding, non-interleaved (rotate halves)."""

from __future__ import annotations

import torch

from fox_layers.checks import require_positive


def rope_inv_freq(head_dim: int, base: float, device=None) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """x: (B, T, H, D); positions: (B, T) integer positions ((1, T): the same for
    every row). Computed in at least float32."""
    require_positive("base", base)
    if x.dim() != 4 or x.shape[-1] % 2:  # a 3-D x would broadcast against the (B, T, 1, D) angles into 4 dims
        raise ValueError(f"x must be (B, T, H, D) with D even (pairs are rotated), got {tuple(x.shape)}")
    # a (1, T) positions broadcasts over the batch
    if (positions.dim() != 2 or positions.shape[1] != x.shape[1]
            or (positions.shape[0] != x.shape[0] and positions.shape[0] != 1)):
        raise ValueError(f"positions must be (B, T) = {tuple(x.shape[:2])} for x {tuple(x.shape)}, "
                         f"got {tuple(positions.shape)}")
    D = x.shape[-1]
    inv = rope_inv_freq(D, base, x.device)
    acc = torch.promote_types(x.dtype, torch.float32)
    angles = (positions.double()[..., None] * inv).to(acc)  # (B, T, D/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, :, None]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, :, None]
    xf = x.to(acc)
    half = D // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
