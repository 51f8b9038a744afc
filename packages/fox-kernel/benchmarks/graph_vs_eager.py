"""GPU time against eager time of Forgetting Attention and decoding, for the ``fox_kernel`` on the path.

Each case is timed three ways: ``triton.testing.do_bench`` over eager calls (what a Python loop sees),
``do_bench_cudagraph`` over the same call captured in a CUDA graph (the GPU's time alone, no host work) and
the host time per call with launches queued and one synchronisation at the end. Where the eager time is above
the graph time, the call waits on its host. Cases: a tiny forward and forward+backward (GPU work
negligible: host cost), the ``bench_attention.py`` 4k and 16k shapes (bf16, causal), and decoding against
a full cache (GQA 32/8, D=128) beside SDPA without a gate. Run it once per source tree (``PYTHONPATH``) to
compare two versions of the kernels on one machine; prints each case and writes JSON.

    python packages/fox-kernel/benchmarks/graph_vs_eager.py --tag after --out graph-vs-eager.json
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F
import triton
from host_overhead import host_us  # this folder's: host time per call, one synchronisation at the end
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

from fox_kernel import forgetting_attention, forgetting_attention_with_kvcache
from fox_kernel.testing import decode_inputs

SHAPES = ((1, 64, 2, 64), (4, 4096, 32, 64), (4, 4096, 16, 128), (1, 16384, 16, 128))  # B, T, H, D
DECODE = ((1, 64), (64, 4096), (8, 32768))  # B, T at H=32, Hkv=8, D=128


def inputs(B, T, H, D):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return q, k, v, F.logsigmoid(torch.randn(B, T, H, device="cuda") + 4.0)


def attention_rows(res):
    for B, T, H, D in SHAPES:
        q, k, v, lf = inputs(B, T, H, D)
        key = f"B{B}_T{T}_H{H}_D{D}"
        with torch.no_grad():
            def fwd():
                return forgetting_attention(q, k, v, lf)

            res[key + "_fwd_loop_ms"] = do_bench(fwd, warmup=50, rep=200, return_mode="median")
            res[key + "_fwd_graph_ms"] = do_bench_cudagraph(fwd, rep=200, return_mode="median")
            res[key + "_fwd_host_us"] = host_us(fwd, 300)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                def cudnn():
                    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          is_causal=True)

                res[key + "_cudnn_fwd_loop_ms"] = do_bench(cudnn, warmup=50, rep=200, return_mode="median")
        leaves = [x.detach().requires_grad_() for x in (q, k, v, lf)]
        do = torch.randn_like(q)

        def step():
            return torch.autograd.grad(forgetting_attention(*leaves), leaves, do)

        res[key + "_fb_loop_ms"] = do_bench(step, warmup=30, rep=200, return_mode="median")
        res[key + "_fb_host_us"] = host_us(step, 100)
        print(res["tag"], key, {name: round(x, 4) for name, x in res.items() if name.startswith(key)}, flush=True)


def decode_rows(res):
    for B, T in DECODE:
        q, k, v, c, lens = decode_inputs(B, T, 32, 8, 128)
        key = f"decode_B{B}_T{T}"

        def ours():
            return forgetting_attention_with_kvcache(q, k, v, c, lens)

        res[key + "_loop_ms"] = do_bench(ours, warmup=50, rep=200, return_mode="median")
        res[key + "_graph_ms"] = do_bench_cudagraph(ours, rep=200, return_mode="median")
        res[key + "_host_us"] = host_us(ours, 300)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def sdpa():
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        res[key + "_sdpa_loop_ms"] = do_bench(sdpa, warmup=50, rep=200, return_mode="median")
        res[key + "_sdpa_graph_ms"] = do_bench_cudagraph(sdpa, rep=200, return_mode="median")
        print(res["tag"], key, {name: round(x, 4) for name, x in res.items() if name.startswith(key)}, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tag", default="run", help="a name for this source tree in the JSON (e.g. before, after)")
    p.add_argument("--out", default="graph_vs_eager.json")
    args = p.parse_args()
    res = {"tag": args.tag, "env": dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                        triton=triton.__version__, python=platform.python_version())}
    attention_rows(res)
    decode_rows(res)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
