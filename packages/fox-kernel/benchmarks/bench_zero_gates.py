"""What exact gates of 0 cost: forward and forward+backward of ``forgetting_attention`` with the passes that
re-run the tiles behind a gate of 0 (``ops/dispatch.py``) against the same call without them, on gates
holding none (the passes' programs only read one number each and return), and on a row packed with
documents separated by gates of 0 against the same documents as ``cu_seqlens``. bf16, B*T = 16384 tokens,
H*D = 2048 (``bench_attention.py``'s shapes). Prints a table and writes JSON.

    python packages/fox-kernel/benchmarks/bench_zero_gates.py --out zero-gates.json
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F
import triton

from fox_kernel import forgetting_attention
from fox_kernel.ops.triton import bwd, fwd

SHAPES = [(1, 16384, 16, 128), (1, 16384, 32, 64), (8, 2048, 16, 128), (8, 2048, 32, 64)]
DOC = 1024  # document length of the packed rows


def _time(fn, mode):
    if mode == "fwd":
        with torch.no_grad():
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def step():
        out = fn()
        out.backward(torch.ones_like(out))

    return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")


class _Without:
    """The kernels with the zero-gate passes left out (exact only for gates without a 0)."""

    def __enter__(self):
        self.saved = fwd.forward_zero_gates, bwd.backward_zero_gates
        fwd.forward_zero_gates = bwd.backward_zero_gates = lambda *a, **k: None

    def __exit__(self, *exc):
        fwd.forward_zero_gates, bwd.backward_zero_gates = self.saved


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="zero-gates.json")
    args = parser.parse_args()
    rows = []
    for B, T, H, D in SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        lf = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 4.0).requires_grad_()
        marked = lf.detach().clone()
        marked[:, DOC::DOC] = float("-inf")
        marked.requires_grad_()
        n_docs = B * T // DOC
        cu = torch.arange(0, n_docs + 1, device="cuda", dtype=torch.int32) * DOC
        flat = [x.detach().reshape(1, B * T, *x.shape[2:]).requires_grad_() for x in (q, k, v, lf)]
        for mode in ("fwd", "fwd+bwd"):
            with_passes = _time(lambda: forgetting_attention(q, k, v, lf), mode)
            with _Without():
                without = _time(lambda: forgetting_attention(q, k, v, lf), mode)
            documents = _time(lambda: forgetting_attention(q, k, v, marked), mode)
            packed = _time(lambda: forgetting_attention(*flat, cu_seqlens=cu), mode)
            row = dict(B=B, T=T, H=H, D=D, mode=mode, ms_with_passes=with_passes, ms_without_passes=without,
                       overhead=with_passes / without - 1, ms_documents_by_zero_gates=documents,
                       ms_documents_by_cu_seqlens=packed)
            rows.append(row)
            print(f"B={B} T={T:>5} H={H} D={D:>3} {mode:>7}: no zeros {with_passes:7.3f} ms vs {without:7.3f} ms "
                  f"without the passes ({100 * row['overhead']:+.1f}%); {T // DOC} docs/row by gates of 0 "
                  f"{documents:7.3f} ms, by cu_seqlens {packed:7.3f} ms", flush=True)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version())
    with open(args.out, "w") as f:
        json.dump(dict(env=env, doc_len=DOC, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
