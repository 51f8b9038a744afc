"""Helpers for testing kernels against the float64 reference (used by this and downstream packages)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def max_abs_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item()


def assert_close_to_reference(actual, exact, same_precision, *, name="output", factor=2.0, rtol_floor=2e-6):
    """Pass if ``actual`` is no further from ``exact`` (float64) than ``factor`` times a same-precision
    PyTorch computation is, plus a small floor relative to the size of the result (at least 1, as the
    inputs are O(1)): for float32 both errors sit at rounding level."""
    if actual.shape != exact.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(exact.shape)}")
    if not torch.isfinite(actual).all():
        raise AssertionError(f"{name}: non-finite values")
    err = max_abs_err(actual, exact)
    base = max_abs_err(same_precision, exact)
    bound = factor * base + rtol_floor * max(exact.abs().max().item(), 1.0)
    if err > bound:
        raise AssertionError(f"{name}: max error {err:.3e} > bound {bound:.3e} (same-precision torch error {base:.3e})")


def random_log_fgate(shape, *, speed="fast", device="cpu", generator=None) -> torch.Tensor:
    """Random float32 log forget gates. ``fast``: logsigmoid(N(0,1) + 1), mean log f about -0.35;
    ``slow``: logsigmoid(N(0,1) + 6), mean about -0.003 (long memory)."""
    shift = {"fast": 1.0, "slow": 6.0, "bench": 4.0}[speed]
    logits = torch.randn(shape, device=device, generator=generator) + shift
    return F.logsigmoid(logits).float()
