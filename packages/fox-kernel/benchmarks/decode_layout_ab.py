"""The layout of the cached prefix sums in decoding, side by side: token-major, a contiguous (B, T, H) tensor,
against head-major, the same (B, T, H) values stored as (B, H, T) (``fox_kernel.gate_cache``'s layout), with
SDPA without a gate, in interleaved rounds on one GPU. A decoding program reads the prefix sums of its
key/value head's query heads: token-major, 4 x 4 bytes a token in a 32-byte sector shared with another
head group; head-major, runs of whole sectors. Both layouts must give the same output. Prints the bandwidth
(the cache's K/V bytes over the median time) of every round and writes JSON.

    python packages/fox-kernel/benchmarks/decode_layout_ab.py --out decode-layout-ab.json [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
import torch.nn.functional as F
import triton

from fox_kernel import forgetting_attention_with_kvcache
from fox_kernel.testing import decode_inputs, head_major

SHAPES = [(8, 32768, 32, 8, 128), (64, 4096, 32, 8, 128), (1, 131072, 32, 8, 128), (8, 16384, 32, 8, 128),
          (32, 8192, 32, 8, 128)]
PAGE = 256


def paged(x: torch.Tensor, perm: torch.Tensor, page: int) -> torch.Tensor:
    """x (B, T, ...) cut into pages of ``page`` tokens, page i of the flattened cache at pool slot perm[i]."""
    pool = torch.empty(x.shape[0] * x.shape[1] // page, page, *x.shape[2:], device=x.device, dtype=x.dtype)
    pool[perm] = x.reshape(-1, page, *x.shape[2:])
    return pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="decode-layout-ab.json")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    results = dict(env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                            python=platform.python_version()), shapes={})
    for B, T, H, Hkv, D in SHAPES:
        q, k, v, c, lens = decode_inputs(B, T, H, Hkv, D)
        kv_bytes = 2 * k.numel() * k.element_size()
        perm = torch.randperm(B * T // PAGE, device="cuda")
        table = perm.view(B, T // PAGE).to(torch.int32)
        kp, vp = paged(k, perm, PAGE), paged(v, perm, PAGE)
        calls = {
            "token-major": (q, k, v, c, lens),
            "head-major": (q, k, v, head_major(c), lens),
            f"paged {PAGE}, token-major": (q, kp, vp, paged(c, perm, PAGE), lens, None, table),
            f"paged {PAGE}, head-major": (q, kp, vp, head_major(paged(c, perm, PAGE)), lens, None, table),
        }
        ref = forgetting_attention_with_kvcache(*calls["token-major"]).float()
        for name, call in calls.items():
            got = forgetting_attention_with_kvcache(*call[:5], block_table=call[6] if len(call) > 5 else None)
            err = (got.float() - ref).abs().max().item()
            assert err < 2e-2, f"{name} differs from token-major by {err}"
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        timed = {"sdpa without a gate": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)}
        for name, call in calls.items():
            table_ = call[6] if len(call) > 5 else None
            timed[name] = lambda call=call, table_=table_: forgetting_attention_with_kvcache(*call[:5],
                                                                                             block_table=table_)
        row = results["shapes"].setdefault(f"B={B} T={T} H={H} Hkv={Hkv} D={D}", {})
        for r in range(args.rounds):
            names = list(timed)
            for name in names[r % len(names):] + names[:r % len(names)]:  # each round starts at the next
                ms = triton.testing.do_bench(timed[name], warmup=25, rep=100, return_mode="median")
                row.setdefault(name, []).append(kv_bytes / ms / 1e9)
        print(f"B={B} T={T} H={H} Hkv={Hkv} D={D} (TB/s per round; median; / SDPA):", flush=True)
        sdpa = statistics.median(row["sdpa without a gate"])
        for name, values in row.items():
            med = statistics.median(values)
            print(f"  {name:28s} {' '.join(f'{x:.3f}' for x in values)}  median {med:.3f}  {med / sdpa:.3f}")
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
