"""A/B of the Gluon backward's modes in one process: two passes (dK/dV, then dQ; the default), the one pass
with each warpgroup adding its own keys' dQ over all columns ("one": in ``GLUON_ONE_PASS_PARTS`` column
parts one after another; "one-whole": in one), and the one pass with the dQ columns split between the
warpgroups over one shared dS tile of the whole key block ("split"; see ``fox_kernel.ops.gluon.bwd``). First each mode's error against float64 at small odd shapes, then
forward and forward+backward times with cuDNN SDPA beside them, the modes alternating over ``--rounds``
(``bench_attention.py``'s inputs and timing: the median of ``triton.testing.do_bench``). Prints a table and
writes JSON.

    python packages/fox-kernel/benchmarks/one_pass_ab.py --modes two split --dims 128 --out one-pass.json
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import triton
from bench_attention import _flops, _inputs, _ours, _sdpa, _time
from torch.nn.attention import SDPBackend

from fox_kernel import forgetting_attention
from fox_kernel.ops import dispatch
from fox_kernel.ops.gluon import host
from fox_kernel.options import KernelOptions
from fox_kernel.reference import forgetting_attention_ref
from fox_kernel.testing import max_abs_err, random_log_fgate

MODES = ("two", "one", "one-whole", "split")
SHAPES = {  # head dim -> (B, T, H, Hkv) as bench_attention.py's quick table (H*D = 2048), with its GQA case
    64: [(1, 16384, 32, 32), (4, 4096, 32, 32)],
    128: [(1, 16384, 16, 16), (4, 4096, 16, 16), (2, 8192, 32, 8)],
}
SHIPPED = (dispatch.GLUON_ONE_PASS_DIMS, dict(host.GLUON_ONE_PASS_SPLIT), dict(host.GLUON_ONE_PASS_PARTS))
UNFIT = {("one-whole", 64)}  # the same kernel as "one" there (one part)


def modes_at(modes, D: int) -> list:
    return [m for m in modes if (m, D) not in UNFIT]


def use(mode: str, D: int) -> str:
    """Selects ``mode`` at head dim D; returns the backward option that runs it."""
    dispatch.GLUON_ONE_PASS_DIMS = tuple(sorted({*SHIPPED[0], D})) if mode != "two" else SHIPPED[0]
    host.GLUON_ONE_PASS_SPLIT.update(SHIPPED[1])
    host.GLUON_ONE_PASS_PARTS.update(SHIPPED[2])
    if mode != "two":
        host.GLUON_ONE_PASS_SPLIT[D] = mode == "split"
    if mode == "one-whole":
        host.GLUON_ONE_PASS_PARTS[D] = 1
    return "two-pass" if mode == "two" else "fused"


def errors(D: int, backward: str, seed=0) -> dict:
    """Largest error of output and gradients against float64, relative to the float64 tensor's largest
    magnitude, at odd shapes (partial blocks, GQA, fast gates)."""
    out = {}
    options = KernelOptions(backward=backward)
    for B, T, H, Hkv in ((2, 1000, 4, 4), (1, 777, 8, 2), (3, 300, 2, 2)):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(B, T, h, D, generator=g) for h in (H, Hkv, Hkv))
        lf = random_log_fgate((B, T, H), speed="fast", generator=g)
        do = torch.randn(B, T, H, D, generator=g)
        leaves = [x.to("cuda", torch.bfloat16).requires_grad_() for x in (q, k, v)] + [lf.cuda().requires_grad_()]
        got = forgetting_attention(*leaves, options=options)
        got = (got, *torch.autograd.grad(got, leaves, do.to("cuda", torch.bfloat16)))
        ref_leaves = [x.double().cuda().requires_grad_() for x in (q, k, v, lf)]
        ref = forgetting_attention_ref(*ref_leaves)
        ref = (ref, *torch.autograd.grad(ref, ref_leaves, do.double().cuda()))
        for name, a, r in zip(("out", "dq", "dk", "dv", "dlogf"), got, ref):
            out[name] = max(out.get(name, 0.0), max_abs_err(a, r) / r.abs().max().item())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--dims", nargs="+", type=int, default=[128, 64], choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="one_pass_ab.json")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        raise SystemExit("one_pass_ab.py needs a CUDA GPU (the Gluon kernels run on Hopper)")

    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  python=platform.python_version(), modes=args.modes, errors={}, times=[])

    def save():  # after every shape: a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for D in args.dims:
        for mode in modes_at(args.modes, D):
            err = result["errors"][f"{mode} D={D}"] = errors(D, use(mode, D))
            print(f"{mode} D={D} error vs float64:", {k: f"{e:.2e}" for k, e in err.items()}, flush=True)
        save()
    cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
    for D in args.dims:
        for B, T, H, Hkv in SHAPES[D]:
            torch.manual_seed(0)
            inputs = _inputs(B, T, H, Hkv, D)
            rows = [dict(B=B, T=T, H=H, Hkv=Hkv, D=D, contender="cuDNN", fwd_ms=[_time(cudnn, inputs, "fwd")],
                         fwd_bwd_ms=[_time(cudnn, inputs, "fwd+bwd")])]
            mine = {m: dict(B=B, T=T, H=H, Hkv=Hkv, D=D, contender=m, fwd_ms=[], fwd_bwd_ms=[])
                    for m in modes_at(args.modes, D)}
            for _ in range(args.rounds):
                for mode in mine:
                    fn = _ours(use(mode, D))
                    mine[mode]["fwd_ms"].append(_time(fn, inputs, "fwd"))
                    mine[mode]["fwd_bwd_ms"].append(_time(fn, inputs, "fwd+bwd"))
            rows += mine.values()
            print(f"\nB={B}, T={T}, H={H}, Hkv={Hkv}, D={D}")
            print(f"{'contender':>9} | {'fwd ms':>15} | {'bwd ms':>15} | {'fwd+bwd TFLOP/s':>15} | {'/ cuDNN':>7}")
            best_cudnn = min(rows[0]["fwd_bwd_ms"])
            for r in rows:
                r["bwd_ms"] = [b - f for f, b in zip(r["fwd_ms"], r["fwd_bwd_ms"])]
                print(f"{r['contender']:>9} | {' / '.join(f'{x:.3f}' for x in r['fwd_ms']):>15} | "
                      f"{' / '.join(f'{x:.3f}' for x in r['bwd_ms']):>15} | "
                      f"{_flops(B, H, T, D, 'fwd+bwd') / min(r['fwd_bwd_ms']) / 1e9:>15.1f} | "
                      f"{best_cudnn / min(r['fwd_bwd_ms']):>7.3f}", flush=True)
            result["times"] += rows
            save()
    use("two", args.dims[0])


if __name__ == "__main__":
    main()
