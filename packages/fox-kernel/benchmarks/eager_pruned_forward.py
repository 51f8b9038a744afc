"""The eager pruned forward on bench_attention's fastest gates (T=16k, D=128 and 64): does a call wait on
the GPU, and is it host-bound?

For our call with the "auto" bound (gates of 0 allowed, the default), the same with ``zero_gates=False``, and
the exact call, without autograd: whether PyTorch's synchronisation check (``set_sync_debug_mode("error")``)
catches a wait inside one call; the host time per call with 30 calls queued; the time per call of 30 calls
back to back between two CUDA events; ``triton.testing.do_bench`` (bench_attention's eager timer) three
times, and three more with Python's garbage collector off. Prints one line per call and writes JSON.

With ``--profile``, for the two "auto" calls instead: whether each call launched the pass for gates of exactly
0 (``dispatch._zero_passes_due``), with the GPU idle between calls and with calls queued; ``do_bench`` three
times; the host time per call with 100 calls queued under cProfile, and its table; the median host time of
one call with the GPU idle; and PyTorch's profiler tables (CUDA and CPU time) over 20 calls.

    python packages/fox-kernel/benchmarks/eager_pruned_forward.py --out eager-pruned-forward.json
    python packages/fox-kernel/benchmarks/eager_pruned_forward.py --profile --out eager-pruned-profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
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


def profile(fn, args) -> dict:
    """``--profile``'s record of one call (see the module's docstring)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from fox_kernel.ops import dispatch

    r = {}
    with torch.no_grad():
        for _ in range(10):
            fn(*args)
        torch.cuda.synchronize()
        due, plain = [], dispatch._zero_passes_due

        def spy(z, seen):
            due.append(plain(z, seen))
            return due[-1]

        dispatch._zero_passes_due = spy
        try:
            for _ in range(5):  # the GPU idle when each call starts
                fn(*args)
                torch.cuda.synchronize()
                time.sleep(0.01)
            r["zero_pass_due_idle"], due[:] = list(due), []
            for _ in range(20):
                fn(*args)
            r["zero_pass_due_queued"] = list(due)
        finally:
            dispatch._zero_passes_due = plain
        torch.cuda.synchronize()
        r["do_bench"] = [ba._time(fn, args, "fwd") for _ in range(3)]
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        t = time.perf_counter()
        for _ in range(100):
            fn(*args)
        r["host_us_per_call_queued"] = (time.perf_counter() - t) * 1e4
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        r["cprofile"] = text.getvalue()
        idle = []
        for _ in range(50):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn(*args)
            idle.append((time.perf_counter() - t) * 1e6)
        r["host_us_idle_median"] = sorted(idle)[25]
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            for _ in range(20):
                fn(*args)
            torch.cuda.synchronize()
        r["prof_cuda"] = tp.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        r["prof_cpu"] = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="eager-pruned-forward.json")
    ap.add_argument("--profile", action="store_true", help="profile the two auto calls (see above)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("eager_pruned_forward.py needs a CUDA GPU")
    torch.manual_seed(0)
    fast = ba.GATES[next(g for g in ba.GATES if g.startswith("fast"))]
    out = {}
    for D, H in ((128, 16), (64, 32)):
        inputs = ba._inputs(1, 16384, H, H, D, gate_shift=fast)
        calls = {"auto": ba._ours(adaptive_threshold="auto"),
                 "auto zg=False": ba._ours(adaptive_threshold="auto", zero_gates=False)}
        if args.profile:
            for name, fn in calls.items():
                r = out[f"D={D} {name}"] = profile(fn, inputs)
                print(D, name, r["do_bench"], r["host_us_per_call_queued"], r["host_us_idle_median"],
                      "zero pass idle", r["zero_pass_due_idle"], "queued", r["zero_pass_due_queued"][:5], flush=True)
                print(r["cprofile"], r["prof_cuda"], r["prof_cpu"], sep="\n", flush=True)
            continue
        res = {}
        for name, fn in {**calls, "exact": ba._ours()}.items():
            res[name] = check(fn, inputs)
            print(D, name, json.dumps(res[name]), flush=True)
        out[f"D={D}"] = res
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
