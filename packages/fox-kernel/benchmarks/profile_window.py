"""GPU kernel time of one sliding-window forward+backward, per kernel, on the Gluon and the Triton kernels.

T = 16384, H*D = 2048, bf16 (``bench_window.py``'s shapes); at D=64 also the Gluon one-pass backward. Each
case runs 5 untimed steps, then 20 under torch.profiler; the table gives the summed kernel time of a step
(launch gaps excluded, so it shows where the GPU's time goes, not the wall clock) and its costliest kernels.

    python packages/fox-kernel/benchmarks/profile_window.py --out window-profile.json
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from bench_window import _inputs
from torch.profiler import ProfilerActivity, profile

from fox_kernel import KernelOptions, forgetting_attention


def kernel_ms(step, steps: int = 20) -> collections.Counter:
    """Milliseconds of each CUDA kernel per ``step()``."""
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per = collections.Counter()
    for e in prof.key_averages():
        per[e.key[:60]] += e.self_device_time_total / steps / 1000
    return per


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="window-profile.json")
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128], help="head dims (default 64 128)")
    ap.add_argument("--windows", nargs="+", type=int, default=[256, 512, 1024, 2048])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_window.py needs a CUDA GPU")
    rows = []
    for D in args.dims:
        for W in args.windows:
            modes = [("gluon", KernelOptions()), ("triton", KernelOptions(gluon=False))]
            if D == 64:
                modes.insert(1, ("gluon", KernelOptions(backward="fused")))
            for backend, options in modes:
                torch.manual_seed(0)
                leaves = [x.requires_grad_() for x in _inputs(1, 16384, 2048 // D, D)]
                do = torch.randn_like(leaves[0])

                def step():
                    out = forgetting_attention(*leaves, window_size=W, options=options)
                    torch.autograd.grad(out, leaves, do)

                per = kernel_ms(step)
                row = dict(D=D, W=W, backend=backend, backward=options.backward, total_ms=sum(per.values()),
                           kernels=dict(per.most_common(8)))
                rows.append(row)
                top = ", ".join(f"{k[:28]} {t:.3f}" for k, t in per.most_common(5))
                print(f"D={D:3d} W={W:5d} {backend:6s} {options.backward:8s} total {row['total_ms']:6.3f} ms | {top}",
                      flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
