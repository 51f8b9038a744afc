"""Argument checks at the public boundary: every error names the argument, what was expected and what came.

Shape, dtype and device checks read only metadata and cost nothing. A check of a tensor's *values* must
read the tensor, which for a CUDA tensor waits for the GPU (a host sync): those run only where the caller
already syncs (``seq_start`` and ``cu_seqlens`` of ``forgetting_attention``, whose bounds the launch needs)
or on CPU tensors, never for CUDA tensors on the hot path, and never while ``torch.compile`` traces.
"""

from __future__ import annotations

import math
import numbers
from typing import NoReturn

import torch

from fox_kernel.options import KernelOptions

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DECODE_DTYPES = (*FLOAT_DTYPES, torch.float64)
"""The dtypes of queries and K/V caches of the decoding calls (float64 runs the PyTorch path on every device)."""


def require_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def require_rank(name: str, x: torch.Tensor, rank: int, layout: str) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape {tuple(x.shape)}")


def require_options(options) -> None:
    """``options`` is None or a ``fox_kernel.KernelOptions``."""
    if options is not None and not isinstance(options, KernelOptions):
        raise TypeError(f"options must be None or a fox_kernel.KernelOptions, got {type(options).__name__}")


def require_same_device(device: torch.device, **tensors) -> None:
    """Each of ``tensors`` that is not None is a tensor on ``device``."""
    for name, x in tensors.items():
        if x is not None:
            require_tensor(name, x)
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def require_float_dtype(name: str, x: torch.Tensor, allowed=DECODE_DTYPES) -> None:
    """``x`` holds floating-point numbers of one of ``allowed``: an integer cache or query would otherwise
    be cast silently (and an integer output truncated)."""
    if x.dtype not in allowed:
        names = ", ".join(_dtype_name(d) for d in allowed)
        raise TypeError(f"{name} must be one of {names}, got {_dtype_name(x.dtype)}")


def check_sm_scale(sm_scale) -> float:
    """The score scale as a float: a finite positive number (inf gives exact-zero rows, NaN NaN rows, and
    0 or less turns the attention uniform or inverted)."""
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real) or not math.isfinite(sm_scale) \
            or sm_scale <= 0:
        raise ValueError(f"sm_scale must be None or a finite positive number, got {sm_scale!r}")
    return float(sm_scale)


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


def check_heads(H: int, Hkv: int, D: int, kv: str) -> None:
    """A head dim in [1, 256] and ``H`` query heads a multiple of the ``Hkv`` heads of ``kv`` (its name)."""
    if not 1 <= D <= 256:
        raise ValueError(f"head dim must be in [1, 256], got {D}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q's {H} heads must be a multiple of {kv}'s heads, got Hkv={Hkv}")


def check_seq_start(seq_start: torch.Tensor, batch: int, t_k: int | None, value_checks: bool) -> None:
    """Integers (batch,) in [0, t_k]; t_k None: no upper bound (a decoding cache whose rows are all padding
    so far, in a chunked prefill of left-padded prompts)."""
    require_tensor("seq_start", seq_start)
    if seq_start.dtype.is_floating_point or seq_start.dtype == torch.bool:
        raise TypeError(f"seq_start must hold integers, got {seq_start.dtype}")
    if tuple(seq_start.shape) != (batch,):
        raise ValueError(f"seq_start must have shape ({batch},), got {tuple(seq_start.shape)}")
    if value_checks and batch > 0:
        lo, hi = int(seq_start.min()), int(seq_start.max())
        if t_k is None and lo < 0:
            raise ValueError(f"seq_start must be >= 0, got values in [{lo}, {hi}]")
        if t_k is not None and (lo < 0 or hi > t_k):
            raise ValueError(f"seq_start must lie in [0, {t_k}] (the key length), got values in [{lo}, {hi}]")


def values_checkable(x: torch.Tensor) -> bool:
    """Whether ``x``'s values may be read for a check: on the CPU (no device to wait for), outside tracing.
    False for what is no tensor, which the check's own ``require_tensor`` then names."""
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and not torch.compiler.is_compiling()


def check_threshold_number(value) -> None:
    """A pruning threshold is the log-space bound delta = -(2U + ln Tk) + ln eps (``fox_kernel.pruning``):
    with U >= 0, Tk >= 1 and eps < 1 it is finite and negative. 0 or more would drop keys that carry weight."""
    if not math.isfinite(value) or value >= 0:
        raise ValueError(f"adaptive_threshold must be a finite negative number (a log-space bound "
                         f"-(2U + ln Tk) + ln eps), got {value}")


def check_threshold_tensor(threshold: torch.Tensor) -> None:
    """The values of a threshold tensor, when they can be read without a sync (``values_checkable``)."""
    if threshold.dtype.is_complex or threshold.dtype == torch.bool:
        raise TypeError(f"adaptive_threshold must hold real numbers, got {threshold.dtype}")
    if not values_checkable(threshold) or threshold.numel() == 0:
        return
    bad = ~(torch.isfinite(threshold) & (threshold < 0))
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        check_threshold_number(float(threshold[index]))


def gates_checkable(x: torch.Tensor, check_gates: bool) -> bool:
    """Whether ``x``'s gates may be read for -inf: where ``values_checkable``, and with
    ``KernelOptions.check_gates`` on a CUDA device too, outside compiling and CUDA-graph capture (there the
    read would wait for the GPU, which the option accepts)."""
    if values_checkable(x):
        return True
    return (check_gates and x.is_cuda and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing())


def zero_gate_at(log_gates: torch.Tensor) -> tuple[int, int, int] | None:
    """(b, t, h) of the first -inf (a gate of exactly 0) in ``log_gates`` (B, T, H), or None."""
    zero = torch.isneginf(log_gates)
    if log_gates.numel() == 0 or not zero.any():
        return None
    return tuple(int(i) for i in zero.nonzero()[0])


def positive_gate_at(log_gates: torch.Tensor) -> tuple[int, int, int] | None:
    """(b, t, h) of the first log gate above 0 (a forget gate above 1) in ``log_gates`` (B, T, H), or None."""
    positive = log_gates > 0
    if log_gates.numel() == 0 or not positive.any():
        return None
    return tuple(int(i) for i in positive.nonzero()[0])


def check_log_gates_at_most_zero(name: str, log_gates: torch.Tensor, check_gates: bool = False) -> None:
    """Refuse log gates above 0 (a forget gate above 1, prefix sums that grow) where they can be read
    (``gates_checkable``). The Triton kernels' fixed softmax bound and their pruning of key tiles assume
    prefix sums that never increase; with a positive gate they would return NaN or wrong rows."""
    if gates_checkable(log_gates, check_gates) and (at := positive_gate_at(log_gates)) is not None:
        b, t, h = at
        raise ValueError(f"{name} must be <= 0 (the log of a forget gate in [0, 1]), got "
                         f"{float(log_gates[b, t, h])} at (b, t, h) = ({b}, {t}, {h})")


def check_block_table(block_table: torch.Tensor, num_pages: int, page_size: int, lens: torch.Tensor) -> None:
    """Where its values can be read without a wait (``values_checkable``), every page index a row uses (the
    pages holding its first ``lens[b]`` tokens, ``lens`` clamped to the table) lies in the pool
    [0, num_pages): a page -1 would be PyTorch's last page, another row's, and a larger one memory past the
    cache. On a device the kernels clamp such indices into the pool and return NaN for the rows that read
    them (``decode.py``)."""
    if not values_checkable(block_table) or block_table.numel() == 0:
        return
    used = torch.arange(block_table.shape[1])[None, :] * page_size < lens.long().cpu()[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bad.any():
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_table must hold page indices in [0, {num_pages}) (the page pool) for each "
                         f"row's cached tokens, got {int(block_table[b, j])} at (b, j) = ({b}, {j})")


def refuse_zero_gate(name: str, at: tuple[int, int, int], why: str) -> NoReturn:
    b, t, h = at
    raise ValueError(f"{name} must not hold -inf (a gate of exactly 0), got -inf at (b, t, h) = ({b}, {t}, {h}): "
                     f"{why}")


def check_no_zero_gates(name: str, log_gates: torch.Tensor, why: str, check_gates: bool = False) -> None:
    """Refuse log gates of -inf (a gate of exactly 0) where they cannot be handled exactly and can be read
    (``gates_checkable``); ``log_gates`` (B, T, H), or prefix sums of them."""
    if gates_checkable(log_gates, check_gates) and (at := zero_gate_at(log_gates)) is not None:
        refuse_zero_gate(name, at, why)


def check_zero_gates_promise(name: str, log_gates: torch.Tensor, zero_gates, check_gates: bool,
                             value_checks: bool = True) -> None:
    """``zero_gates`` is a bool; where it promises no gate of exactly 0 (False) and the gates can be read
    (``value_checks`` and ``gates_checkable``), none is there."""
    if not isinstance(zero_gates, bool):
        raise TypeError(f"zero_gates must be a bool, got {type(zero_gates).__name__}")
    if value_checks and not zero_gates:
        check_no_zero_gates(name, log_gates, "zero_gates=False promises none", check_gates)


def require_window_size(window_size) -> None:
    """A sliding window is None (full attention) or an int >= 1 (1: each query sees only its own key)."""
    if window_size is not None and (isinstance(window_size, bool) or not isinstance(window_size, int)
                                    or window_size < 1):
        raise ValueError(f"window_size must be None or an int >= 1 (1: each query sees only its own key), "
                         f"got {window_size!r}")


def check_window_size(window_size, t_k: int) -> int:
    """The sliding window as the kernels take it: 0 for none (None, or a window covering every key)."""
    require_window_size(window_size)
    return 0 if window_size is None or window_size >= t_k else window_size
