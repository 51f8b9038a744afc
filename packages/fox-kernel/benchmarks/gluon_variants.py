"""A/B of Gluon tile configurations (rows of ``fox_kernel.ops.gluon.tiles``' tables) in one process: each
variant's error against float64 at small odd shapes, then forward and forward+backward times at the
training shapes, variants alternating over ``--rounds`` so that drift of the GPU's clock hits all alike.
cuDNN SDPA at the same shape is timed beside them for scale, with ``bench_attention.py``'s inputs and timing
(the median of ``triton.testing.do_bench``; exp2-split-h100-s18.json, gluon-tiles-dq3-fwd4-h100-s18.json
and gluon-stages-h100-s18.json hold do_bench's mean instead).
Prints a table and writes JSON.

    python packages/fox-kernel/benchmarks/gluon_variants.py --variants base dkdv-s3 --out variants.json

A variant replaces rows of the tile tables at head dim 64 (see VARIANTS).
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
from fox_kernel.ops.gluon import host
from fox_kernel.ops.gluon import tiles as ga
from fox_kernel.reference import forgetting_attention_ref
from fox_kernel.testing import max_abs_err, random_log_fgate

# name -> {table of gluon.tiles: its row at D=64}; "base" is what the package ships
VARIANTS = {
    "base": {},
    "dkdv-s3": {"GLUON_TILES": (64, 128, 3, 240, 24)},
    "dkdv-s4": {"GLUON_TILES": (64, 128, 4, 240, 24)},
    "dq-s3": {"GLUON_DQ_TILES": (128, 128, 3, 240, 24)},
    "fwd-s4": {"GLUON_FWD_FIXED_TILES": (192, 64, 4, 168, 24, 3)},
}
SHAPES = {  # name -> (B, T, H, Hkv)
    "16k-h12": (1, 16384, 12, 12),   # one layer of the 125M model
    "16k-h24": (1, 16384, 24, 24),   # 760M
    "16k-h32": (1, 16384, 32, 32),
    "8k-gqa": (2, 8192, 32, 8),
    "4k-h32": (4, 4096, 32, 32),
}
D = 64
BASE = {name: getattr(ga, name)[D] for name in ("GLUON_TILES", "GLUON_DQ_TILES", "GLUON_FWD_FIXED_TILES")}


def use(variant: str):
    for name, row in BASE.items():
        getattr(ga, name)[D] = VARIANTS[variant].get(name, row)
    host.forget_plans()  # the forward's recorded launches hold the tiles they were recorded with


def errors(seed=0):
    """Largest error of output and gradients against float64, relative to the float64 tensor's largest
    magnitude, at odd shapes (partial blocks, GQA, fast gates)."""
    out = {}
    for B, T, H, Hkv in ((2, 1000, 4, 4), (1, 777, 8, 2), (3, 300, 2, 2)):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(B, T, h, D, generator=g) for h in (H, Hkv, Hkv))
        lf = random_log_fgate((B, T, H), speed="fast", generator=g)
        do = torch.randn(B, T, H, D, generator=g)
        leaves = [x.to("cuda", torch.bfloat16).requires_grad_() for x in (q, k, v)] + [lf.cuda().requires_grad_()]
        got = forgetting_attention(*leaves)
        got = (got, *torch.autograd.grad(got, leaves, do.to("cuda", torch.bfloat16)))
        ref_leaves = [x.double().cuda().requires_grad_() for x in (q, k, v, lf)]
        ref = forgetting_attention_ref(*ref_leaves)
        ref = (ref, *torch.autograd.grad(ref, ref_leaves, do.double().cuda()))
        for name, a, r in zip(("out", "dq", "dk", "dv", "dlogf"), got, ref):
            out[name] = max(out.get(name, 0.0), max_abs_err(a, r) / r.abs().max().item())
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["base", "dkdv-s3"], choices=sorted(VARIANTS))
    ap.add_argument("--shapes", nargs="+", default=["16k-h12", "16k-h24"], choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="gluon_variants.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gluon_variants.py needs a CUDA GPU (the Gluon kernels run on Hopper)")

    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  python=platform.python_version(), head_dim=D,
                  variants={v: VARIANTS[v] for v in args.variants}, errors={}, times=[])
    for variant in args.variants:
        use(variant)
        result["errors"][variant] = errors()
        print(variant, "error vs float64:", {k: f"{e:.2e}" for k, e in result["errors"][variant].items()}, flush=True)

    cudnn, ours = _sdpa(SDPBackend.CUDNN_ATTENTION), _ours()
    for shape in args.shapes:
        B, T, H, Hkv = SHAPES[shape]
        inputs = _inputs(B, T, H, Hkv, D, gate_shift=3.5)  # a trained model's spread of gates, no pruning
        row = dict(shape=shape, contender="cuDNN", fwd_ms=[_time(cudnn, inputs, "fwd")],
                   fwd_bwd_ms=[_time(cudnn, inputs, "fwd+bwd")])
        result["times"].append(row)
        rows = {v: dict(shape=shape, contender=v, fwd_ms=[], fwd_bwd_ms=[]) for v in args.variants}
        for _ in range(args.rounds):
            for variant in args.variants:
                use(variant)
                rows[variant]["fwd_ms"].append(_time(ours, inputs, "fwd"))
                rows[variant]["fwd_bwd_ms"].append(_time(ours, inputs, "fwd+bwd"))
        result["times"].extend(rows.values())
        print(f"\n{shape} (B={B}, T={T}, H={H}, Hkv={Hkv}, D={D})")
        print(f"{'contender':>10} | {'fwd ms':>15} | {'bwd ms':>15} | {'fwd TFLOP/s':>11} | {'fwd+bwd TFLOP/s':>15}")
        for r in [row, *rows.values()]:
            r["bwd_ms"] = [b - f for f, b in zip(r["fwd_ms"], r["fwd_bwd_ms"])]
            print(f"{r['contender']:>10} | {' / '.join(f'{x:.3f}' for x in r['fwd_ms']):>15} | "
                  f"{' / '.join(f'{x:.3f}' for x in r['bwd_ms']):>15} | "
                  f"{_flops(B, H, T, D, 'fwd') / min(r['fwd_ms']) / 1e9:>11.1f} | "
                  f"{_flops(B, H, T, D, 'fwd+bwd') / min(r['fwd_bwd_ms']) / 1e9:>15.1f}", flush=True)
    use("base")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
