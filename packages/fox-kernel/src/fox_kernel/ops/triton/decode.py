"""Split-KV (flash-decoding) Forgetting Attention over a KV cache with cached gate prefix sums.

One program takes one key/value head of one sequence and one slice of the cache, and serves every query
head of the GQA group and every new token at once (rows = group x new tokens), so K and V are read once
per group. The slices' partial results (unnormalised output, running max and sum) are merged afterwards.

Paged caches (``block_table``): K, V and c live in pages (num_pages, page_size, ...); token j of row b is
at page ``block_table[b, j // page_size]``, slot ``j % page_size``. Rows are then gathered per key.

The kernel reads only inside its buffers whatever the lengths, starts and page indices hold: it clamps
them and returns NaN for the rows an out-of-range value touches (``_decode_kernel``), with no host read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fox_kernel.ops.constants import LOG2E
from fox_kernel.ops.triton import launch


@triton.jit
def _cache_rows(b, kn, mask, BT, stride_btb, page_size, num_pages, PAGED: tl.constexpr):
    """(row, slot, bad) of cache positions kn of sequence b, to be scaled by a tensor's (batch or page, time)
    strides: (b, kn), or, paged, (BT[b, kn // page_size], kn % page_size). ``bad``: the page index lies
    outside the pool [0, num_pages); such positions are read from page 0 (never outside the cache) and the
    caller flags the rows that see them."""
    if PAGED:  # one return below: the branches' types differ (Triton checks returns of both)
        page = tl.load(BT + b * stride_btb + kn // page_size, mask=mask, other=0)
        bad = (page < 0) | (page >= num_pages)
        row = tl.where(bad, 0, page).to(tl.int64)
        slot = (kn % page_size).to(tl.int64)
    else:
        row = b
        slot = kn.to(tl.int64)
        bad = kn < 0  # never: positions are clamped to [0, length)
    return row, slot, bad


@triton.jit
def _cache_offsets(b, kn, mask, BT, stride_btb, page_size, num_pages, stride_b, stride_t, PAGED: tl.constexpr):
    """(element offsets, bad) of cache positions kn of sequence b (see _cache_rows)."""
    row, slot, bad = _cache_rows(b, kn, mask, BT, stride_btb, page_size, num_pages, PAGED)
    return row * stride_b + slot * stride_t, bad


@triton.jit
def _tile_rows(b, n0, kn, mask, BT, stride_btb, page_size, num_pages, PAGED: tl.constexpr,
               TILE_IN_PAGE: tl.constexpr):
    """_cache_rows of the key tile starting at n0; with TILE_IN_PAGE (page_size a multiple of the tile,
    tiles aligned) the whole tile sits in one page: one page lookup per tile instead of one per key."""
    if PAGED and TILE_IN_PAGE:
        page = tl.load(BT + b * stride_btb + n0 // page_size)
        tile_bad = (page < 0) | (page >= num_pages)
        row = tl.where(tile_bad, 0, page).to(tl.int64)
        slot = (kn - n0 + n0 % page_size).to(tl.int64)
        bad = (kn < 0) | tile_bad  # the tile's flag for each key
    else:
        row, slot, bad = _cache_rows(b, kn, mask, BT, stride_btb, page_size, num_pages, PAGED)
    return row, slot, bad


@triton.jit
def _decode_kernel(
    Q, K, V, C, LENS, SEQ_START, ACC, M_OUT, L_OUT, O, BT, stride_btb, page_size, num_pages, THRESH, H,
    q_strides, k_strides, v_strides, c_strides, o_strides,
    B, HKV, TQ, Q0, ROWS, D, sm_scale2, WINDOW, TMAX,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SEQ_START: tl.constexpr, PRECISION: tl.constexpr, PAGED: tl.constexpr, HAS_THRESH: tl.constexpr,
    SCAN: tl.constexpr, TILE_IN_PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, DIRECT: tl.constexpr,
):
    """One slice of the cache for one key/value head of one sequence, every query head of the group and
    every new token at once: the unnormalised output, running maximum and sum, merged by _merge_kernel.
    With ``DIRECT`` (the cache is not split: one slice per row) the program normalises its rows and writes
    them to O itself, as the merge of one slice would (the same values, bit for bit), and the merge's
    launch and the partial outputs' round trip through memory are saved.

    Nothing is read outside the buffers, whatever the indices (their values are checked on the host only
    for CPU tensors): a length is clamped to [0, TMAX] and one past TMAX turns the sequence's rows to NaN;
    seq_start is clamped at 0 (the same keys); rows before position 0 (a length below TQ) see no key and
    give 0; a page index outside [0, num_pages) is read as page 0 and turns the rows that see one of its
    keys, or sit in it, to NaN (written NaN into the partial output, which the merge propagates)."""
    stride_qb, stride_qt, stride_qh = q_strides
    stride_kb, stride_kt, stride_kh = k_strides
    stride_vb, stride_vt, stride_vh = v_strides
    stride_cb, stride_ct, stride_ch = c_strides
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    length = tl.load(LENS + b)
    too_long = length > TMAX
    length = tl.minimum(tl.maximum(length, 0), TMAX)
    if HAS_SEQ_START:
        s0 = tl.maximum(tl.load(SEQ_START + b), 0)
    else:
        s0 = 0
    rows = tl.arange(0, BLOCK_M)
    g = rows // ROWS
    i = Q0 + rows % ROWS
    valid = rows < GROUP * ROWS
    h = hk * GROUP + g
    pos = length - TQ + i
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    bq = b.to(tl.int64)
    q = tl.load(Q + bq * stride_qb + i[:, None].to(tl.int64) * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None] & mask_d[None, :], other=0.0)
    q_live = valid & (pos >= 0)
    c_q_off, q_bad = _cache_offsets(bq, tl.maximum(pos, 0), q_live, BT, stride_btb, page_size, num_pages,
                                    stride_cb, stride_ct, PAGED)
    c_q = tl.load(C + c_q_off + h * stride_ch, mask=q_live, other=0.0)
    flag = (q_live & q_bad) | too_long  # rows returned as NaN

    # The row's live range [lo, length): left padding dropped and, with a threshold, the leading key
    # tiles whose decay puts every served row's weight under the bound (never read). The live range is
    # then split evenly, so pruning shortens every slice instead of idling the first ones.
    lo = (s0 // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:  # the earliest served row, at length - TQ + Q0, sees keys from there - WINDOW + 1
        lo = tl.maximum(lo, (tl.maximum(length - TQ + Q0 - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N)
    if HAS_THRESH:
        delta = tl.load(THRESH + b * H + h, mask=valid, other=0.0)
        go = lo < length
        while go:
            tiles = lo + tl.arange(0, SCAN) * BLOCK_N
            live = tiles < length
            last = tl.minimum(tiles + BLOCK_N, length) - 1
            c_off, last_bad = _cache_offsets(bq, last, live, BT, stride_btb, page_size, num_pages, stride_cb,
                                             stride_ct, PAGED)
            c_last = tl.load(C + c_off[None, :] + h[:, None] * stride_ch, mask=valid[:, None] & live[None, :],
                             other=0.0)
            gap = tl.where(valid[:, None], c_q[:, None] - c_last - delta[:, None], float("-inf"))
            gap = tl.where(last_bad[None, :], float("inf"), gap)  # a tile of a bad page is not skipped
            n = tl.sum((live & (tl.max(gap, 0) < 0.0)).to(tl.int32), 0)
            lo += n * BLOCK_N
            go = (n == SCAN) & (lo < length)
        lo = (lo // BLOCK_N) * BLOCK_N  # restates the tile alignment the loop hid from the compiler
    split_len = tl.cdiv(tl.cdiv(tl.maximum(length - lo, 0), tl.num_programs(0)), BLOCK_N) * BLOCK_N
    start = lo + pid_s * split_len
    end = tl.minimum(start + split_len, length)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        kn = n0 + offs_n
        mask_n = kn < end
        kv_mask = mask_n[:, None] & mask_d[None, :]
        t_row, t_slot, t_bad = _tile_rows(bq, n0, kn, mask_n, BT, stride_btb, page_size, num_pages, PAGED,
                                          TILE_IN_PAGE)
        k = tl.load(K + (t_row * stride_kb + t_slot * stride_kt)[:, None] + hk * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale2
        c_k = tl.load(C + (t_row * stride_cb + t_slot * stride_ct)[None, :] + h[:, None] * stride_ch,
                      mask=valid[:, None] & mask_n[None, :], other=0.0)
        s += (c_q[:, None] - c_k) * LOG2E
        keep = mask_n[None, :] & (kn[None, :] <= pos[:, None]) & (kn[None, :] >= s0)
        if HAS_WINDOW:
            keep = keep & (kn[None, :] > pos[:, None] - WINDOW)
        if PAGED:
            flag = flag | (tl.max((keep & t_bad[None, :]).to(tl.int32), 1) > 0)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + (t_row * stride_vb + t_slot * stride_vt)[:, None] + hk * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = tl.where(flag[:, None], float("nan"), acc)
    if DIRECT:  # _merge_kernel's arithmetic for one slice: its weight is 2^0 = 1
        stride_ob, stride_ot, stride_oh = o_strides
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        ptrs = O + bq * stride_ob + i[:, None].to(tl.int64) * stride_ot + h[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, out.to(O.dtype.element_ty), mask=valid[:, None] & mask_d[None, :])
    else:
        slot = (pid_s * B * HKV + pid_bh).to(tl.int64) * BLOCK_M
        tl.store(ACC + (slot + rows[:, None]) * BLOCK_D + offs_d[None, :], acc)
        tl.store(M_OUT + slot + rows, m_i)
        tl.store(L_OUT + slot + rows, l_i)


@triton.jit
def _merge_kernel(ACC, M, L, O, o_strides, B, HKV, Q0, ROWS, D, SPLITS,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the slices of one output row (one query head of one sequence, one new token) with weights
    2^(m_s - max_s m_s); a row that saw no key keeps l = 0 and gives 0, and a NaN slice gives a NaN row.
    One program per row loads every slice at once (a [BLOCK_S, BLOCK_D] tile): one round of loads instead
    of a chain over the slices, whose latency dominated when few (sequence, KV head) pairs split the cache
    many ways (one sequence of 128k keys: 8 programs walking 33 slices)."""
    stride_ob, stride_ot, stride_oh = o_strides
    pid_bh = tl.program_id(0)
    r = tl.program_id(1)  # the row within the (sequence, KV head) pair: query head r // ROWS, token r % ROWS
    b = pid_bh // HKV
    hk = pid_bh % HKV
    s = tl.arange(0, BLOCK_S)
    live = s < SPLITS
    slot = (s * B * HKV + pid_bh).to(tl.int64) * BLOCK_M + r
    m = tl.load(M + slot, mask=live, other=float("-inf"))
    w = tl.math.exp2(m - tl.max(m, 0))
    den = tl.sum(w * tl.load(L + slot, mask=live, other=0.0), 0)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(ACC + slot[:, None] * BLOCK_D + offs_d[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(den > 0.0, den, 1.0)
    h = hk * GROUP + r // ROWS
    i = Q0 + r % ROWS
    ptrs = O + b.to(tl.int64) * stride_ob + i.to(tl.int64) * stride_ot + h * stride_oh + offs_d
    tl.store(ptrs, out.to(O.dtype.element_ty), mask=offs_d < D)


TILES = dict(block_n=64, num_stages=3, num_warps=4, programs_per_sm=2, one_wave=True)
"""The decode kernel's launch on CUDA: keys per tile, pipeline stages, warps, how many programs per SM the
split of the cache aims at (``benchmarks/tune_decode.py`` sweeps them), and whether the split rounds down so
that all programs run in one wave (``_num_splits``). With GQA (32 query heads on 8 KV heads, D=128) on an
H200, three stages and one wave against two stages rounding up: 8 x 32k 3.71 -> 3.92 TB/s, 64 x 4k 3.11 ->
3.95, 32 x 8k 3.23 -> 3.97 (SDPA without a gate 4.16-4.22; three rounds each,
``benchmarks/decode-splits-ab-h200-2026-11-27.json``). Three stages alone lost at 8 x 32k (2.82): its 5
splits of 64 KV heads made 320 programs, more than the 264 that fit at once."""
TILES_ONE_HEAD = dict(block_n=128, num_stages=3, num_warps=8, programs_per_sm=4, one_wave=False)
"""The launch where each KV head serves one query head (no GQA) and head dim <= 128: a program then holds
one query row, and longer, deeper-pipelined key tiles keep more of the cache in flight (on an H200 at
batch 32, 16k tokens, D=64: 2.9 -> 3.6 TB/s; batch 8, D=128: 2.8 -> 3.4)."""


def _tiles(group: int, block_d: int) -> dict:
    return TILES_ONE_HEAD if group == 1 and block_d <= 128 else TILES


def _num_splits(device, work: int, t_max: int, block_n: int, programs_per_sm: int, one_wave: bool = False) -> int:
    """Splits of each cache row: about ``programs_per_sm`` programs per SM over ``work`` (batch x KV heads)
    programs, at most 64 and at least four key tiles each; ``one_wave`` rounds down, so that the programs
    never outnumber what the SMs run at once (rounding up can leave a second, short wave)."""
    if launch.INTERPRET or device.type != "cuda":
        return max(1, min(4, launch.cdiv(t_max, block_n)))
    sms = launch.sm_count(device)
    wanted = programs_per_sm * sms // work if one_wave else launch.cdiv(programs_per_sm * sms, work)
    return max(1, min(wanted, launch.cdiv(t_max, 4 * block_n), 64))


def decode_eager(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c_cache: torch.Tensor,
                 cache_seqlens: torch.Tensor, seq_start: torch.Tensor | None, sm_scale: float,
                 block_table: torch.Tensor | None = None, threshold: torch.Tensor | None = None,
                 window: int = 0) -> torch.Tensor:
    """q (B, Tq, H, D); caches (B, Tmax, Hkv, D) and (B, Tmax, H) float32; cache_seqlens (B,) int32.
    With block_table (B, pages per row) int32 the caches are paged: (num_pages, page_size, ...).
    Values of cache_seqlens, seq_start and block_table are not read on the host: out-of-range ones are
    clamped in the kernel and their rows returned as NaN (``_decode_kernel``). Eager callers call this
    directly; ``decode``, the custom op around it, is what a compiled decoding step holds."""
    B, Tq, H, D = q.shape
    Hkv = k_cache.shape[2]
    parts = launch.row_parts(B, Hkv)
    if len(parts) > 1:  # (sequence, KV head) pairs sit on grid axis 1: decode the batch in parts
        paged = block_table is not None

        def rows(x, b0, b1, per_row=True):
            return x[b0:b1] if x is not None and per_row else x

        return torch.cat([decode_eager(rows(q, *p), rows(k_cache, *p, not paged), rows(v_cache, *p, not paged),
                                       rows(c_cache, *p, not paged), rows(cache_seqlens, *p), rows(seq_start, *p),
                                       sm_scale, rows(block_table, *p), rows(threshold, *p), window)
                          for p in parts])
    page_size = k_cache.shape[1]
    Tmax = page_size * block_table.shape[1] if block_table is not None else k_cache.shape[1]
    group = H // Hkv
    block_d = launch.block_d(D)
    tiles = _tiles(group, block_d)
    block_n = 16 if launch.INTERPRET or not q.is_cuda else tiles["block_n"]
    rows_per_launch = max(1, 64 // group)
    splits = _num_splits(q.device, B * Hkv, Tmax, block_n, tiles["programs_per_sm"], tiles["one_wave"])
    direct = splits == 1  # one slice per row: the decoding kernel writes the output itself, without the merge
    out = torch.empty_like(q)
    for q0 in range(0, Tq, rows_per_launch):
        rows = min(rows_per_launch, Tq - q0)
        block_m = max(16, launch.next_power_of_2(group * rows))
        if direct:
            acc = m = lsum = out  # not read or written
        else:  # the slices' partial outputs, maxima and sums (n rows each) in one allocation
            n = splits * B * Hkv * block_m
            acc, m, lsum = torch.empty(n * (block_d + 2), dtype=torch.float32, device=q.device).split(
                [n * block_d, n, n])
        launch.run(_decode_kernel, (splits, B * Hkv),
            q, k_cache, v_cache, c_cache, cache_seqlens, seq_start, acc, m, lsum, out,
            block_table, 0 if block_table is None else block_table.stride(0),
            page_size, k_cache.shape[0], threshold, H,
            launch.strides(q), launch.strides(k_cache), launch.strides(v_cache), launch.strides(c_cache),
            launch.strides(out),
            B, Hkv, Tq, q0, rows, D, sm_scale * LOG2E.value, window, Tmax,
            HAS_WINDOW=window > 0, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, HAS_SEQ_START=seq_start is not None,
            PAGED=block_table is not None, HAS_THRESH=threshold is not None, SCAN=launch.scan(),
            TILE_IN_PAGE=page_size % block_n == 0,
            PRECISION=launch.precision(q.dtype), DIRECT=direct,
            num_warps=tiles["num_warps"], num_stages=tiles["num_stages"] if q.is_cuda else 1,
        )
        if direct:
            continue
        launch.run(_merge_kernel, (B * Hkv, group * rows),
            acc, m, lsum, out, launch.strides(out), B, Hkv, q0, rows, D, splits,
            GROUP=group, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_S=max(2, launch.next_power_of_2(splits)),
            num_warps=4,
        )
    return out


decode = torch.library.custom_op("fox_kernel::decode", mutates_args=())(decode_eager)


@decode.register_fake
def _(q, k_cache, v_cache, c_cache, cache_seqlens, seq_start, sm_scale, block_table=None, threshold=None, window=0):
    return torch.empty_like(q)
