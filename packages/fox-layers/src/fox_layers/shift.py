"""ShiftLinear: a linear projection followed by a data-dependent token shift (FoX (Pro)'s k/v shift).

    k~_t = W x_t,   a_t = sigmoid(w_a . x_t) (one scalar per head),   k_t = a_t k~_{t-1} + (1 - a_t) k~_t

The state carried between chunks (decoding, chunked prefill) is the last token's un-mixed k~.
"""

from __future__ import annotations

import torch
from torch import nn

from fox_layers.checks import require_int


def previous_tokens(
    x: torch.Tensor,
    state: torch.Tensor | None = None,
    seq_start: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    past: int = 0,
) -> torch.Tensor:
    """For each position, the value at the previous position of the same sequence (zero at its start).

    x: (B, T, C). state: (B, C), the value just before this chunk (from a cache). seq_start: (B,) first
    real position (in cache positions; ``past`` tokens are already cached); padded positions count as
    zero. cu_seqlens: packed sequences (B = 1), each starts from zero.
    """
    B, T, C = x.shape
    if seq_start is not None:
        pos = torch.arange(past, past + T, device=x.device)
        x = x * (pos[None, :] >= seq_start[:, None]).to(x.dtype)[..., None]
    first = torch.zeros(B, 1, C, dtype=x.dtype, device=x.device) if state is None else state[:, None].to(x.dtype)
    if state is not None and seq_start is not None:  # the carried token was itself padding
        first = first * (past - 1 >= seq_start).to(x.dtype)[:, None, None]
    prev = torch.cat([first, x[:, :-1]], dim=1)[:, :T]  # T = 0: no position, not the carried token
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1].long()
        starts = starts[starts < T]
        prev[:, starts] = 0
    return prev


class ShiftLinear(nn.Module):
    """Linear(input_dim, output_dim) with a data-dependent token shift per head.

    Parameters ``linear`` and ``shift_proj`` (num_heads, input_dim), as in the published checkpoints.
    """

    def __init__(self, input_dim: int, output_dim: int, num_heads: int, bias: bool = False):
        super().__init__()
        require_int("input_dim", input_dim)
        require_int("output_dim", output_dim)
        require_int("num_heads", num_heads)
        if output_dim % num_heads != 0:
            raise ValueError(f"output_dim {output_dim} must be a multiple of num_heads {num_heads}")
        self.num_heads = num_heads
        self.input_dim, self.output_dim = input_dim, output_dim
        self.linear = nn.Linear(input_dim, output_dim, bias=bias)
        self.shift_proj = nn.Linear(input_dim, num_heads, bias=False)

    def forward(self, x, state=None, seq_start=None, cu_seqlens=None, past: int = 0):
        """x: (B, T, input_dim) -> (out (B, T, output_dim), new state (B, output_dim))."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.input_dim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be (B, T, input_dim={self.input_dim}), got {got}")
        if state is not None and tuple(state.shape) != (x.shape[0], self.output_dim):
            raise ValueError(f"state must be (B, output_dim) = {(x.shape[0], self.output_dim)}, got {tuple(state.shape)}")
        return self.mix(self.linear(x), self.shift_proj(x), state, seq_start, cu_seqlens, past)

    def mix(self, cur, s, state=None, seq_start=None, cu_seqlens=None, past: int = 0):
        """The shift alone, from the projection ``cur`` (B, T, output_dim) and the shift logits ``s``
        (B, T, num_heads) (a layer that computes both in one fused matmul passes them here)."""
        from fox_layers.kernels import use_triton

        B, T, C = cur.shape
        if T == 0:  # an empty chunk mixes nothing and passes the carried token on (zeros: none yet)
            return cur, state if state is not None else cur.new_zeros(B, C)
        if use_triton(cur):
            from fox_layers.kernels.shift import shift_mix

            return shift_mix(cur, s, state, seq_start, cu_seqlens, past), cur[:, -1]
        acc = torch.promote_types(cur.dtype, torch.float32)
        alpha = torch.sigmoid(s.to(acc))[..., None]  # (B, T, H, 1)
        prev = previous_tokens(cur, state, seq_start, cu_seqlens, past)
        heads = lambda t: t.view(B, T, self.num_heads, C // self.num_heads).to(acc)
        out = (alpha * heads(prev) + (1 - alpha) * heads(cur)).to(cur.dtype).view(B, T, C)
        return out, cur[:, -1]
