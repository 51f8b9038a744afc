"""RMSNorm and per-head (group) RMSNorm, computed in (at least) float32 and cast back."""

from __future__ import annotations

import torch
from torch import nn

from fox_layers.checks import require_int, require_positive


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS-normalise the last axis of x in at least float32; multiply by weight; return in x's dtype. With a
    weight this is one fused kernel on CUDA in eager mode (``norm_gate`` with one group and no gate)."""
    if weight is not None:
        from fox_layers.kernels.norm_gate import norm_gate

        return norm_gate(x, weight, None, 1, eps)
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learned (hidden_size,) weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, elementwise_affine: bool = True):
        super().__init__()
        require_int("hidden_size", hidden_size)
        require_positive("eps", eps)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GroupRMSNorm(nn.Module):
    """RMSNorm per group (head) of the last axis: x (..., G * Dg) is normalised over each Dg.

    The weight is (G * Dg,) (one scale per channel) or, with ``share_across_groups``, (Dg,) shared by
    every group (the layout of the released FoX checkpoints' QK-norm).
    """

    def __init__(self, num_groups: int, hidden_size: int, eps: float = 1e-6, share_across_groups: bool = False):
        super().__init__()
        require_int("num_groups", num_groups)
        require_int("hidden_size", hidden_size)
        require_positive("eps", eps)
        if hidden_size % num_groups != 0:
            raise ValueError(f"hidden_size {hidden_size} must be a multiple of num_groups {num_groups}")
        self.num_groups = num_groups
        self.group_size = hidden_size // num_groups
        self.eps = eps
        self.share_across_groups = share_across_groups
        self.weight = nn.Parameter(torch.ones(self.group_size if share_across_groups else hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None, act: str = "sigmoid") -> torch.Tensor:
        """Normalise x (..., G * Dg) per group; with ``gate``, also multiply by act(gate) in the same pass."""
        from fox_layers.kernels.norm_gate import norm_gate

        return norm_gate(x, self.weight, gate, self.num_groups, self.eps, act)

    def max_abs_weight(self) -> torch.Tensor:
        """max |w| per group, shape (num_groups,): bounds the norm of a normalised group."""
        w = self.weight.detach().float().abs()
        if self.share_across_groups:
            return w.max().expand(self.num_groups)
        return w.view(self.num_groups, self.group_size).amax(-1)
