"""Which forward a pruned call should take at D=64: the Gluon forward (per-head "auto" bound) against the
Triton forward (each query tile's own bound), in GPU time.

For fast, medium and slow gates (bench_pruning's) and a few D=64 shapes, times the exact call, the pruned
call ("auto", ``zero_gates=False``) as dispatched, and the same pruned call with its forward sent to the
Triton kernels (``dispatch.forward_backend`` answering TRITON for pruned calls; the backward is the same
Gluon one in both), forward and forward+backward, each captured in a CUDA graph and replayed in rounds of
rotating order. Prints the median milliseconds and the ratios, writes JSON.

    python packages/fox-kernel/benchmarks/forward_route_ab.py --rounds 7 --out forward-route.json
"""

from __future__ import annotations

import contextlib
import json
import platform
import statistics

import torch
import triton
from bench_pruning import (  # this folder's: inputs, capture, timing
    GATES,
    _inputs,
    alternate,
    alternating_args,
    capture_graph,
)

from fox_kernel import current_options, forgetting_attention
from fox_kernel.ops import dispatch
from fox_kernel.ops.triton import launch

SHAPES = [(1, 16384, 32, 64), (1, 16384, 12, 64), (2, 8192, 12, 64), (4, 4096, 16, 64)]


@contextlib.contextmanager
def triton_forward_when_pruned():
    """``dispatch.forward_backend`` sending pruned calls to the Triton forward while the block runs."""
    chosen = dispatch.forward_backend

    def backend(q, k, call):
        found = chosen(q, k, call)
        return dispatch.Backend.TRITON if call.pruned and found is dispatch.Backend.GLUON else found

    dispatch.forward_backend = backend
    try:
        yield
    finally:
        dispatch.forward_backend = chosen


def exact(q, k, v, lf, t):
    return forgetting_attention(q, k, v, lf, zero_gates=False)


def auto(q, k, v, lf, t):
    return forgetting_attention(q, k, v, lf, adaptive_threshold="auto", zero_gates=False)


def main():
    args = alternating_args(__doc__, 7, "forward_route.json")
    rows = []
    print(f"{'B x T, H':14s} {'gates':8s} {'mode':8s} {'exact ms':>9} {'Gluon fwd':>10} {'Triton fwd':>11} "
          f"{'Triton / Gluon':>15}")
    for B, T, H, D in SHAPES:
        for label, shift in GATES.items():
            inputs = _inputs(B, T, H, D, shift)
            for mode in ("fwd", "fwd+bwd"):
                graphs = {"exact": capture_graph(exact, inputs, mode), "auto, Gluon forward": capture_graph(
                    auto, inputs, mode)}
                with triton_forward_when_pruned():
                    graphs["auto, Triton forward"] = capture_graph(auto, inputs, mode)
                times = alternate(graphs, args.rounds, args.rep)
                del graphs
                med = {name: statistics.median(t) for name, t in times.items()}
                ratios = [a / b for a, b in zip(times["auto, Triton forward"], times["auto, Gluon forward"])]
                row = dict(B=B, T=T, H=H, D=D, gates=label, mean_log_f=inputs[3].mean().item(), mode=mode,
                           median_ms=med, ms=times, triton_over_gluon=dict(
                               median=statistics.median(ratios), min=min(ratios), max=max(ratios)))
                rows.append(row)
                print(f"{f'{B} x {T}, {H}':14s} {label.split()[0]:8s} {mode:8s} {med['exact']:9.3f} "
                      f"{med['auto, Gluon forward']:10.3f} {med['auto, Triton forward']:11.3f} "
                      f"{statistics.median(ratios):15.3f}", flush=True)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(), options=current_options().key, cached_launch=launch.CACHED,
               rounds=args.rounds, rep_ms=args.rep)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    print(" | ".join(f"{k}={v}" for k, v in env.items()))


if __name__ == "__main__":
    main()
