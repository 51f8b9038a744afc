"""The GQA decode launch side by side: two or three pipeline stages, the cache split rounded up or down to
one wave of programs (``fox_kernel.ops.triton.decode.TILES`` and ``_num_splits``), against SDPA without a
gate, in interleaved rounds on one GPU. Each setting's output is checked against the first's. Prints the
bandwidth (the cache's K/V bytes over the median time) of every round and writes JSON.

    python packages/fox-kernel/benchmarks/decode_splits_ab.py --out decode-splits-ab.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from fox_kernel import forgetting_attention_with_kvcache
from fox_kernel.ops.triton import decode as triton_decode
from fox_kernel.testing import decode_inputs

SETTINGS = {
    "two stages, split rounded up": dict(block_n=64, num_stages=2, num_warps=4, programs_per_sm=2, one_wave=False),
    "three stages, split rounded up": dict(block_n=64, num_stages=3, num_warps=4, programs_per_sm=2, one_wave=False),
    "three stages, one wave": dict(block_n=64, num_stages=3, num_warps=4, programs_per_sm=2, one_wave=True),
    "two stages, 3 per SM, one wave": dict(block_n=64, num_stages=2, num_warps=4, programs_per_sm=3, one_wave=True),
}
SHAPES = [(8, 32768, 32, 8, 128), (64, 4096, 32, 8, 128), (1, 131072, 32, 8, 128), (8, 16384, 32, 8, 128),
          (32, 8192, 32, 8, 128)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="decode-splits-ab.json")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    default = dict(triton_decode.TILES)
    results = {}
    for B, T, H, Hkv, D in SHAPES:
        q, k, v, c, lens = decode_inputs(B, T, H, Hkv, D)
        kv_bytes = 2 * k.numel() * k.element_size()
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        ref = None
        for tiles in SETTINGS.values():  # compile each and check it against the first
            triton_decode.TILES.update(tiles)
            out = forgetting_attention_with_kvcache(q, k, v, c, lens).float()
            ref = out if ref is None else ref
            assert (out - ref).abs().max().item() < 2e-2, "a decode setting gives other outputs"
        row = results.setdefault(f"B={B} T={T}", {})
        for _ in range(args.rounds):
            ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
                                         warmup=25, rep=100, return_mode="median")
            row.setdefault("sdpa without a gate", []).append(kv_bytes / ms / 1e9)
            for name, tiles in SETTINGS.items():
                triton_decode.TILES.update(tiles)
                ms = triton.testing.do_bench(lambda: forgetting_attention_with_kvcache(q, k, v, c, lens),
                                             warmup=25, rep=100, return_mode="median")
                row.setdefault(name, []).append(kv_bytes / ms / 1e9)
        print(f"B={B} T={T} H={H} Hkv={Hkv} D={D} (TB/s per round):", flush=True)
        for name, values in row.items():
            print(f"  {name:34s} " + " ".join(f"{x:5.2f}" for x in values), flush=True)
    triton_decode.TILES.update(default)
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, settings=SETTINGS, tbps=results), f, indent=1)


if __name__ == "__main__":
    main()
