"""Why the backward keeps the row term of the gate gradient (CPU, float64, one head).

d score_ij / d c_i = 1 for every key of row i, so the row term of dc (the sums of dS over keys) vanishes
in exact arithmetic: a softmax does not see a per-row shift. The kernels still take it, because delta
(dO . O) comes from the output rounded to bfloat16 (and from weights rounded to bfloat16 before P V), and
the row term cancels that error where the gate gradient's suffix sums would pile it up. This script
simulates those roundings in float64 and prints the gate gradient's error against the exact one with and
without the row term, and with the row term taken from dS rounded to bfloat16.

    python packages/fox-kernel/benchmarks/row_term_precision.py --out row-term.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float64)


def suffix(x: torch.Tensor) -> torch.Tensor:
    return torch.flip(torch.cumsum(torch.flip(x, [0]), 0), [0])


def errors(T: int, D: int, gate_shift: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (bf16(torch.randn(T, D, generator=g, dtype=torch.float64)) for _ in range(4))
    log_f = bf16(F.logsigmoid(torch.randn(T, generator=g, dtype=torch.float64) + gate_shift))
    c = torch.cumsum(log_f, 0)
    z = (q @ k.T / math.sqrt(D) + c[:, None] - c[None, :]).masked_fill(
        ~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    unnorm = torch.exp(z - z.max(-1, keepdim=True).values)
    norm = unnorm.sum(-1, keepdim=True)
    p = unnorm / norm
    dp = do @ v.T
    exact = suffix(-(p * (dp - (do * (p @ v)).sum(-1, keepdim=True))).sum(0))
    out = {}
    for o_name, o in (("bf16 output", bf16((bf16(unnorm) @ v) / norm)), ("fp32 output", (bf16(unnorm) @ v) / norm)):
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        for term, row in (("row term", ds.sum(1)), ("no row term", 0.0), ("bf16 row term", bf16(ds).sum(1))):
            out[f"{o_name}, {term}"] = (suffix(row - ds.sum(0)) - exact).abs().max().item()
    out["max |d log f|"] = exact.abs().max().item()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--shifts", type=float, nargs="+", default=[6.0, 2.0], help="gate logit shifts (6 slow, 2 fast)")
    ap.add_argument("--out", default="row_term_precision.json")
    args = ap.parse_args()
    rows = [dict(T=args.T, D=args.D, gate_shift=s, **errors(args.T, args.D, s, seed=0)) for s in args.shifts]
    keys = [k for k in rows[0] if k not in ("T", "D", "gate_shift")]
    print(f"{'max error of d log f':32s}" + "".join(f"  shift {r['gate_shift']:>5}" for r in rows))
    for key in keys:
        print(f"{key:32s}" + "".join(f"  {r[key]:11.3e}" for r in rows))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
