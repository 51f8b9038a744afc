"""Eager pruned calls of two source trees of fox-kernel side by side on one GPU, with the official pruning
kernel: this checkout and another (``--before``, e.g. ``git archive <commit> packages/fox-kernel/src | tar -x
-C before``), in interleaved rounds of fresh processes (``decode_trees_ab.run_tree``).

Each round times, at bench_pruning's shapes (T=16k, D=128 and 64) and its fastest gates, ours "auto" as
called by default (gates of 0 allowed), ours "auto" with ``zero_gates=False`` (fox-layers' call) and the
official kernel's per-head call, forward and forward+backward, eagerly (``bench_pruning._time``: where the
GPU work is short these cells time the host); and the host time of one default forward+backward at T=256,
where the GPU work is negligible. Each process first checks that its default call gives the
``zero_gates=False`` call's output and gradients bit for bit. Prints the medians over the rounds and writes
JSON.

    python packages/fox-kernel/benchmarks/pruning_trees_ab.py --before before/packages/fox-kernel/src \\
        --official PATH --out pruning-trees-ab.json
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from decode_trees_ab import interleaved_rounds, save_rounds, tree_args

HERE = Path(__file__).resolve()
CALLS = ("ours auto", "ours auto, zero_gates=False", "official per-head")


def worker(official: str) -> None:
    """One round in this process, printed as one JSON line."""
    import torch
    import triton
    from bench_pruning import SHAPES, _flops, _inputs, _time, contenders, gate_shift

    from fox_kernel import forgetting_attention

    fns = contenders(official)
    fast = gate_shift("fast")
    # the default call against fox-layers' on gates without a 0: the same output and gradients
    q, k, v, lf, _ = _inputs(1, 1024, 4, 64, fast)
    got = []
    for zero_gates in (True, False):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, lf)]
        out = forgetting_attention(*leaves, adaptive_threshold="auto", zero_gates=zero_gates)
        got.append((out.detach(), *torch.autograd.grad(out, leaves, torch.ones_like(out))))
    if not all(torch.equal(a, b) for a, b in zip(*got)):
        raise SystemExit("pruning_trees_ab.py: the default call differs from zero_gates=False on gates without a 0")
    # host time of one default forward+backward where the GPU work is negligible
    q, k, v, lf, _ = _inputs(1, 256, 12, 64, fast)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, lf)]

    def small():
        out = forgetting_attention(*leaves, adaptive_threshold="auto")
        out.backward(out)

    for _ in range(20):
        small()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        small()
    host_us = (time.perf_counter() - start) / 200 * 1e6
    torch.cuda.synchronize()
    cells = {}
    for B, T, H, D in SHAPES:
        args = _inputs(B, T, H, D, fast)
        for mode in ("fwd", "fwd+bwd"):
            for name in CALLS:
                if name in fns:
                    ms = _time(fns[name], args, mode)
                    cells[f"D={D} {mode} {name}"] = dict(ms=ms, tflops=_flops(B, H, T, D, mode) / ms / 1e9)
    print(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                          host_us=host_us, cells=cells)))


def main() -> None:
    ap = tree_args(__doc__, 2, "pruning-trees-ab.json")
    ap.add_argument("--official", default="", help="the official kernel's forgetting_attention.py (needs einops)")
    args = ap.parse_args()
    if args.worker:
        return worker(args.official or None)
    official = ["--official", str(Path(args.official).resolve())] if args.official else []
    rounds = interleaved_rounds(args, HERE, lambda last: f"host {last['host_us']:.0f} us per small forward+backward",
                                *official)
    trees = list(rounds)
    summary = {name: dict(host_us=statistics.median(r["host_us"] for r in rounds[name])) for name in trees}
    print(f"host time of one default forward+backward, T=256 (us): before {summary['before']['host_us']:.0f}, "
          f"after {summary['after']['host_us']:.0f}")
    print(f"{'cell (T=16k, fastest gates)':44} {'before ms':>9} {'after ms':>9} {'after/before':>12}")
    for cell in rounds["after"][0]["cells"]:
        med = {name: statistics.median(r["cells"][cell]["ms"] for r in rounds[name]) for name in trees}
        summary[cell] = dict(before_ms=med["before"], after_ms=med["after"])
        print(f"{cell:44} {med['before']:9.3f} {med['after']:9.3f} {med['after'] / med['before']:12.3f}")
    save_rounds(args, rounds, summary)


if __name__ == "__main__":
    main()
