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
