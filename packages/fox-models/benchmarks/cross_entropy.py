"""The lm-head + per-token cross-entropy: fused (Triton) against the unfused chunked path, one GPU.

For each hidden size: forward and forward+backward time of ``per_token_cross_entropy`` on ``--tokens``
tokens (bf16 autocast, float32 weight, GPT-2's vocabulary padded to 128) and the peak memory each adds
above its inputs. Prints a table and writes JSON.

    python packages/fox-models/benchmarks/cross_entropy.py --tokens 16384 --hidden 768 1536 --out ce.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.testing import do_bench

from fox_models.loss import per_token_cross_entropy


def measure(tokens, hidden, vocab, fused):
    torch.manual_seed(0)
    h = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda") * hidden**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), device="cuda")

    def fwd():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return per_token_cross_entropy(h, w, labels, fused=fused)

    def fwd_bwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = per_token_cross_entropy(h, w, labels, fused=fused)
        loss.mean().backward()
        h.grad = w.grad = None

    fwd_bwd()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return dict(tokens=tokens, hidden=hidden, vocab=vocab, fused=fused, fwd_ms=do_bench(fwd),
                fwd_bwd_ms=do_bench(fwd_bwd), extra_peak_gib=peak)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, nargs="+", default=[768, 1536])
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--out", default="cross_entropy.json")
    args = ap.parse_args()
    rows = [measure(args.tokens, d, args.vocab, fused) for d in args.hidden for fused in (False, True)]
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    print(" | ".join(f"{k}={v}" for k, v in env.items()))
    print(f"{'tokens':>7s} {'hidden':>6s} {'loss':8s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'extra GiB':>10s} {'speed-up':>9s}")
    for r in rows:
        plain = next(p for p in rows if p["hidden"] == r["hidden"] and not p["fused"])
        print(f"{r['tokens']:7d} {r['hidden']:6d} {'fused' if r['fused'] else 'unfused':8s} {r['fwd_ms']:8.2f} "
              f"{r['fwd_bwd_ms']:11.2f} {r['extra_peak_gib']:10.2f} {plain['fwd_bwd_ms'] / r['fwd_bwd_ms']:8.2f}x")
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
