"""What adaptive computation pruning costs when there is nothing to prune, in GPU time, with its spread.

Slow gates (mean log f ~ -0.0006 at T=16k: no key tile falls below any bound) and the pruned call
against the exact one, each captured once in a CUDA graph and replayed (GPU time alone: eager calls at
these sizes differ by more between runs than the overhead asked about). Rounds alternate the calls in a
rotating order, so slow drifts of the clock or of the memory land on all of them; each round's ratio
pruned / exact pairs calls timed seconds apart. Prints, per shape and mode, the median ratio over the
rounds with its smallest and largest, and the share of key tiles the pruned call keeps (from its own kept
ranges, to show nothing was pruned); writes JSON.

    python packages/fox-kernel/benchmarks/pruning_overhead.py --rounds 15 --out pruning-overhead.json
"""

from __future__ import annotations

import json
import platform
import statistics

import torch
import triton
from bench_pruning import (  # this folder's: inputs, capture, timing
    _inputs,
    alternate,
    alternating_args,
    capture_graph,
    gate_shift,
)

from fox_kernel import current_options, forgetting_attention
from fox_kernel.ops.triton import launch

SHAPES = [(1, 16384, 16, 128), (1, 16384, 32, 64), (4, 4096, 16, 128)]
SLOW = gate_shift("slow")

# name -> (fn(q, k, v, lf, per-head bound), the exact call it is measured against)
VARIANTS = {
    "exact": (lambda q, k, v, lf, t: forgetting_attention(q, k, v, lf, zero_gates=False), None),
    "auto": (lambda q, k, v, lf, t: forgetting_attention(q, k, v, lf, adaptive_threshold="auto",
                                                         zero_gates=False), "exact"),
    "per-head": (lambda q, k, v, lf, t: forgetting_attention(q, k, v, lf, adaptive_threshold=t,
                                                             zero_gates=False), "exact"),
    "exact, zero gates": (lambda q, k, v, lf, t: forgetting_attention(q, k, v, lf), None),
    "auto, zero gates": (lambda q, k, v, lf, t: forgetting_attention(q, k, v, lf, adaptive_threshold="auto"),
                         "exact, zero gates"),
}


def kept_share(q, k, lf, threshold) -> float:
    """Share of the causal (query tile, key tile) pairs at 64x64 that a per-head bound (H,) keeps: a tile pair
    can be dropped only where even its largest decay bias, from its first query to its last key, is below
    the bound."""
    B, T, H, _ = q.shape
    c = torch.cumsum(lf.double(), dim=1)  # (B, T, H)
    n = T // 64
    first_query = c[:, ::64][:, :n]
    last_key = c[:, 63::64][:, :n]
    bias = first_query[:, :, None] - last_key[:, None, :]  # (B, query tile, key tile, H)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    kept = (bias >= threshold.double()) & causal[None, :, :, None]
    return (kept.sum() / (causal.sum() * B * H)).item()


def main():
    args = alternating_args(__doc__, 15, "pruning_overhead.json")
    results = []
    for B, T, H, D in SHAPES:
        inputs = _inputs(B, T, H, D, SLOW)
        share = kept_share(inputs[0], inputs[1], inputs[3], inputs[4])
        for mode in ("fwd", "fwd+bwd"):
            graphs = {name: capture_graph(fn, inputs, mode) for name, (fn, _) in VARIANTS.items()}
            times = alternate(graphs, args.rounds, args.rep)
            del graphs
            row = dict(B=B, T=T, H=H, D=D, mode=mode, mean_log_f=inputs[3].mean().item(),
                       per_head_bound_kept_share=share, ms={k: v for k, v in times.items()})
            print(f"\nB={B} T={T} H={H} D={D} {mode}, slow gates (mean log f {row['mean_log_f']:.5f}); "
                  f"the per-head bound keeps {100 * share:.2f}% of the causal 64x64 tiles; GPU time, "
                  f"{args.rounds} rounds")
            print(f"{'call':20s} {'median ms':>10} {'vs exact: median':>17} {'min':>8} {'max':>8}")
            for name, (_, base) in VARIANTS.items():
                med = statistics.median(times[name])
                line = f"{name:20s} {med:10.3f}"
                if base is not None:
                    ratios = [a / b for a, b in zip(times[name], times[base])]
                    row[f"{name} / {base}"] = dict(median=statistics.median(ratios), min=min(ratios),
                                                   max=max(ratios), rounds=ratios)
                    line += f" {100 * (statistics.median(ratios) - 1):+16.2f}% {100 * (min(ratios) - 1):+7.2f}% " \
                            f"{100 * (max(ratios) - 1):+7.2f}%"
                print(line)
            results.append(row)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(), options=current_options().key, cached_launch=launch.CACHED,
               rounds=args.rounds, rep_ms=args.rep)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=results), f, indent=1)
    print("\n" + " | ".join(f"{k}={v}" for k, v in env.items()))


if __name__ == "__main__":
    main()
