"""How much of a training step's gap to the Transformer is attention: the attention op alone at the shapes
of one layer of the paper's models (batch 1 x 16k tokens, bf16, forward + backward), FoX at its head dim
64 against cuDNN SDPA at head dim 64 and at the Transformer's head dim 128 (same hidden size, so the same
matmul FLOPs). Multiplied by the number of layers, it is the attention share of one training step.

    python packages/fox-train/benchmarks/attention_gap.py --sizes 125m 760m --out gap.json

Prints a table and writes JSON. CUDA events, mean of ``--iters`` calls after warm-up.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fox_kernel import forgetting_attention
from fox_models.fox import SIZES


def gpu_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _inputs(T, H, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]


def fox_calls(T, H, D):
    q, k, v, do = _inputs(T, H, D)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    # a trained model's spread of gates (mean log f about -0.03, no pruning)
    lf = F.logsigmoid(torch.randn(1, T, H, device="cuda") + 3.5).requires_grad_()

    def fwd():
        with torch.no_grad():
            forgetting_attention(q, k, v, lf)

    def fwd_bwd():
        forgetting_attention(q, k, v, lf).backward(do)

    return fwd, fwd_bwd


def cudnn_calls(T, H, D):
    q, k, v, do = (t.transpose(1, 2).contiguous() for t in _inputs(T, H, D))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    return fwd, fwd_bwd


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["125m", "760m"], choices=sorted(SIZES))
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="attention_gap.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_gap.py needs a CUDA GPU")
    T = args.seq_len
    rows = []
    for size in args.sizes:
        hidden, layers, heads = SIZES[size]
        for name, make, H in [("FoX (ours), head dim 64", fox_calls, heads),
                              ("cuDNN SDPA, head dim 64", cudnn_calls, heads),
                              ("cuDNN SDPA, head dim 128", cudnn_calls, hidden // 128)]:
            fwd, fwd_bwd = make(T, H, hidden // H)
            row = dict(size=size, kernel=name, heads=H, head_dim=hidden // H, layers=layers,
                       fwd_ms=gpu_ms(fwd, args.iters), fwd_bwd_ms=gpu_ms(fwd_bwd, args.iters))
            row["step_share_ms"] = row["fwd_bwd_ms"] * layers
            rows.append(row)
            torch.cuda.empty_cache()
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, seq_len=T)
    print(" | ".join(f"{k}={v}" for k, v in env.items()))
    print(f"{'size':5s} {'kernel':26s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'x layers':>9s} {'vs FoX':>7s}")
    for r in rows:
        fox = next(x for x in rows if x["size"] == r["size"] and x["kernel"].startswith("FoX"))
        print(f"{r['size']:5s} {r['kernel']:26s} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:11.3f} "
              f"{r['step_share_ms']:9.1f} {fox['fwd_bwd_ms'] / r['fwd_bwd_ms']:6.2f}x")
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
