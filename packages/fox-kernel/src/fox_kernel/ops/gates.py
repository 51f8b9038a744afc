"""The gate gradient from dc, shared by the Triton path (packed batches) and the PyTorch path (no Triton
import)."""

from __future__ import annotations

import torch


def gate_grad_from_dc(dc: torch.Tensor, seq_start, cu_seqlens) -> torch.Tensor:
    """d log f_t = sum_{u >= t} dc_u within t's sequence, zero on padding. (B, H, T) -> (B, T, H)."""
    dc = dc.to(torch.float64)
    suffix = torch.flip(torch.cumsum(torch.flip(dc, dims=[-1]), dim=-1), dims=[-1])
    T = dc.shape[-1]
    if cu_seqlens is not None:
        # The packed suffix sum runs on into later sequences: take off what lies past each end.
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        ends = torch.repeat_interleave(cu_seqlens[1:].long(), lengths, output_size=T)
        padded = torch.cat([suffix, torch.zeros_like(suffix[..., :1])], dim=-1)
        suffix = suffix - padded[..., ends]
    if seq_start is not None:
        pos = torch.arange(T, device=dc.device)
        suffix = suffix * (pos[None, :] >= seq_start[:, None]).to(suffix.dtype)[:, None, :]
    return suffix.to(torch.float32).transpose(1, 2)
