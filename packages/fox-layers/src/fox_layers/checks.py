"""Argument checks of sizes and positive settings, shared by the layers and the model configs above them:
each error names the argument, what was expected and what came."""

from __future__ import annotations

import math


def require_int(name: str, value, low: int = 1, *, optional: bool = False) -> None:
    """``value`` is an int >= ``low`` (None allowed with ``optional``): a size, count or length."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        expected = f"an int >= {low}" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def require_positive(name: str, value, *, optional: bool = False) -> None:
    """``value`` is a finite number > 0 (None allowed with ``optional``): a ratio, an epsilon, a time."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        expected = "a finite number > 0" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def require_head_dim(hidden_size: int, num_heads: int, rope: bool) -> None:
    """``hidden_size / num_heads``, the head dim, is one the attention kernel takes (at most 256), and even
    with RoPE (which rotates pairs of channels); refused as ``hidden_size``'s (``hidden_size`` a multiple
    of ``num_heads``, checked before)."""
    head_dim = hidden_size // num_heads
    if head_dim > 256:
        raise ValueError(f"hidden_size / num_heads (the head dim) must be at most 256, got {hidden_size} / "
                         f"{num_heads} = {head_dim}")
    if rope and head_dim % 2:
        raise ValueError(f"hidden_size / num_heads (the head dim) must be even with RoPE, got {hidden_size} / "
                         f"{num_heads} = {head_dim}")
