"""The eager pruned forward on bench_attention's fastest gates (T=16k, D=128 and 64): does a call wait on
the GPU, and is it host-bound?

For our call with the "auto" bound (gates of 0 allowed, the default), the same with ``zero_gates=False``, and
the exact call, without autograd: whether PyTorch's synchronisation check (``set_sync_debug_mode("error")``)
catches a wait inside one call; the host time per call with 30 calls queued; the time per call of 30 calls
back to back between two CUDA events; ``triton.testing.do_bench`` (bench_attention's eager timer) three
times, and three more with Python's garbage collector off. Prints one line per call and writes JSON.

    python packages/fox-kernel/benchmarks/eager_pruned_forward.py --out eager-pruned-forward.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import bench_attention as ba
import torch


def check(fn, args, calls: int = 30) -> dict:
    with torch.no_grad():
        for _ in range(5):
            fn(*args)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a wait inside the call raises here
        try:
            fn(*args)
            sync = "none"
        except RuntimeError as e:
            sync = str(e)[:300]
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        host = (time.perf_counter() - t) / calls * 1e6
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            fn(*args)
        e1.record()
        torch.cuda.synchronize()
        queued = e0.elapsed_time(e1) / calls
        bench = [ba._time(fn, args, "fwd") for _ in range(3)]  # bench_attention's eager forward timer
        gc.disable()
        bench_nogc = [ba._time(fn, args, "fwd") for _ in range(3)]
        gc.enable()
    return dict(sync=sync, host_us_queued=host, ms_back_to_back=queued, do_bench_ms=bench, do_bench_nogc_ms=bench_nogc)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="eager-pruned-forward.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("eager_pruned_forward.py needs a CUDA GPU")
    torch.manual_seed(0)
    fast = ba.GATES[next(g for g in ba.GATES if g.startswith("fast"))]
    out = {}
    for D, H in ((128, 16), (64, 32)):
        inputs = ba._inputs(1, 16384, H, H, D, gate_shift=fast)
        res = {}
        for name, fn in {"auto": ba._ours(adaptive_threshold="auto"),
                         "auto zg=False": ba._ours(adaptive_threshold="auto", zero_gates=False),
                         "exact": ba._ours()}.items():
            res[name] = check(fn, inputs)
            print(D, name, json.dumps(res[name]), flush=True)
        out[f"D={D}"] = res
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
