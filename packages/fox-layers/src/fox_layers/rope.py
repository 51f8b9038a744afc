"""Rotary position embedding, non-interleaved (rotate halves)."""

from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, base: float, device=None) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """x: (B, T, H, D); positions: (B, T) integer positions. Computed in at least float32."""
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
