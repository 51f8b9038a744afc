"""Argument checks at the public boundary: every error names the argument, what was expected and what came."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def require_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def require_rank(name: str, x: torch.Tensor, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape {tuple(x.shape)}")


def require_same_device(device: torch.device, **tensors) -> None:
    for name, x in tensors.items():
        if x is not None and x.device != device:
            raise ValueError(f"{name} must be on {device} like q, got {x.device}")


def require_qkv_dtype(q, k, v) -> None:
    allowed = FLOAT_DTYPES if q.is_cuda else (*FLOAT_DTYPES, torch.float64)
    if q.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"q must be one of {names} on {q.device.type}, got {str(q.dtype).replace('torch.', '')}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")


def require_dim(name: str, actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{name} must have {what} {expected}, got {actual}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, total: int, value_checks: bool) -> None:
    require_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along time), got {batch}")
    if value_checks:
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"cu_seqlens must start at 0 and end at the packed length {total}, got {bounds[0]}..{bounds[-1]}")
        if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
            raise ValueError(f"cu_seqlens must be strictly increasing, got {bounds}")


def check_seq_start(seq_start: torch.Tensor, batch: int, t_k: int, value_checks: bool) -> None:
    require_tensor("seq_start", seq_start)
    if seq_start.dtype.is_floating_point or seq_start.dtype == torch.bool:
        raise TypeError(f"seq_start must hold integers, got {seq_start.dtype}")
    if tuple(seq_start.shape) != (batch,):
        raise ValueError(f"seq_start must have shape ({batch},), got {tuple(seq_start.shape)}")
    if value_checks and batch > 0:
        lo, hi = int(seq_start.min()), int(seq_start.max())
        if lo < 0 or hi > t_k:
            raise ValueError(f"seq_start must lie in [0, {t_k}] (the key length), got values in [{lo}, {hi}]")
