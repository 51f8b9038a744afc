"""The Gluon forward replayed from its recorded plan against the same forward launched through
``launch.run`` at every call (``ops/gluon/host.PLANS``), side by side in one process, as eager calls (the
host's time included: bench_attention's eager timer).

Rows: bench_pruning's shapes and gates (B=1, T=16k, H*D=2048) with the "auto" bound, with and without
``zero_gates``, forward and forward+backward, beside the official kernel with one per-head bound (given
``--official PATH``); and bench_attention's quick shapes, exact, forward, beside cuDNN SDPA. Every cell is
timed ``--rounds`` times, the contenders in rotating order, and reports the median; every round is kept.
Prints a table and writes JSON.

    python packages/fox-kernel/benchmarks/plans_ab.py --official PATH --rounds 5 --out plans-ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from bench_attention import _env, _inputs, _ours, _sdpa, eager_rounds
from bench_pruning import GATES, SHAPES, _load_official
from torch.nn.attention import SDPBackend

from fox_kernel.ops.gluon import host
from fox_kernel.pruning import pruning_threshold

ATTENTION_SHAPES = [(4, 4096, 32, 32, 64), (1, 16384, 32, 32, 64), (4, 4096, 16, 16, 128), (1, 16384, 16, 16, 128),
                    (2, 8192, 32, 8, 128)]


def with_plans(plans: bool, fn):
    """``fn`` run with the Gluon forward's plans on or off (restored after each call)."""
    def run(*args):
        before, host.PLANS = host.PLANS, plans
        try:
            return fn(*args)
        finally:
            host.PLANS = before
    return run


def both(name: str, fn) -> dict:
    return {f"{name}, replayed": with_plans(True, fn), f"{name}, launched": with_plans(False, fn)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--official", help="path of the official FoX kernel's forgetting_attention.py (pruning paper)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gates", nargs="+", default=["fast", "medium"], choices=["fast", "medium", "slow"])
    ap.add_argument("--out", default="plans-ab.json")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        raise SystemExit("plans_ab.py needs a CUDA GPU")
    official = _load_official(args.official) if args.official else None
    rows = []
    result = dict(env=_env(), rounds=args.rounds, rows=rows)

    def add(row, contenders, inputs, mode):
        for name, times in eager_rounds(contenders, inputs, mode, args.rounds).items():
            row[f"ms {name}"] = statistics.median(times)
            row[f"rounds ms {name}"] = times
        rows.append(row)
        with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
            json.dump(result, f, indent=1)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()
                          if not k.startswith("rounds")}), flush=True)

    for B, T, H, D in SHAPES:
        for label, shift in GATES.items():
            if label.split()[0] not in args.gates:
                continue
            torch.manual_seed(0)
            inputs = _inputs(B, T, H, H, D, gate_shift=shift)
            per_head = pruning_threshold(inputs[0], inputs[1], D**-0.5, T).amin(dim=0)
            contenders = {**both("auto", _ours(adaptive_threshold="auto")),
                          **both("auto zero_gates=False", _ours(adaptive_threshold="auto", zero_gates=False))}
            if official is not None:
                contenders["official per-head"] = lambda q, k, v, lf: official(q, k, v, lf, adaptive_threshold=per_head)
            for mode in ("fwd", "fwd+bwd"):
                add(dict(table="pruning", B=B, T=T, H=H, D=D, gates=label, mode=mode), contenders, inputs, mode)
    for B, T, H, Hkv, D in ATTENTION_SHAPES:
        torch.manual_seed(0)
        inputs = _inputs(B, T, H, Hkv, D)
        contenders = {**both("exact", _ours()), "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION)}
        add(dict(table="attention", B=B, T=T, H=H, Hkv=Hkv, D=D, mode="fwd"), contenders, inputs, "fwd")


if __name__ == "__main__":
    main()
