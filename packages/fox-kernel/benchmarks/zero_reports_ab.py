"""The eager pruned call with the prefix sums' zero-gate reports read and not read (``ops/zero_flags.py``),
alternating in one process, beside the official pruning kernel.

At bench_pruning's shapes (T=16k, D=128 and 64) and its fastest gates, where a pruned call's GPU work is
short enough that an eager call waits on its host, each round times ours "auto" as called by default (gates
of 0 allowed) with ``zero_flags.USED`` on (passes skipped once a clean report is in) and off (passes always
launched), ours with ``zero_gates=False`` (no passes at all: the floor) and the official per-head call,
forward and forward+backward (``bench_pruning._time``, eager). Rounds rotate the order of the calls. Prints
the medians over the rounds with each round's value and writes JSON. ``--switch descriptors`` alternates the
Gluon launchers' TMA descriptors kept between calls and built afresh (``ops/gluon/host.CACHED_DESCRIPTORS``)
in place of the reports.

    python packages/fox-kernel/benchmarks/zero_reports_ab.py --official PATH --rounds 5 --out zero-reports-ab.json \\
        [--switch descriptors]
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics

import torch
import triton
from bench_pruning import SHAPES, _inputs, _time, contenders, gate_shift, rotated

# per switch: the module attribute it sets, and the labels of our default call with it on and off
SWITCHES = {"reports": ("fox_kernel.ops.zero_flags", "USED", "reports read", "reports unread"),
            "descriptors": ("fox_kernel.ops.gluon.host", "CACHED_DESCRIPTORS", "descriptors kept", "descriptors built")}


def calls_of(switch: str) -> dict:
    """label -> (contender, value of the switch's attribute) of one round's calls."""
    _, _, on, off = SWITCHES[switch]
    return {on: ("ours auto", True), off: ("ours auto", False),
            "zero_gates=False": ("ours auto, zero_gates=False", True), "official per-head": ("official per-head", True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--official", help="the official kernel's forgetting_attention.py (needs einops)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="zero-reports-ab.json")
    ap.add_argument("--switch", choices=sorted(SWITCHES), default="reports",
                    help="what alternates in our default call (default: the zero-gate reports)")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"zero_reports_ab.py: --rounds must be >= 1, got {args.rounds}")
    if not torch.cuda.is_available():
        raise SystemExit("zero_reports_ab.py needs a CUDA GPU")
    fns = contenders(args.official)
    calls = {label: c for label, c in calls_of(args.switch).items() if c[0] in fns}
    module, attribute = importlib.import_module(SWITCHES[args.switch][0]), SWITCHES[args.switch][1]
    fast = gate_shift("fast")
    times: dict[str, list[float]] = {}
    used = getattr(module, attribute)
    try:
        for B, T, H, D in SHAPES:
            inputs = _inputs(B, T, H, D, fast)
            for r in range(args.rounds):
                order = rotated(list(calls), r)
                for mode in ("fwd", "fwd+bwd"):
                    for label in order:
                        name, on = calls[label]
                        setattr(module, attribute, on)
                        times.setdefault(f"D={D} {mode} {label}", []).append(_time(fns[name], inputs, mode))
    finally:
        setattr(module, attribute, used)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version())
    print(" | ".join(f"{k}={v}" for k, v in env.items()) + " | T=16k, fastest gates, eager ms (median; rounds)")
    summary = {}
    for cell, ms in times.items():
        summary[cell] = statistics.median(ms)
        print(f"{cell:40s} {summary[cell]:7.3f}  ({', '.join(f'{t:.3f}' for t in ms)})")
    with open(args.out, "w") as f:
        json.dump(dict(env=env, switch=args.switch, rounds=args.rounds, summary_ms=summary, rounds_ms=times), f,
                  indent=1)


if __name__ == "__main__":
    main()
