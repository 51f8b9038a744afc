"""Host side of the Gluon (Hopper) kernels: the forward and the two backward passes (dK/dV, dQ), see
``_gluon_kernels``.

They replace the Triton kernels where they apply (``use_gluon``): an sm90 GPU, bfloat16 or float16, head
dim 64 or 128, fixed-length batches without ``seq_start`` (with or without pruning), and a Triton build
with Gluon. Everything else, and ``FOX_KERNEL_GLUON=0``, keeps the Triton kernels.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

# (BLOCK_M, BLOCK_N, STAGES, registers per consumer / loader thread) per head dim, measured on an H200
# (Triton 3.6, fwd+bwd at T=16k/8k/4k, benchmarks/gluon-d128-h200-s11.json). At D=128 ptxas spills
# ~380 bytes at BLOCK_M=64 and none at 32, yet 64 was 1-3% faster at every shape.
GLUON_TILES = {64: (64, 128, 2, 240, 24), 128: (64, 128, 2, 240, 24)}
# The dQ pass: (BLOCK_M, BLOCK_N, STAGES, consumer / loader registers); BLOCK_M rows are split between
# the two consumer warpgroups. Measured on an H200 (Triton 3.6, the pass alone, T=16k and 4k,
# benchmarks/gluon-dq-h200-s12.json): 128-key tiles beat 64 by 15-20% at both head dims although D=128
# spills ~100 bytes with them; a third stage and launching heads first were within 2% either way.
GLUON_DQ_TILES = {64: (128, 128, 2, 240, 24), 128: (128, 128, 2, 240, 24)}
# The forward with the online softmax (float16, or FOX_KERNEL_FIXED_BOUND=0): as the dQ pass (64-key tiles
# or a third stage were 2-20% slower, gluon-fwd-h200-s12.json). The Triton forward's fixed softmax bound
# made that one faster on long sequences at D=64, so there this form only takes keys up to GLUON_FWD_MAX_KEYS[D] (and
# so do pruned calls at D=64, see triton_forward). Measured on an H200 (benchmarks/gluon-fwd-h200-s12.json,
# forward TFLOP/s, Gluon / Triton): D=64 T=4k 307 / 285, 8k GQA 348 / 382, 16k 380 / 390; D=128 4k 429 /
# 358, 16k 518 / 487.
GLUON_FWD_TILES = {64: (128, 128, 2, 240, 24, 2), 128: (128, 128, 2, 240, 24, 2)}
GLUON_FWD_MAX_KEYS = {64: 4096, 128: None}
# The forward with its fixed softmax bound (the online softmax only where no bound is tight enough): (BLOCK_M,
# BLOCK_N, STAGES, consumer / loader registers, consumer warpgroups). Each consumer's loop issues the next
# block's scores before the P V matmul of this one, so it holds two ring slots: with two stages it ran
# 30% slower than online. Measured on an H100 (Triton 3.6, forward TFLOP/s at T=16k, 8k GQA and 4k,
# benchmarks/gluon-fwd-fixed-h100-s16.json): D=128 128x128 tiles, 3 stages, 610-683 (online 555-573,
# cuDNN 601-628); D=64 three consumer warpgroups of 64 rows and 64-key tiles 386-432 (two warpgroups of
# 64 rows 325-355, 128-key tiles 320-358; Triton's fixed bound 338-415).
GLUON_FWD_FIXED_TILES = {64: (192, 64, 3, 168, 24, 3), 128: (128, 128, 3, 240, 24, 2)}
# Head dims of the one-pass backward (the dK/dV pass adding dQ in, FOX_KERNEL_BACKWARD=fused): its two
# float32 dQ tiles per consumer need 128 KiB of shared memory at D=128, more than is left.
GLUON_ONE_PASS_DIMS = (64,)


@functools.cache
def gluon_kernels():
    """The Gluon kernel module, or None where this Triton has no (usable) Gluon."""
    try:
        from fox_kernel.ops import _gluon_kernels
    except Exception:  # ImportError, or an older Gluon API
        return None
    return _gluon_kernels


def _rows_view(x: torch.Tensor):
    """(rows, row stride) of a (B, T, H, D) tensor read as a 2-D (B*T, H*D) matrix, or None when its
    strides do not allow that (heads not adjacent, or batches not T rows apart)."""
    B, T, H, D = x.shape
    if x.stride(3) != 1 or x.stride(2) != D or (B > 1 and x.stride(0) != T * x.stride(1)):
        return None
    if (x.stride(1) * x.element_size()) % 16 or x.data_ptr() % 16:
        return None
    return B * T, x.stride(1)


def use_gluon(q, seq_start, cu_seqlens) -> bool:
    env = os.environ.get("FOX_KERNEL_GLUON", "1")
    if env not in ("0", "1"):
        raise ValueError(f"FOX_KERNEL_GLUON must be 0 or 1, got {env!r}")
    if env == "0" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in GLUON_TILES:
        return False
    if seq_start is not None or cu_seqlens is not None:
        return False
    return gluon_kernels() is not None


def use_gluon_forward(q, k, seq_start, cu_seqlens, any_length: bool) -> bool:
    """Whether the Gluon forward runs: up to GLUON_FWD_MAX_KEYS keys, or at any length with ``any_length``."""
    if not use_gluon(q, seq_start, cu_seqlens):
        return False
    limit = GLUON_FWD_MAX_KEYS[q.shape[-1]]
    return any_length or limit is None or k.shape[1] <= limit


def gluon_dkdv(q, k, v, do, c, clq, lse, delta, dk, dv, dc, sm_scale, ranges=None, dq=None, dc_row=None):
    """dK, dV and the column term of dc (written into ``dk``, ``dv``, ``dc``). ``clq``: the local sums
    of ``c`` over query tiles of ``gluon_blocks(D)["BLOCK_M"]`` rows (see triton_attention.local_sums);
    ``ranges``: with pruning, the end of the kept queries of each (row, head, key block).

    The one-pass backward: given ``dq`` and ``dc_row`` (float32 (B, H, Tq)), also writes dQ and the row
    term of dc into them (the dQ pass's outputs, see gluon_dq)."""
    from fox_kernel.ops.triton_attention import LOG2E  # (that module imports this one)

    gk = gluon_kernels()
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    block_m, block_n, stages, regs, loader_regs = GLUON_TILES[D]
    # with GQA one program runs a whole group of heads, so there are few and long ones: launching every
    # head's heaviest key blocks first shortens the tail (D=64, 8k, 32/8 heads: backward -4 to -5%; at MHA
    # shapes no gain or slower: benchmarks/launch-order-h100-s17.json)
    grid, hf = _launch_grid(triton.cdiv(Tk, block_n), B * Hkv, D == 64 and Hkv < H)
    q_desc = _descriptor(q, block_m)
    fused = dq is not None
    if fused:  # float32 dQ / sm_scale; four partial row sums per query (one per warp), rows padded to 16 bytes
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        row_sums = torch.zeros(B * H * 4, triton.cdiv(Tq, 4) * 4, dtype=torch.float32, device=q.device)
        rs_desc = _matrix_descriptor(row_sums[:, :Tq], [4, block_m])
    gk.gluon_dkdv_kernel[grid](
        q_desc, _descriptor(do, block_m), _descriptor(k, block_n), _descriptor(v, block_n),
        c, clq, lse, delta, dk, dv, dc, ranges,
        _descriptor(dq_acc, block_m) if fused else q_desc, rs_desc if fused else q_desc,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        c.stride(0), c.stride(1), lse.stride(0), lse.stride(1),
        H, Hkv, Tq, Tk, sm_scale, sm_scale * LOG2E,
        GROUP=H // Hkv, HEAD_D=D, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, HAS_THRESH=ranges is not None,
        CONSUMER_REGS=regs, LOADER_REGS=loader_regs, FUSED_DQ=fused, HEADS_FIRST=hf,
        num_warps=4,  # the first consumer warpgroup; the second and the loader are warp_specialize workers
    )
    if fused:
        torch.mul(dq_acc, sm_scale, out=dq)
        torch.sum(row_sums[:, :Tq].view(B, H, 4, Tq), dim=2, out=dc_row)


def gluon_dq(q, k, v, do, c, cl, lse, delta, dq, dc_row, sm_scale, ranges=None):
    """dQ and the row term of dc (written into ``dq``, ``dc_row``). ``cl``: the local sums of ``c`` over
    key tiles of ``gluon_blocks(D, "dq")["BLOCK_N"]`` rows; ``ranges``: with pruning, the first kept key
    of each (row, head, query block)."""
    from fox_kernel.ops.triton_attention import LOG2E

    gk = gluon_kernels()
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    block_m, block_n, stages, regs, loader_regs = GLUON_DQ_TILES[D]
    grid = (triton.cdiv(Tq, block_m), B * H)
    gk.gluon_dq_kernel[grid](
        _descriptor(q, block_m), _descriptor(do, block_m), _descriptor(k, block_n), _descriptor(v, block_n),
        c, cl, lse, delta, dq, dc_row, ranges, 0 if ranges is None else ranges.shape[1],
        dq.stride(0), dq.stride(1), dq.stride(2), c.stride(0), c.stride(1), lse.stride(0), lse.stride(1),
        H, Tq, Tk, sm_scale, sm_scale * LOG2E,
        GROUP=H // Hkv, HEAD_D=D, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, HAS_THRESH=ranges is not None,
        CONSUMER_REGS=regs, LOADER_REGS=loader_regs, num_warps=4,
    )


def gluon_forward(q, k, v, c, cl, out, lse, sm_scale, ranges=None, kmax2=None, gap=None):
    """Output and log-sum-exp (written into ``out``, ``lse``). ``cl``: the local sums of ``c`` over key
    tiles of ``gluon_blocks(D, "fwd")["BLOCK_N"]`` rows; ``ranges``: with pruning, the first kept key of
    each (row, head, query block); ``kmax2``: the largest squared key norms (B, Hkv), given which each
    consumer runs its rows against a fixed softmax bound where it lies within ``gap`` (log2 units) of
    every row's diagonal term."""
    from fox_kernel.ops.triton_attention import LOG2E

    gk = gluon_kernels()
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    fixed = kmax2 is not None
    block_m, block_n, stages, regs, loader_regs, consumers = (GLUON_FWD_FIXED_TILES if fixed else GLUON_FWD_TILES)[D]
    # few rows x heads (one layer of the 125M model: 12): every head's heaviest query blocks first, so the
    # last wave is not one head's long blocks (T=16k, H=12, D=64: -5%; no gain from 16 heads on, slower
    # at B=4 x 32 heads: benchmarks/launch-order-h100-s17.json)
    grid, hf = _launch_grid(triton.cdiv(Tq, block_m), B * H, B * H <= 12)
    gk.gluon_fwd_kernel[grid](
        _descriptor(q, block_m // consumers), _descriptor(k, block_n), _descriptor(v, block_n), c, cl, out, lse, ranges,
        0 if ranges is None else ranges.shape[1], kmax2, out.stride(0), out.stride(1), out.stride(2),
        c.stride(0), c.stride(1), lse.stride(0), lse.stride(1), H, Tq, Tk, sm_scale * LOG2E,
        GROUP=H // Hkv, HEAD_D=D, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, HAS_THRESH=ranges is not None,
        CONSUMER_REGS=regs, LOADER_REGS=loader_regs, FIXED=fixed, GAP=float(gap or 0.0), CONSUMERS=consumers,
        HEADS_FIRST=hf,
        num_warps=4,
    )


def _launch_grid(blocks: int, programs: int, heads_first: bool):
    """(grid, heads_first) of a kernel over ``blocks`` blocks of each of ``programs`` (row, head) pairs:
    ``(blocks, programs)`` launches one head's blocks after another, ``(programs, blocks)`` every head's
    first blocks first. The second axis holds at most 65,535 programs, so very long sequences keep the first
    order."""
    if heads_first and blocks <= 65535:
        return (programs, blocks), True
    return (blocks, programs), False


def _descriptor(x, rows):
    """TMA descriptor of a (B, T, H, D) tensor read as (B*T, H*D) in (rows, D) tiles (a copy where its
    strides do not allow that view)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    view = _rows_view(x)
    if view is None:
        x = x.contiguous()
        view = _rows_view(x)
    n_rows, stride = view
    D = x.shape[3]
    return TensorDescriptor(x, [n_rows, x.shape[2] * D], [stride, 1], [rows, D], _tile_layout(rows, D, x.dtype))


def _matrix_descriptor(x, block):
    """TMA descriptor of a 2-D tensor read in ``block`` tiles."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, _tile_layout(*block, x.dtype))


@functools.cache
def _tile_layout(rows: int, D: int, dtype: torch.dtype):
    """The shared-memory layout of a (rows, D) tile (built once: it took a third of a descriptor's host time)."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, D], gl_dtype)


def gluon_blocks(head_dim: int, kind: str = "dkdv") -> dict:
    """The query and key tile heights of a pass ("fwd", "fwd-fixed", "dkdv" or "dq") at this head dim."""
    tables = {"fwd": GLUON_FWD_TILES, "fwd-fixed": GLUON_FWD_FIXED_TILES, "dkdv": GLUON_TILES, "dq": GLUON_DQ_TILES}
    tiles = tables[kind][head_dim]
    return dict(BLOCK_M=tiles[0], BLOCK_N=tiles[1])
