"""SwiGLU MLP with the fused (gate, up) projection of the FoX checkpoints."""

from __future__ import annotations

import math

import torch
from torch import nn

from fox_layers.checks import require_int, require_positive


def intermediate_size_for(hidden_size: int, hidden_ratio: float) -> int:
    """FoX rule: I = 256 * ceil(int(hidden * ratio * 2 / 3) / 256)."""
    return 256 * math.ceil(int(hidden_size * hidden_ratio * 2 / 3) / 256)


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate) * up) with ``gate_proj: Linear(hidden, 2 I)`` split as (gate, up)."""

    def __init__(self, hidden_size: int, hidden_ratio: float = 4.0, intermediate_size: int | None = None):
        super().__init__()
        require_int("hidden_size", hidden_size)
        require_int("intermediate_size", intermediate_size, optional=True)
        require_positive("hidden_ratio", hidden_ratio, optional=intermediate_size is not None)
        self.intermediate_size = intermediate_size or intermediate_size_for(hidden_size, hidden_ratio)
        if self.intermediate_size < 1:  # rounds to a multiple of 256: a small ratio can give none
            raise ValueError(f"hidden_ratio {hidden_ratio} gives an MLP of width 0 for hidden_size {hidden_size}; "
                             "use a larger one or pass intermediate_size")
        self.gate_proj = nn.Linear(hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fox_layers.kernels.swiglu import swiglu

        return self.down_proj(swiglu(self.gate_proj(x)))
