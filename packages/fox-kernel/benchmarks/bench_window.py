"""Sliding-window Forgetting Attention: our windowed kernels (on Hopper the Gluon ones, and the Triton ones
beside them) against our full causal kernel and flash-linear-attention's windowed
``parallel_forgetting_attn`` (if installed), side by side in one run.

B*T = 16384 tokens and H*D = 2048 (``bench_attention.py``'s shapes), bf16, forward and forward+backward; each case first
checks that fla and ours agree on the output (same window convention). Prints a table and writes JSON.

    python packages/fox-kernel/benchmarks/bench_window.py --out window.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F
import triton

from fox_kernel import KernelOptions, forgetting_attention


def _inputs(B, T, H, D):
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lf = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 4.0)  # mean log f ~ -0.018
    return q, k, v, lf


def _time(fn, args, mode):
    if mode == "fwd":
        with torch.no_grad():
            return triton.testing.do_bench(lambda: fn(*args), warmup=30, rep=150, return_mode="median")
    leaves = [x.detach().requires_grad_() for x in args]
    do = torch.randn_like(args[0])

    def step():
        torch.autograd.grad(fn(*leaves), leaves, do)
    return triton.testing.do_bench(step, warmup=30, rep=150, return_mode="median")


def _contenders(W):
    out = {
        "ours full": lambda q, k, v, lf: forgetting_attention(q, k, v, lf),
        "ours window": lambda q, k, v, lf: forgetting_attention(q, k, v, lf, window_size=W),
        "ours window, Triton": lambda q, k, v, lf: forgetting_attention(q, k, v, lf, window_size=W,
                                                                        options=KernelOptions(gluon=False)),
    }
    try:
        from fla.ops.forgetting_attn import parallel_forgetting_attn

        out["fla window"] = lambda q, k, v, lf: parallel_forgetting_attn(q, k, v, lf, window_size=W)
    except ImportError:
        pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_window.json")
    ap.add_argument("--quick", action="store_true", help="only T=16k")
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128], help="head dims (default 64 128)")
    ap.add_argument("--windows", nargs="+", type=int, default=[512, 2048], help="windows (default 512 2048)")
    args = ap.parse_args()
    lengths = [16384] if args.quick else [4096, 8192, 16384]
    rows = []
    for D in args.dims:
        for T in lengths:
            for W in args.windows:
                B, H = 16384 // T, 2048 // D
                torch.manual_seed(0)
                inputs = _inputs(B, T, H, D)
                contenders = _contenders(W)
                row = dict(B=B, T=T, H=H, D=D, W=W)
                if "fla window" in contenders:
                    with torch.no_grad():
                        a = contenders["ours window"](*inputs).float()
                        b = contenders["fla window"](*inputs).float()
                    row["fla_vs_ours_max_abs"] = (a - b).abs().max().item()
                for mode in ("fwd", "fwd+bwd"):
                    for name, fn in contenders.items():
                        try:
                            row[f"{name} {mode} ms"] = _time(fn, inputs, mode)
                        except Exception as e:  # reported, not fatal
                            print(f"{name} failed at T={T} D={D} W={W}: {type(e).__name__}: {str(e)[:200]}")
                            row[f"{name} {mode} ms"] = float("nan")
                    ours = row[f"ours window {mode} ms"]
                    row[f"full/window {mode}"] = row[f"ours full {mode} ms"] / ours
                    row[f"triton/ours {mode}"] = row[f"ours window, Triton {mode} ms"] / ours
                    if "fla window" in contenders:
                        row[f"fla/ours {mode}"] = row[f"fla window {mode} ms"] / ours
                rows.append(row)
                print(_fmt(row), flush=True)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version())
    print(" | ".join(f"{k}={v}" for k, v in env.items()))
    with open(args.out, "w") as f:
        json.dump(dict(env=env, window=rows), f, indent=1)


def _fmt(row):
    parts = [f"T={row['T']:5d} D={row['D']:3d} W={row['W']:4d}"]
    for mode in ("fwd", "fwd+bwd"):
        parts.append(f"{mode}: ours win {row[f'ours window {mode} ms']:.2f} ms, full {row[f'ours full {mode} ms']:.2f} "
                     f"(x{row[f'full/window {mode}']:.2f}), Triton {row[f'ours window, Triton {mode} ms']:.2f} "
                     f"(x{row[f'triton/ours {mode}']:.2f})")
        if f"fla/ours {mode}" in row:
            parts.append(f"fla {row[f'fla window {mode} ms']:.2f} (fla/ours x{row[f'fla/ours {mode}']:.2f})")
    if "fla_vs_ours_max_abs" in row:
        parts.append(f"|fla-ours| {row['fla_vs_ours_max_abs']:.3g}")
    return "  ".join(parts)


if __name__ == "__main__":
    main()
