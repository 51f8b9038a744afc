"""Sweeps the decode kernel's launch (``fox_kernel.ops.triton.decode.TILES`` and ``TILES_ONE_HEAD``, set to
the same values: keys per tile, pipeline stages, warps, programs per SM) at the shapes of a model's decoding step, and prints the bandwidth of each
(the cache's K/V bytes over the median time) beside SDPA without a gate. Each setting's
output is checked against the default one's.

    python packages/fox-kernel/benchmarks/tune_decode.py --out tune-decode.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from fox_kernel import forgetting_attention_with_kvcache
from fox_kernel.ops.triton import decode as triton_decode
from fox_kernel.testing import decode_inputs

# (B, T, H, Hkv, D): the 125M models at batch 32 and 1 (16k and 2k tokens), the 760M model, and a GQA cache
SHAPES = [(32, 16384, 12, 12, 64), (32, 2048, 12, 12, 64), (1, 16384, 12, 12, 64), (8, 16384, 12, 12, 128),
          (8, 32768, 32, 8, 128)]
# --gqa: the three GQA decoding shapes of the kernel README's table (32 query heads on 8 KV heads, D=128)
GQA_SHAPES = [(8, 32768, 32, 8, 128), (64, 4096, 32, 8, 128), (1, 131072, 32, 8, 128)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tune-decode.json")
    ap.add_argument("--gqa", action="store_true", help="only the GQA shapes (GQA_SHAPES), which take TILES")
    args = ap.parse_args()
    defaults = (dict(triton_decode.TILES), dict(triton_decode.TILES_ONE_HEAD))

    def use(tiles=None):
        for table, default in zip((triton_decode.TILES, triton_decode.TILES_ONE_HEAD), defaults):
            table.update(tiles or default)

    grid = [dict(block_n=n, num_stages=s, num_warps=w, programs_per_sm=p)
            for n, s, w, p in itertools.product((64, 128), (2, 3, 4), (4, 8), (2, 4, 8))]
    rows = []
    for B, T, H, Hkv, D in GQA_SHAPES if args.gqa else SHAPES:
        q, k, v, c, lens = decode_inputs(B, T, H, Hkv, D)
        kv_bytes = 2 * k.numel() * k.element_size()
        use()
        ref = forgetting_attention_with_kvcache(q, k, v, c, lens)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        sdpa = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
                                       warmup=25, rep=100, return_mode="median")
        best = None
        for tiles in grid:
            use(tiles)
            try:
                out = forgetting_attention_with_kvcache(q, k, v, c, lens)
                err = (out.float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(lambda: forgetting_attention_with_kvcache(q, k, v, c, lens),
                                             warmup=25, rep=100, return_mode="median")
            except Exception as e:  # a setting that does not compile (shared memory) is skipped
                rows.append(dict(B=B, T=T, H=H, Hkv=Hkv, D=D, **tiles, error=str(e).splitlines()[0][:120]))
                continue
            row = dict(B=B, T=T, H=H, Hkv=Hkv, D=D, **tiles, ms=ms, TBps=kv_bytes / ms / 1e9, max_err=err,
                       sdpa_ms=sdpa, sdpa_TBps=kv_bytes / sdpa / 1e9,
                       default=tiles == defaults[1 if Hkv == H and D <= 128 else 0])
            rows.append(row)
            if best is None or ms < best["ms"]:
                best = row
        use()
        dflt = next(r for r in rows if r.get("default") and (r["B"], r["T"], r["D"], r["H"]) == (B, T, D, H))
        print(f"B={B} T={T} H={H} Hkv={Hkv} D={D}: default {dflt['TBps']:.2f} TB/s, best {best['TBps']:.2f} TB/s "
              f"(n={best['block_n']} stages={best['num_stages']} warps={best['num_warps']} "
              f"p/SM={best['programs_per_sm']}, err {best['max_err']:.1e}), SDPA {best['sdpa_TBps']:.2f} TB/s",
              flush=True)
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
