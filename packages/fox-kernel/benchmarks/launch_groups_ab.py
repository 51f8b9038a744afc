"""Which launch order should each Gluon pass take? The forward, the dK/dV pass and the dQ pass launch their
blocks on one grid axis, heads in groups of G (``gluon.common.program_tile``): G = 1 launches one head's
blocks after another (its programs share its tiles in L2), G = all every head's heaviest blocks first (the
shortest tail). This times each pass at G = 1, 2, 4, 8, 16 and all (``gluon.tiles.HEAD_GROUPS``), the
other passes at their default, beside cuDNN SDPA, in rotating rounds (``bench_pruning.in_rotating_rounds``):
the forward alone, and the backward alone (``autograd.grad`` of one kept forward). Prints a table (median
ms, and each order's time over the default's) and writes JSON with every round's time. ``--persistent``
times instead the forward with one program per SM (the default, ``gluon.tiles.PERSISTENT``) against one
program per query tile.

    python packages/fox-kernel/benchmarks/launch_groups_ab.py --rounds 3 --out launch-groups.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch
import triton
from bench_attention import _env, _inputs, _ours, _sdpa
from bench_pruning import in_rotating_rounds
from torch.nn.attention import SDPBackend

from fox_kernel.ops.gluon import host, tiles

# (B, T, H, Hkv, D): bench_attention's quick cells (B*T = 16384, H*D = 2048) and one layer of the 125M model
SHAPES = [(4, 4096, 32, 32, 64), (1, 16384, 32, 32, 64), (4, 4096, 16, 16, 128), (1, 16384, 16, 16, 128),
          (2, 8192, 32, 8, 128), (2, 8192, 32, 32, 128), (1, 16384, 12, 12, 64)]
GROUPS = (1, 2, 4, 8, 16, None)  # None: all (row, head) pairs in one group


@contextlib.contextmanager
def _groups(kind, group):
    """Pass ``kind`` launched in groups of ``group`` heads, the other passes by default (None: all default);
    kind "per-tile fwd": the forward with one program per query tile instead of one per SM."""
    tiles.HEAD_GROUPS.clear()
    persistent = dict(tiles.PERSISTENT)
    if kind == "per-tile fwd":
        tiles.PERSISTENT["fwd"] = False
    elif kind is not None:
        tiles.HEAD_GROUPS[kind] = group
    host.forget_plans()  # the forward's recorded launches hold the grid they were recorded with
    try:
        yield
    finally:
        tiles.HEAD_GROUPS.clear()
        tiles.PERSISTENT.update(persistent)
        host.forget_plans()


def _time(contender, args, mode):
    """Median ms of the forward alone, or of the backward alone (the gradients of one kept forward), of
    ``contender`` = (function, pass, group)."""
    fn, kind, group = contender
    q, k, v, lf = args
    with _groups(kind, group):
        if mode == "fwd":
            with torch.no_grad():
                return triton.testing.do_bench(lambda: fn(q, k, v, lf), warmup=30, rep=150, return_mode="median")
        leaves = [x.detach().requires_grad_() for x in args]
        do = torch.randn_like(q)
        out = fn(*leaves)
        return triton.testing.do_bench(
            lambda: torch.autograd.grad(out, leaves, do, retain_graph=True, allow_unused=True),
            warmup=30, rep=150, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="launch_groups_ab.json")
    ap.add_argument("--persistent", action="store_true",
                    help="only the forward, one program per SM (the default) against one per query tile")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        raise SystemExit("launch_groups_ab.py needs a CUDA GPU")
    result = {"env": _env(), "rounds": args.rounds, "cells": []}
    for B, T, H, Hkv, D in SHAPES:
        torch.manual_seed(0)
        inputs = _inputs(B, T, H, Hkv, D)
        pairs = {"fwd": B * H, "dkdv": B * Hkv, "dq": B * H}
        sweeps = (("fwd", ()),) if args.persistent else (("fwd", ("fwd",)), ("bwd", ("dkdv", "dq")))
        for mode, kinds in sweeps:
            contenders = {"cudnn": (_sdpa(SDPBackend.CUDNN_ATTENTION), None, None), "default": (_ours(), None, None)}
            if args.persistent:
                contenders["per-tile fwd"] = (_ours(), "per-tile fwd", None)
            for kind in kinds:
                for g in GROUPS:
                    g = pairs[kind] if g is None else g
                    if g <= pairs[kind] and f"{kind} G={g}" not in contenders:
                        contenders[f"{kind} G={g}"] = (_ours(), kind, g)
            times = in_rotating_rounds(contenders, args.rounds, lambda fn: _time(fn, inputs, mode))
            cell = dict(B=B, T=T, H=H, Hkv=Hkv, D=D, mode=mode, ms=times)
            result["cells"].append(cell)
            base = statistics.median(times["default"])
            print(f"\nB={B} T={T} H={H}/{Hkv} D={D} {mode} ({args.rounds} rounds; x: time over the default's)",
                  flush=True)
            for name, ms in times.items():
                med = statistics.median(ms)
                print(f"  {name:>12} {med:8.3f} ms  x{med / base:.3f}  rounds {' '.join(f'{m:.3f}' for m in ms)}",
                      flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
