"""Before/after of the row-norms kernel (``ops/triton/norms.py``) in one process: the kernel of this checkout
against an earlier copy of norms.py given by ``--before`` (alternating rounds, median GPU time a call from
``triton.testing.do_bench``). Prints a table and writes JSON.

    python benchmarks/norms_loop_ab.py --before /path/to/old/norms.py --out norms-ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics

import torch
import triton

from fox_kernel.ops.triton import norms

# (name, x shape, y shape or None, per_row)
CASES = [
    ("q+k 16k D=128 (32/8 heads)", (1, 16384, 32, 128), (1, 16384, 8, 128), False),
    ("q+k 8 x 2k D=64 (16/16 heads)", (8, 2048, 16, 64), (8, 2048, 16, 64), False),
    ("k alone 4 x 4k D=64 (12 heads)", (4, 4096, 12, 64), None, False),
    ("per row 64k D=128 (8 heads)", (1, 65536, 8, 128), None, True),
]


def load(path):
    spec = importlib.util.spec_from_file_location("norms_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="path of the earlier norms.py")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    before = load(args.before)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'case':34} {'before us':>10} {'after us':>10} {'after/before':>13}")
    for name, xs, ys, per_row in CASES:
        x = torch.randn(*xs, device="cuda", dtype=torch.bfloat16, generator=g)
        y = torch.randn(*ys, device="cuda", dtype=torch.bfloat16, generator=g) if ys else None
        calls = {"before": lambda: before.max_sq_row_norms(x, y, per_row=per_row),
                 "after": lambda: norms.max_sq_row_norms(x, y, per_row=per_row)}
        a, b = calls["before"](), calls["after"]()
        same = all(torch.equal(u, v) for u, v in zip(a, b)) if y is not None else torch.equal(a, b)
        times = {k: [] for k in calls}
        for _ in range(args.rounds):
            for k, fn in calls.items():
                times[k].append(triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append(dict(case=name, x=xs, y=ys, per_row=per_row, bit_identical=same, us=times, median_us=med,
                         after_over_before=med["after"] / med["before"]))
        print(f"{name:34} {med['before']:10.1f} {med['after']:10.1f} {med['after'] / med['before']:13.3f}"
              f"{'' if same else '  OUTPUTS DIFFER'}")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                rounds=args.rounds)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
