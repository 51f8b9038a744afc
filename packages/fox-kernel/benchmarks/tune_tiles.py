"""Sweep tile shapes of the three Triton passes and print the fastest per head dim (bf16, causal).

    python packages/fox-kernel/benchmarks/tune_tiles.py --out tiles.json

The winners go into ``fox_kernel.ops.triton.launch.TILES``.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from fox_kernel import KernelOptions
from fox_kernel.ops.call import AttentionCall
from fox_kernel.ops.triton import bwd, fwd, launch, sums

CANDIDATES = {
    "fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
            (128, 32, 4, 3), (128, 64, 8, 4), (64, 128, 4, 3), (128, 128, 4, 2), (128, 128, 8, 4),
            (256, 64, 8, 2), (256, 64, 8, 3), (256, 128, 8, 2)],
    "dkdv": [(32, 128, 4, 2), (32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 2), (64, 64, 8, 3),
             (128, 64, 8, 2), (32, 64, 4, 3), (64, 128, 4, 2), (16, 128, 4, 3), (64, 64, 4, 3)],
    # (64, 64, 4, 3) wins the dQ pass at D=64 on an H200 (10% off the next best, backward-tiles-h200-s9.json)
    "dq": [(128, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 3), (64, 64, 8, 3),
           (128, 64, 4, 2), (64, 32, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3),
           (64, 32, 4, 2)],
    # one-pass backward (dQ added with atomics): BLOCK_M query rows per step of a BLOCK_N key program
    "fused": [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 4, 2),
              (32, 128, 8, 2), (128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 8, 2), (32, 64, 4, 3),
              (64, 64, 8, 2)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tiles.json")
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--kinds", default="fwd,dkdv,dq,fused", help="comma-separated passes to sweep")
    args = ap.parse_args()
    original = launch.config
    chosen = {"fwd": {}, "dkdv": {}, "dq": {}, "fused": {}}
    results = []
    for D in (64, 128):
        B, T, H = 16384 // args.T, args.T, 2048 // D
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        lf = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 4)
        c = sums.prefix_sums(lf, None)
        call = AttentionCall(D**-0.5, options=KernelOptions())
        out, lse, _ = fwd.forward(q, k, v, c, call, True)
        do = torch.randn_like(q)
        delta = sums.delta(out, do)
        flops = 4 * B * H * T * T * D / 2
        for kind in args.kinds.split(","):
            one_pass = kind == "fused"
            best = None
            for bm, bn, w, st in CANDIDATES[kind]:
                trial = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)

                def patched(k_, head_dim, dtype, device, trial=trial, kind=kind):
                    cfg = original(k_, head_dim, dtype, device)
                    if k_ == kind:
                        cfg.update(trial)
                    elif k_ in chosen and D in chosen[k_]:
                        cfg.update(chosen[k_][D])
                    return cfg
                launch.config = patched
                try:
                    if kind == "fwd":
                        ms = triton.testing.do_bench(
                            lambda: fwd.forward(q, k, v, c, call, True),
                            warmup=25, rep=100, return_mode="median")
                    else:
                        ms = triton.testing.do_bench(
                            lambda: bwd.backward(do, q, k, v, c, lse, delta, call, one_pass),
                            warmup=25, rep=100, return_mode="median")
                except Exception as e:  # out of shared memory / registers: not a candidate here
                    print(f"{kind} D={D} {trial}: {type(e).__name__}")
                    continue
                finally:
                    launch.config = original
                tflops = flops * (1.0 if kind == "fwd" else 2.5) / ms / 1e9
                results.append(dict(kind=kind, D=D, T=T, **trial, ms=ms, tflops=tflops))
                print(f"{kind:5s} D={D:3d} BM={bm:3d} BN={bn:3d} w={w} st={st}: {ms:7.3f} ms  {tflops:6.1f} TFLOP/s"
                      + ("" if kind == "fwd" else " (whole backward)"))
                if best is None or ms < best[0]:
                    best = (ms, trial)
            chosen[kind][D] = best[1]
            print(f"best {kind} D={D}: {best[1]} {best[0]:.3f} ms")
    print(json.dumps(chosen, indent=1))
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       chosen={k: {str(d): c for d, c in v.items()} for k, v in chosen.items()}, results=results), f, indent=1)


if __name__ == "__main__":
    main()
