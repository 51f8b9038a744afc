"""Tile tables and launch grids of the Gluon kernels (plain Python: read by ``dispatch`` before any Gluon
import).

(BLOCK_M, BLOCK_N, STAGES, registers per consumer / loader thread[, consumer warpgroups]).
"""

from __future__ import annotations

# The dK/dV pass, measured on an H200 (Triton 3.6, fwd+bwd at T=16k/8k/4k, benchmarks/gluon-d128-h200-s11.json).
# At D=128 ptxas spills ~380 bytes at BLOCK_M=64 and none at 32, yet 64 was 1-3% faster at every shape.
GLUON_TILES = {64: (64, 128, 2, 240, 24), 128: (64, 128, 2, 240, 24)}
# The dQ pass; BLOCK_M rows are split between the two consumer warpgroups. Measured on an H200 (Triton 3.6,
# the pass alone, T=16k and 4k, benchmarks/gluon-dq-h200-s12.json): 128-key tiles beat 64 by 15-20% at both
# head dims although D=128 spills ~100 bytes with them; a third stage and launching heads first were
# within 2% either way.
GLUON_DQ_TILES = {64: (128, 128, 2, 240, 24), 128: (128, 128, 2, 240, 24)}
# The forward with the online softmax (float16, or KernelOptions.fixed_bound off): as the dQ pass (64-key
# tiles or a third stage were 2-20% slower, gluon-fwd-h200-s12.json). The Triton forward's fixed softmax
# bound made that one faster on long sequences at D=64, so there this form only takes keys up to
# GLUON_FWD_MAX_KEYS[D] (see dispatch.forward_backend). Measured on an H200
# (benchmarks/gluon-fwd-h200-s12.json, forward TFLOP/s, Gluon / Triton): D=64 T=4k 307 / 285, 8k GQA 348 /
# 382, 16k 380 / 390; D=128 4k 429 / 358, 16k 518 / 487.
GLUON_FWD_TILES = {64: (128, 128, 2, 240, 24, 2), 128: (128, 128, 2, 240, 24, 2)}
GLUON_FWD_MAX_KEYS = {64: 4096, 128: None}
# The forward with its fixed softmax bound (the online softmax only where no bound is tight enough). Each
# consumer's loop issues the next block's scores before the P V matmul of this one, so it holds two ring
# slots: with two stages it ran 30% slower than online. Measured on an H100 (Triton 3.6, forward TFLOP/s at
# T=16k, 8k GQA and 4k, benchmarks/gluon-fwd-fixed-h100-s16.json): D=128 128x128 tiles, 3 stages, 610-683
# (online 555-573, cuDNN 601-628); D=64 three consumer warpgroups of 64 rows and 64-key tiles 386-432 (two
# warpgroups of 64 rows 325-355, 128-key tiles 320-358; Triton's fixed bound 338-415).
GLUON_FWD_FIXED_TILES = {64: (192, 64, 3, 168, 24, 3), 128: (128, 128, 3, 240, 24, 2)}
# Head dims of the one-pass backward (the dK/dV pass adding dQ in). At D=128 three forms that fit in shared
# memory ran 1.65-2.5x slower than the two passes on an H200 (register spills; see the kernel README).
GLUON_ONE_PASS_DIMS = (64,)


def gluon_blocks(head_dim: int, kind: str = "dkdv") -> dict:
    """The query and key tile heights of a pass ("fwd", "fwd-fixed", "dkdv" or "dq") at this head dim."""
    tables = {"fwd": GLUON_FWD_TILES, "fwd-fixed": GLUON_FWD_FIXED_TILES, "dkdv": GLUON_TILES, "dq": GLUON_DQ_TILES}
    tiles = tables[kind][head_dim]
    return dict(BLOCK_M=tiles[0], BLOCK_N=tiles[1])


# Passes that launch one program per SM, each running tiles until none is left (else one program per tile).
PERSISTENT = {"fwd": True}
# Heads per launch group of each Gluon pass ("fwd", "dkdv", "dq"), set by benchmarks to override the default
# order of ``launch_grid``; empty in normal use.
HEAD_GROUPS: dict[str, int] = {}


def launch_grid(kind: str, blocks: int, programs: int, group: int):
    """(grid, heads per group) of a pass over ``blocks`` blocks of each of ``programs`` (row, head) pairs, on
    one grid axis, heads in groups of ``group`` (the order of common.tile_rank; ``HEAD_GROUPS`` overrides it)."""
    group = HEAD_GROUPS.get(kind) or group
    return (blocks * programs,), max(1, min(group, programs))


def wave_group(blocks: int, sms: int) -> int:
    """The fewest heads per group whose blocks fill two waves of ``sms`` programs. The forward at D=64 on an
    H200 (benchmarks/launch-groups-ab-h200-2026-11-29.json) ran 5-6% faster with such groups than one head
    after another (at 4 x 4k, 32 heads: groups of 8 or 16; at 16k: 4), and level with all heads at once at
    12 heads, where one head after another was 10% slower; all heads at once lost 3-5% at 32 heads."""
    return -(-2 * sms // blocks)
