"""Forgetting Attention against a KV cache that stores the gate prefix sums ``c`` per token.

Because ``c`` is cached, a decoding step costs one read of the cache and never recomputes a cumsum
over it. The cache here is a set of plain tensors grown by ``append_to_cache``:

    k_cache, v_cache: (B, T, Hkv, D)   c_cache: (B, T, H) float32   (T = tokens cached so far)

Layout of ``c_cache``: any strides. The caches made here store it head-major, its (B, H, T) memory seen
as (B, T, H) (``gate_cache``, ``append_to_cache``): a decoding program reads the prefix sums of its
key/value head's query heads, a few bytes a token, which token-major are scattered one per 32-byte sector
and head-major lie in runs of whole sectors (on an H200, GQA 32/8, D=128: 0.6-1.7% more K/V bandwidth
contiguous, 13-15% paged with 256-token pages; ``benchmarks/decode_layout_ab.py``).

Caches may be preallocated: ``cache_seqlens`` (B,) then gives the valid tokens of each row. They may
also be paged: (num_pages, page_size, ...) tensors plus a ``block_table`` (B, pages per row) of page
indices, filled by ``append_to_paged_cache``. On CUDA
(and with ``TRITON_INTERPRET=1``) a split-KV Triton kernel runs (``ops/triton/decode.py``); otherwise the
chunked PyTorch twin of the kernels (``ops/chunked.py``, ``forward_from_sums``) on the cached prefix sums,
so a long chunked prefill never holds more than (B, H, chunk, T) scores, given the call's scale, starts and
window as one ``AttentionCall`` (``ops/call.py``); the Triton path's custom op takes them as primitives.

Precision: the cached prefix sums ``c`` are float32 on every path, summed in float64 and rounded when
stored, and only their differences ``c_i - c_j`` are ever used, so a cache holds them up to a constant per
row and head. Float32 keeps a relative 6e-8 of |c|, and a million tokens of fast gates reach |c| ~ 4e5: an
error of 0.02 in every decay term, 7e-3 of the output against 5e-5 at 8k tokens. So the caches made here
keep that constant near the newest token: ``fill_empty_cache``, ``append_to_cache`` and an empty row's first
``append_to_paged_cache`` subtract the multiple of ``RECENTER_STEP`` that leaves the newest sum within one
step of 0, and ``append_to_cache`` subtracts it from the sums already cached as well. The sums near the
newest then keep the precision of small numbers at any length, as within one chunk of new tokens. The shift
is exact for every cached sum within a factor of 2 of it; the others, rounded more coarsely, belong to keys
at least half a step of decay from the newest (a weight below e^-32 of its weight). A paged row that already
holds tokens continues from its last sum without a shift (moving every page of the row in each step would
cost a pass over the cache), so its newest sums drift by the gates of the tokens appended since: 64k tokens
of fast gates appended one at a time, as a static cache grows while generating, read 4.3e-4 relative error
against 9.3e-7 for the same cache filled at once, well below bf16's 3.9e-3 (``test_decode.py``). Float64
q/k/v (which run the PyTorch path in float64) get the decay term to float32 accuracy, not float64's.

Indices: lengths, starts and page indices are checked for CPU tensors (reading a CUDA tensor waits for
the GPU). On CUDA nothing reads or writes outside the caches whatever they hold: a write to a page outside
the pool (or past a row's table) lands nowhere, and decoding clamps such indices into the buffers and
returns NaN for the rows they touch (never another row's keys or a crash).

Log gates must be <= 0 (forget gates in [0, 1]) and not -inf; both are refused where the gates are read
(CPU tensors, and CUDA ones with ``KernelOptions.check_gates``).
"""

from __future__ import annotations

import numbers

import torch

from fox_kernel.ops import checks, dispatch
from fox_kernel.ops.call import AttentionCall
from fox_kernel.ops.chunked import forward_from_sums
from fox_kernel.options import current_options

RECENTER_STEP = 64.0
"""The cached prefix sums are shifted by multiples of this (see the module's docstring). A multiple of 64 is
exact in float32, and so is the shift of every sum within a factor of 2 of it: those that carry weight."""

# why a gate of exactly 0 is refused where the values are read (see checks.gates_checkable)
_NO_ZERO_GATES = "a cache of plain prefix sums c cannot represent it (c_i - c_j would be -inf - -inf)"



def _check_cache_tensors(k_cache, v_cache, c_cache, lead: tuple, Hkv: int, D: int, H: int, what: str) -> None:
    """K and V caches of a float dtype shaped (*lead, Hkv, D) and float32 prefix sums shaped (*lead, H);
    ``what`` names where the expected sizes come from."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.require_float_dtype(name, x)
        if tuple(x.shape) != (*lead, Hkv, D):
            raise ValueError(f"{name} must have shape {(*lead, Hkv, D)} ({what}), got {tuple(x.shape)}")
    if v_cache.dtype != k_cache.dtype:  # decoding multiplies both with q as they are
        raise TypeError(f"v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    if c_cache.dtype != torch.float32 or tuple(c_cache.shape) != (*lead, H):
        raise ValueError(f"c_cache must be float32 of shape {(*lead, H)}, got {c_cache.dtype} {tuple(c_cache.shape)}")

def gate_cache(rows: int, tokens: int, heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A zeroed cache of gate prefix sums, (rows, tokens, heads) float32, stored head-major (its (rows, heads,
    tokens) memory transposed; see the module's docstring): ``c_cache`` of a preallocated cache (rows = B) or
    of a paged one (rows = num_pages, tokens = page_size)."""
    for name, n in (("rows", rows), ("tokens", tokens), ("heads", heads)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    return torch.zeros(rows, heads, tokens, dtype=torch.float32, device=device).transpose(1, 2)


def append_to_cache(
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    c_cache: torch.Tensor | None,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    log_fgate_new: torch.Tensor,
    seq_start: torch.Tensor | None = None,
):
    """Append new tokens: k_new, v_new (B, Tn, Hkv, D), log_fgate_new (B, Tn, H) float32.

    The new prefix sums continue from the last cached one; gates of positions before ``seq_start``
    (left padding, counted in cache positions) do not count. Returns the three grown tensors. The caches
    are all None (the first call) or all tensors, (B, T, Hkv, D) twice and (B, T, H) float32; the grown
    c_cache is head-major (see the module's docstring).
    """
    B, Tn, Hkv, D, H = _check_new_tokens(k_new, v_new, log_fgate_new)
    if (k_cache is None) != (v_cache is None) or (k_cache is None) != (c_cache is None):
        raise ValueError("k_cache, v_cache and c_cache must all be None (an empty cache) or all tensors, got "
                         + ", ".join(f"{n} {'None' if x is None else 'a tensor'}"
                                     for n, x in (("k_cache", k_cache), ("v_cache", v_cache), ("c_cache", c_cache))))
    past = 0
    if k_cache is not None:
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("c_cache", c_cache)):
            checks.require_tensor(name, x)
        checks.require_same_device(k_new.device, k_cache=k_cache, v_cache=v_cache, c_cache=c_cache)
        checks.require_rank("k_cache", k_cache, 4, "(B, T, Hkv, D)")
        past = k_cache.shape[1]
        _check_cache_tensors(k_cache, v_cache, c_cache, (B, past), Hkv, D, H, "k_new's batch, heads and head dim")
    if seq_start is not None:
        checks.require_same_device(k_new.device, seq_start=seq_start)
        checks.check_seq_start(seq_start, B, None, checks.values_checkable(seq_start))
    pos = torch.arange(past, past + Tn, device=log_fgate_new.device)[None, :]
    c_last = c_cache[:, -1] if c_cache is not None and past > 0 else None
    c_new, shift = _continued_prefix_sums(log_fgate_new, pos, seq_start, c_last, recenter=True)
    if k_cache is None:
        return k_new, v_new, c_new
    c_old = c_cache.transpose(1, 2)
    if shift is not None:
        c_old = c_old - shift[:, :, None]
    # c grows along its (B, H, T) memory: the result is head-major whatever layout c_cache had
    c_cache = torch.cat([c_old, c_new.transpose(1, 2)], dim=2).transpose(1, 2)
    return (torch.cat([k_cache, k_new.to(k_cache.dtype)], dim=1), torch.cat([v_cache, v_new.to(v_cache.dtype)], dim=1),
            c_cache)


def _check_new_tokens(k_new, v_new, log_fgate_new) -> tuple[int, int, int, int, int]:
    """Shapes and dtypes of the tokens to append; returns (B, Tn, Hkv, D, H)."""
    for name, x in (("k_new", k_new), ("v_new", v_new), ("log_fgate_new", log_fgate_new)):
        checks.require_tensor(name, x)
    checks.require_rank("k_new", k_new, 4, "(B, Tn, Hkv, D)")
    checks.require_rank("log_fgate_new", log_fgate_new, 3, "(B, Tn, H)")
    checks.require_same_device(k_new.device, v_new=v_new, log_fgate_new=log_fgate_new)
    checks.require_float_dtype("k_new", k_new)
    checks.require_float_dtype("v_new", v_new)
    if log_fgate_new.dtype != torch.float32:
        raise TypeError(f"log_fgate_new must be float32, got {log_fgate_new.dtype}")
    if tuple(v_new.shape) != tuple(k_new.shape):
        raise ValueError(f"v_new must have k_new's shape {tuple(k_new.shape)}, got {tuple(v_new.shape)}")
    B, Tn, Hkv, D = k_new.shape
    H = log_fgate_new.shape[2]
    if tuple(log_fgate_new.shape[:2]) != (B, Tn):
        raise ValueError(f"log_fgate_new must have k_new's (B, Tn) = {(B, Tn)} (one gate per new token), got "
                         f"{tuple(log_fgate_new.shape[:2])}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"log_fgate_new's {H} heads must be a multiple of k_new's heads, got Hkv={Hkv}")
    return B, Tn, Hkv, D, H


def _check_gates() -> bool:
    """``KernelOptions.check_gates``, read outside compiling only (a compiled step never reads gates, and
    reading the options there would break its graph)."""
    return not torch.compiler.is_compiling() and current_options().check_gates


def _continued_prefix_sums(log_fgate_new, pos, seq_start, c_last, recenter=None):
    """(prefix sums of the new gates (B, Tn, H) float32 at cache positions ``pos`` ((1 or B, Tn)), shift):
    the sums continue from ``c_last`` (B, H) (None: from 0); gates before ``seq_start`` (left padding) do not
    count. ``recenter`` (True, or a (B,) bool tensor of the rows to shift): a row's sums come back less its
    ``shift`` (B, H) float32, the multiple of ``RECENTER_STEP`` toward 0 from its last new sum, which the
    caller subtracts from that row's cached sums too (0 in rows not shifted; None without ``recenter`` or
    new tokens)."""
    if log_fgate_new.dtype != torch.float32:
        raise TypeError(f"log_fgate_new must be float32, got {log_fgate_new.dtype}")
    g = log_fgate_new
    if seq_start is not None:
        g = torch.where((pos >= seq_start[:, None].long())[..., None], g, torch.zeros_like(g))
    # one read of the gates (one wait on CUDA with check_gates) for both refusals
    if checks.gates_checkable(g, _check_gates()) and g.numel() and bool(((g > 0) | torch.isneginf(g)).any()):
        checks.check_no_zero_gates("log_fgate_new", g, _NO_ZERO_GATES, True)
        checks.check_log_gates_at_most_zero("log_fgate_new", g, True)
    # scanned along the last, contiguous dim: PyTorch's CUDA scan along dim 1 of a (B, T, H) tensor is about
    # 100x slower (2.9 ms for T = 16k, H = 12 on an H100, most of a 16k-token prefill into a cache)
    c_new = torch.cumsum(g.double().transpose(1, 2).contiguous(), dim=-1)
    if c_last is not None:
        c_new = c_new + c_last.double()[:, :, None]
    shift = None
    if recenter is not None and c_new.shape[-1]:
        shift = torch.trunc(c_new[..., -1] / RECENTER_STEP) * RECENTER_STEP  # (B, H), exact in float32
        if recenter is not True:
            shift = torch.where(recenter[:, None], shift, torch.zeros_like(shift))
        c_new = c_new - shift[:, :, None]
        shift = shift.float()
    return c_new.float().transpose(1, 2), shift  # head-major (B, Tn, H), the layout of the caches made here


def append_to_paged_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    log_fgate_new: torch.Tensor,
    seq_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write new tokens into a paged cache in place and return the new ``cache_seqlens``.

    k_cache, v_cache (num_pages, page_size, Hkv, D); c_cache (num_pages, page_size, H) float32;
    block_table (B, pages per row) int32; cache_seqlens (B,) int32 tokens already cached per row;
    k_new, v_new (B, Tn, Hkv, D); log_fgate_new (B, Tn, H) float32.

    No host synchronisation on CUDA tensors (a decoding step that uses it can be captured in a CUDA graph):
    the capacity, ``cache_seqlens >= 0`` and the page indices the write and the row's earlier tokens use
    (in [0, num_pages)) are checked only for CPU tensors (``checks.values_checkable``). Elsewhere a token
    whose page lies outside the pool, or past the row's table, is not written anywhere (``_write_where_ok``)
    and decoding returns NaN for that row. A contiguous cache (B, capacity, ...) is the paged one with one
    page per row: ``block_table = arange(B)[:, None]``.
    """
    B, Tn, Hkv, D, H = _check_new_tokens(k_new, v_new, log_fgate_new)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("c_cache", c_cache), ("block_table", block_table),
                    ("cache_seqlens", cache_seqlens)):
        checks.require_tensor(name, x)
    checks.require_same_device(k_new.device, k_cache=k_cache, v_cache=v_cache, c_cache=c_cache,
                               block_table=block_table, cache_seqlens=cache_seqlens, seq_start=seq_start)
    checks.require_rank("k_cache", k_cache, 4, "(num_pages, page_size, Hkv, D)")
    num_pages, page_size = k_cache.shape[:2]
    _check_cache_tensors(k_cache, v_cache, c_cache, (num_pages, page_size), Hkv, D, H, "k_new's heads and head dim")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be int32 of shape ({B}, pages per row), got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (B,):
        raise ValueError(f"cache_seqlens must be int32 of shape ({B},), got {cache_seqlens.dtype} "
                         f"{tuple(cache_seqlens.shape)}")
    if seq_start is not None:
        checks.check_seq_start(seq_start, B, None, checks.values_checkable(seq_start))
    P = block_table.shape[1]
    capacity = P * page_size
    lens = cache_seqlens.long()
    pos = lens[:, None] + torch.arange(Tn, device=k_new.device)[None, :]  # (B, Tn)
    if checks.values_checkable(pos) and B:
        if int(lens.min()) < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens.tolist()}")
        if pos.numel() and int(pos.max()) >= capacity:
            raise ValueError(f"block_table holds {capacity} tokens per row; appending {Tn} to lengths "
                             f"{cache_seqlens.tolist()} does not fit")
        checks.check_block_table(block_table, num_pages, page_size, lens + Tn)
    table = block_table.long()
    col = pos // page_size
    page = torch.gather(table, 1, col.clamp(0, max(P - 1, 0))) if P else torch.zeros_like(pos)
    ok = (pos >= 0) & (col < P) & (page >= 0) & (page < num_pages)
    slot = pos % page_size
    page = page.clamp(0, max(num_pages - 1, 0))
    last = (lens - 1).clamp_min(0)  # the row's last cached position (rows still empty continue from 0)
    prev_col = (last // page_size).clamp_max(max(P - 1, 0))[:, None]
    prev_page = (torch.gather(table, 1, prev_col)[:, 0] if P else lens).clamp(0, max(num_pages - 1, 0))
    c_last = c_cache[prev_page, last % page_size]
    c_last = torch.where((lens > 0)[:, None], c_last, torch.zeros_like(c_last))
    c_new, _ = _continued_prefix_sums(log_fgate_new, pos, seq_start, c_last, recenter=lens == 0)
    if checks.values_checkable(pos):  # every write checked above
        for cache, new in ((k_cache, k_new), (v_cache, v_new), (c_cache, c_new)):
            cache[page, slot] = new.to(cache.dtype)
    else:
        _write_where_ok(((k_cache, k_new), (v_cache, v_new), (c_cache, c_new)), page, slot, ok)
    return (cache_seqlens + Tn).to(torch.int32)


def _write_where_ok(pairs, page, slot, ok) -> None:
    """``cache[page, slot] = new`` for the (B, Tn) positions where ``ok``, without reading ``ok`` on the host.
    A position outside the pool (a page index outside [0, num_pages), a position past the table or before
    0; ``page`` already clamped into the pool) writes instead what the first ok position writes, to the
    same place, or, when no position is ok, the first position's cached value back where it is: the index
    write then changes only the ok places, with no duplicate index of differing values. The decoding
    kernels return NaN for the rows that use such a page."""
    n = ok.numel()
    if n == 0:
        return
    flat_ok = ok.reshape(n)
    # the first ok position (0 when none is), as a 1-element tensor: indexing with a 0-dim tensor reads it
    # on the host, a wait that a CUDA graph capture refuses
    first = torch.argmax(flat_ok.to(torch.uint8)).reshape(1)
    any_ok = flat_ok.any()
    page_f, slot_f = page.reshape(n), slot.reshape(n)
    page_t = torch.where(flat_ok, page_f, page_f[first])
    slot_t = torch.where(flat_ok, slot_f, slot_f[first])
    for cache, new in pairs:
        new = new.reshape(n, *new.shape[2:]).to(cache.dtype)
        fill = torch.where(any_ok, new[first], cache[page_f[first], slot_f[first]])
        keep = flat_ok.reshape(n, *([1] * (new.dim() - 1)))
        cache[page_t, slot_t] = torch.where(keep, new, fill)


def fill_empty_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    log_fgate_new: torch.Tensor,
    seq_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """``append_to_paged_cache`` for a contiguous cache (B, capacity, ...) whose rows are all empty: the new
    tokens go to positions 0 .. Tn - 1 of every row, written as slices. The scattered writes of the general
    form ran at a fraction of the memory bandwidth (56 ms of a 1 s prefill of 32 x 16k tokens into a
    12-layer cache, H100). Returns the new ``cache_seqlens`` (B,) int32, all Tn."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("c_cache", c_cache), ("k_new", k_new),
                    ("v_new", v_new), ("log_fgate_new", log_fgate_new)):
        checks.require_tensor(name, x)
    checks.require_same_device(k_new.device, k_cache=k_cache, v_cache=v_cache, c_cache=c_cache, v_new=v_new,
                               log_fgate_new=log_fgate_new, seq_start=seq_start)
    checks.require_rank("k_cache", k_cache, 4, "(B, capacity, Hkv, D)")
    checks.require_rank("k_new", k_new, 4, "(B, Tn, Hkv, D)")
    B, Tn = k_new.shape[:2]
    for name, x, cache in (("k_new", k_new, k_cache), ("v_new", v_new, v_cache), ("log_fgate_new", log_fgate_new, c_cache)):
        if x.dim() != cache.dim() or x.shape[0] != cache.shape[0] or x.shape[1] != Tn or x.shape[2:] != cache.shape[2:]:
            raise ValueError(f"{name} must be shaped like its cache with {Tn} positions, "
                             f"{(cache.shape[0], Tn, *cache.shape[2:])}, got {tuple(x.shape)}")
    _check_new_tokens(k_new, v_new, log_fgate_new)  # dtypes and heads; the shapes agree with the caches'
    # the caches' dtypes: a copy into an integer cache would truncate silently
    _check_cache_tensors(k_cache, v_cache, c_cache, tuple(k_cache.shape[:2]), k_cache.shape[2], k_cache.shape[3],
                         c_cache.shape[2], "its own")
    if Tn > k_cache.shape[1]:
        raise ValueError(f"the cache holds {k_cache.shape[1]} tokens per row; {Tn} new do not fit")
    if seq_start is not None:
        checks.check_seq_start(seq_start, B, None, checks.values_checkable(seq_start))
    pos = torch.arange(Tn, device=k_new.device)[None, :]
    k_cache[:, :Tn].copy_(k_new)
    v_cache[:, :Tn].copy_(v_new)
    c_cache[:, :Tn].copy_(_continued_prefix_sums(log_fgate_new, pos, seq_start, None, recenter=True)[0])
    return torch.full((B,), Tn, dtype=torch.int32, device=k_new.device)


def _decode_threshold(adaptive_threshold, B, H, device):
    if adaptive_threshold is None:
        return None
    if isinstance(adaptive_threshold, numbers.Real) and not isinstance(adaptive_threshold, bool):
        checks.check_threshold_number(float(adaptive_threshold))
        return torch.full((B, H), float(adaptive_threshold), dtype=torch.float32, device=device)
    if not isinstance(adaptive_threshold, torch.Tensor):
        raise ValueError(f"adaptive_threshold must be None, a number or a tensor broadcastable to ({B}, {H}), "
                         f"got {adaptive_threshold!r}")
    try:
        threshold = torch.broadcast_to(adaptive_threshold.to(device, torch.float32), (B, H)).contiguous()
    except RuntimeError:
        raise ValueError(f"adaptive_threshold must broadcast to ({B}, {H}), got shape "
                         f"{tuple(adaptive_threshold.shape)}") from None
    checks.check_threshold_tensor(adaptive_threshold)
    return threshold


def _check_cache_values(c_cache, lens, seq_start, Tq, T):
    """Value checks of a contiguous cache: for CPU tensors (``checks.values_checkable``) each row's length
    holds its Tq new tokens and fits the cache; where the prefix sums can be read (``checks.gates_checkable``:
    also CUDA with ``KernelOptions.check_gates``) the valid ones hold no -inf (c_cache None: paged, not
    gathered)."""
    if lens is not None and checks.values_checkable(lens) and lens.numel():
        lo, hi = int(lens.min()), int(lens.max())
        if lo < max(Tq, 1) or hi > T:
            raise ValueError(f"cache_seqlens must lie in [{max(Tq, 1)}, {T}] (each row holds the {Tq} new tokens "
                             f"and fits the cache of {T}), got values in [{lo}, {hi}]")
    if c_cache is None or not checks.gates_checkable(c_cache, _check_gates()):
        return
    pos = torch.arange(T, device=c_cache.device)[None, :]
    valid = pos < (lens[:, None].to(c_cache.device) if lens is not None else T)
    if seq_start is not None:
        valid = valid & (pos >= seq_start[:, None].to(c_cache.device))
    if (at := checks.zero_gate_at(c_cache.masked_fill(~valid[..., None], 0.0))) is not None:
        checks.refuse_zero_gate("c_cache", at, _NO_ZERO_GATES)


def _gather_pages(x: torch.Tensor, block_table: torch.Tensor, flag: bool = False) -> torch.Tensor:
    """(num_pages, page_size, ...) pages -> (B, pages per row * page_size, ...) in row order. Page indices
    outside the pool are clamped into it (entries past a row's length are never read and may hold
    anything); with ``flag`` such pages read NaN, so a row that uses one returns NaN."""
    n = x.shape[0]
    table = block_table.long()
    pages = x[table.clamp(0, max(n - 1, 0))]  # (B, P, page_size, ...)
    if flag:
        outside = ((table < 0) | (table >= n)).reshape(*table.shape, *([1] * (x.dim() - 1)))
        pages = pages.masked_fill(outside, float("nan"))
    return pages.reshape(pages.shape[0], -1, *x.shape[2:])


def _decode_caches(q, k_cache, v_cache, c_cache, cache_seqlens, seq_start, block_table):
    """``forgetting_attention_with_kvcache``'s checks of q, the caches, lengths, starts and pages (see its
    docstring), and its caches as the chosen path reads them: ``(k_cache, v_cache, c_cache, paged, T)``,
    where ``paged`` is the block table the Triton kernel takes (None for contiguous caches, and for a paged
    cache that the PyTorch path reads gathered into rows) and T the tokens a row can hold."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("c_cache", c_cache)):
        checks.require_tensor(name, x)
    checks.require_rank("q", q, 4, "(B, Tq, H, D)")
    layout = "(num_pages, page_size, Hkv, D)" if block_table is not None else "(B, T, Hkv, D)"
    checks.require_rank("k_cache", k_cache, 4, layout)
    checks.require_rank("v_cache", v_cache, 4, layout)
    checks.require_same_device(q.device, k_cache=k_cache, v_cache=v_cache, c_cache=c_cache,
                               cache_seqlens=cache_seqlens, seq_start=seq_start, block_table=block_table)
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        checks.require_float_dtype(name, x)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):  # the kernels multiply them with q as they are
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    B, Tq, H, D = q.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    checks.require_dim("k_cache", k_cache.shape[3], D, "head dim (q's)")
    if block_table is None:  # a cache of another batch would be broadcast against q's rows
        checks.require_dim("k_cache", k_cache.shape[0], B, "batch size (q's)")
    paged = None
    if block_table is not None:
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(f"block_table must be int32 of shape ({B}, pages per row), got {block_table.dtype} "
                             f"{tuple(block_table.shape)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required with block_table (the valid tokens of each row)")
        if c_cache.dtype != torch.float32 or c_cache.dim() != 3 or c_cache.shape[2] != H:
            raise ValueError(f"paged c_cache must be float32 of shape (num_pages, page_size, {H}), got "
                             f"{c_cache.dtype} {tuple(c_cache.shape)}")
        if c_cache.shape[:2] != k_cache.shape[:2] or v_cache.shape != k_cache.shape:
            raise ValueError(f"paged caches must share (num_pages, page_size): k {tuple(k_cache.shape)}, "
                             f"v {tuple(v_cache.shape)}, c {tuple(c_cache.shape)}")
        if cache_seqlens.dtype == torch.int32 and tuple(cache_seqlens.shape) == (B,):
            used = cache_seqlens.clamp(0, k_cache.shape[1] * block_table.shape[1])
            checks.check_block_table(block_table, k_cache.shape[0], k_cache.shape[1], used)
        paged = block_table
        # the checks below and the CPU path see the rows as contiguous caches
        if not (dispatch.runs_triton(q) and q.dtype != torch.float64):
            k_cache, v_cache = (_gather_pages(x, block_table) for x in (k_cache, v_cache))
            c_cache = _gather_pages(c_cache, block_table, flag=True)
            paged = None
    T = k_cache.shape[1] * (paged.shape[1] if paged is not None else 1)
    Hkv = k_cache.shape[2]
    if Tq > T:
        raise ValueError(f"q has {Tq} tokens but the cache holds only {T}; append them first")
    if paged is None and (c_cache.dtype != torch.float32 or tuple(c_cache.shape) != (B, T, H)):
        raise ValueError(f"c_cache must be float32 of shape {(B, T, H)}, got {c_cache.dtype} {tuple(c_cache.shape)}")
    checks.check_heads(H, Hkv, D, "the cache")
    if cache_seqlens is not None and (tuple(cache_seqlens.shape) != (B,) or cache_seqlens.dtype != torch.int32):
        raise ValueError(f"cache_seqlens must be int32 of shape ({B},), got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
    if seq_start is not None:
        checks.check_seq_start(seq_start, B, None, checks.values_checkable(seq_start))
    _check_cache_values(None if paged is not None else c_cache, cache_seqlens, seq_start, Tq, T)
    return k_cache, v_cache, c_cache, paged, T


def forgetting_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c_cache: torch.Tensor,
    cache_seqlens: torch.Tensor | None = None,
    *,
    seq_start: torch.Tensor | None = None,
    sm_scale: float | None = None,
    block_table: torch.Tensor | None = None,
    adaptive_threshold: float | torch.Tensor | None = None,
    window_size: int | None = None,
) -> torch.Tensor:
    """Attention of the newest ``Tq`` tokens (already appended) over the cache.

    q: (B, Tq, H, D), end-aligned with each row's valid length L_b (``cache_seqlens``, default the
    cache's length T): query i sits at cache position L_b - Tq + i. Returns (B, Tq, H, D) in q's dtype;
    rows of padding positions return 0. With ``block_table`` (B, pages per row) int32 the caches are
    paged, (num_pages, page_size, Hkv, D) and (num_pages, page_size, H), and ``cache_seqlens`` is required.

    ``adaptive_threshold`` (a number or a (B, H) tensor, in the units of ``c``): the Triton kernel skips
    leading cache tiles where ``c_query - c_key`` stays below it for every query row it serves (whole
    tiles are never read). With the bound of ``fox_kernel.pruning`` the dropped weight is at most eps, and the
    bound is finite and negative (anything else is refused). The PyTorch path ignores it and computes
    exactly.

    ``window_size`` W: the query at cache position i sees keys i - W < j <= i (as ``forgetting_attention``);
    cache tiles wholly before every served row's window are never read.

    ``seq_start`` (B,) counts in cache positions and may exceed the cached length (a row that is all
    padding so far, in a chunked prefill of left-padded prompts: its rows return 0).

    ``sm_scale``: a finite positive number (default ``D ** -0.5``). q and the K/V caches hold float16,
    bfloat16, float32 or float64 (integers are refused, not cast); float64 runs the PyTorch path, with
    the prefix sums at float32 accuracy (the cache's).

    Checks: shapes, dtypes and devices always (the caches must have q's batch: no broadcasting). Values
    only for CPU tensors, as reading a CUDA tensor waits for the GPU: ``cache_seqlens`` in [Tq, T],
    ``seq_start >= 0``, the page indices each row's tokens use in [0, num_pages) (entries past a row's
    length are never read), the threshold, and no -inf in the valid prefix sums (a gate of exactly 0,
    which a cache of prefix sums cannot represent; ``append_to_cache`` refuses it too). NaN prefix sums
    give NaN rows, never zeros. On CUDA, out-of-range values are not read on the host: lengths past the
    cache and page indices outside the pool give NaN rows (the kernel reads only inside the buffers),
    negative starts count as 0, and query rows before position 0 (a length below Tq) return 0.
    """
    k_cache, v_cache, c_cache, paged, T = _decode_caches(q, k_cache, v_cache, c_cache, cache_seqlens, seq_start,
                                                         block_table)
    B, Tq, H, D = q.shape
    thresh = _decode_threshold(adaptive_threshold, B, H, q.device)  # checked on every path
    window = checks.check_window_size(window_size, T)
    scale = D**-0.5 if sm_scale is None else checks.check_sm_scale(sm_scale)
    if dispatch.runs_triton(q) and q.dtype != torch.float64:
        from fox_kernel.ops.triton.decode import decode, decode_eager

        lens = cache_seqlens if cache_seqlens is not None else torch.full((B,), T, dtype=torch.int32, device=q.device)
        k_cache, v_cache = (x if x.stride(-1) == 1 else x.contiguous() for x in (k_cache, v_cache))
        table = None if paged is None else paged.contiguous()
        # starts past the cache mean all padding and negative ones 0 (as on the PyTorch path): clamped before
        # the cast, so that no start wraps around int32
        starts = None if seq_start is None else seq_start.clamp(0, T).to(torch.int32).contiguous()
        # compiling: a custom op that the compiled decoding step calls as it is (it takes the call's fields as
        # primitives, so nothing is built here that the compiler would have to trace); eager: the same
        # function without the op's dispatch, which costs host time on every token
        op = decode if torch.compiler.is_compiling() else decode_eager
        # c_cache as it is: the kernel takes its three strides (a head-major cache, ``gate_cache``, reads densest)
        return op(q, k_cache, v_cache, c_cache, lens.contiguous(), starts, scale, table, thresh, window)
    # The PyTorch path computes exactly (no threshold) and compares the starts as given (they have no upper
    # bound here: no cast to int32).
    call = AttentionCall(scale, seq_start, window=window)
    # the chunked PyTorch twin of the kernels on the cached prefix sums (c_cache as (B, H, T)), each row over
    # its own tokens
    lens = None if cache_seqlens is None else cache_seqlens.tolist()
    out, _ = forward_from_sums(q, k_cache, v_cache, c_cache.permute(0, 2, 1), None, call,
                               None if lens is None else [min(length, T) for length in lens])
    if lens is None:
        return out
    # lengths past the cache (refused on the CPU, possible on a CUDA float64 call) were clamped: NaN rows
    too_long = torch.tensor([length > T for length in lens], device=q.device)
    return out.masked_fill(too_long[:, None, None, None], float("nan"))
