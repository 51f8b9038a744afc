"""Adaptive computation pruning side by side with the official pruning kernel, with a per-kernel profile.

For fast, medium and slow gates (B=1, T=16k, H*D=2048, bf16) times the forward, forward+backward and (their
difference) the backward, each as an eager call (host time included: at these sizes a pruned call can wait
on its host) and replayed from a CUDA graph (GPU time alone), of: ours exact, ours pruned with the "auto" bound, ours pruned with one per-head
bound, the same with the Gluon kernels off, and, given ``--official PATH`` (a local copy of the pruning
paper's ``forgetting_attention.py``; it needs einops), the official kernel exact and pruned with that same
per-head bound. ``--profile`` adds each contender's CUDA kernels (time per call) on the fastest gates.
Prints tables and writes JSON.

    python packages/fox-kernel/benchmarks/bench_pruning.py --official PATH --profile --out pruning.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform

import torch
import torch.nn.functional as F
import triton

from fox_kernel import current_options, forgetting_attention
from fox_kernel.ops.triton import launch
from fox_kernel.pruning import pruning_threshold

GATES = {"fast (mean log f ~ -0.18)": 1.7, "medium (mean log f ~ -0.018)": 4.0, "slow (mean log f ~ -0.0006)": 7.4}
SHAPES = [(1, 16384, 16, 128), (1, 16384, 32, 64)]


def gate_shift(speed: str) -> float:
    """The shift of GATES' "fast", "medium" or "slow" gates."""
    return next(shift for label, shift in GATES.items() if label.startswith(speed))


def _flops(B, H, T, D, mode):
    fwd = 4 * B * H * T * T * D / 2
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def _load_official(path):
    spec = importlib.util.spec_from_file_location("official_pruning_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.forgetting_attention


def contenders(official_path):
    """name -> fn(q, k, v, lf, per_head_threshold)."""
    opts = current_options()
    out = {
        "ours exact": lambda q, k, v, lf, t: forgetting_attention(q, k, v, lf),
        "ours auto": lambda q, k, v, lf, t: forgetting_attention(q, k, v, lf, adaptive_threshold="auto"),
        "ours per-head": lambda q, k, v, lf, t: forgetting_attention(q, k, v, lf, adaptive_threshold=t),
        "ours per-head triton": lambda q, k, v, lf, t: forgetting_attention(
            q, k, v, lf, adaptive_threshold=t, options=opts.replace(gluon=False)),
        # as fox-layers' layers call the kernel: no zero-gate launches (their gates are never 0)
        "ours exact, zero_gates=False": lambda q, k, v, lf, t: forgetting_attention(q, k, v, lf, zero_gates=False),
        "ours auto, zero_gates=False": lambda q, k, v, lf, t: forgetting_attention(
            q, k, v, lf, adaptive_threshold="auto", zero_gates=False),
        "ours per-head, zero_gates=False": lambda q, k, v, lf, t: forgetting_attention(
            q, k, v, lf, adaptive_threshold=t, zero_gates=False),
    }
    if official_path:
        official = _load_official(official_path)
        out["official exact"] = lambda q, k, v, lf, t: official(q, k, v, lf)
        out["official per-head"] = lambda q, k, v, lf, t: official(q, k, v, lf, adaptive_threshold=t)
    return out


def _inputs(B, T, H, D, shift):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lf = F.logsigmoid(torch.randn(B, T, H, device="cuda") + shift)
    # one bound per head, the same for both kernels: the q/k-norm bound over the whole batch (ln eps = -10)
    t = pruning_threshold(q, k, D**-0.5, T).amin(dim=0)
    return q, k, v, lf, t


def _time(fn, args, mode):
    if mode == "fwd":
        with torch.no_grad():
            return triton.testing.do_bench(lambda: fn(*args), warmup=30, rep=150, return_mode="median")
    leaves = [x.detach().requires_grad_() for x in args[:4]]
    do = torch.randn_like(args[0])

    def step():
        torch.autograd.grad(fn(*leaves, args[4]), leaves, do)
    return triton.testing.do_bench(step, warmup=30, rep=150, return_mode="median")


def capture_graph(fn, args, mode):
    """The call ``_time`` times, captured once in a CUDA graph (compiled and allocated outside the capture);
    its ``replay`` runs the same kernels without the host's Python and launch cost."""
    leaves = [x.detach().requires_grad_(mode != "fwd") for x in args[:4]]
    do = torch.randn_like(args[0])

    def call():
        if mode == "fwd":
            with torch.no_grad():
                fn(*leaves, args[4])
        else:  # allow_unused: bench_attention.py's SDPA cells take no gates
            torch.autograd.grad(fn(*leaves, args[4]), leaves, do, allow_unused=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def alternating_args(doc: str, rounds: int, out: str):
    """The command line of a script timing with ``alternate``: --rounds (at least 1), --rep, --out."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=rounds, help=f"rounds of alternating calls (default {rounds})")
    ap.add_argument("--rep", type=int, default=60, help="milliseconds do_bench spends on each timing (default 60)")
    ap.add_argument("--out", default=out)
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    return args


def rotated(names: list, r: int) -> list:
    """``names`` in round ``r``'s order: from the r-th (counting round) on, then those before it, so that
    none always follows the same one."""
    r %= len(names)
    return names[r:] + names[:r]


def in_rotating_rounds(calls: dict, rounds: int, timer) -> dict:
    """name -> ``timer(calls[name])`` in each of ``rounds`` rounds, the names in ``rotated`` order, so slow
    drifts of the clock, the memory or the host land on all of them alike."""
    names = list(calls)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            times[name].append(timer(calls[name]))
    return times


def alternate(graphs: dict, rounds: int, rep: int) -> dict:
    """name -> GPU milliseconds per round of each captured graph, replayed in rotating rounds."""
    return in_rotating_rounds(
        graphs, rounds, lambda graph: triton.testing.do_bench(graph.replay, warmup=10, rep=rep, return_mode="median"))


def _time_graph(fn, args, mode):
    """``_time`` of the same call replayed from a CUDA graph: the GPU time alone (what a
    ``torch.compile(mode="reduce-overhead")`` step pays)."""
    return triton.testing.do_bench(capture_graph(fn, args, mode).replay, warmup=30, rep=150, return_mode="median")


def _profile(fn, args):
    """(kernel name, microseconds per call, calls per step) of one forward+backward, summed over 10 steps."""
    from torch.profiler import ProfilerActivity, profile

    leaves = [x.detach().requires_grad_() for x in args[:4]]
    do = torch.randn_like(args[0])
    for _ in range(3):
        torch.autograd.grad(fn(*leaves, args[4]), leaves, do)
    torch.cuda.synchronize()
    steps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.autograd.grad(fn(*leaves, args[4]), leaves, do)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if cuda_us > 0 and e.count >= steps:
            rows.append((e.key[:70], cuda_us / steps, e.count // steps))
    rows.sort(key=lambda r: -r[1])
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--official", help="path of the official pruning kernel's forgetting_attention.py")
    ap.add_argument("--profile", action="store_true", help="per-kernel CUDA time of each contender (fast gates)")
    ap.add_argument("--gates", nargs="+", choices=[g.split()[0] for g in GATES], default=[g.split()[0] for g in GATES],
                    help="which gate speeds to run (default all)")
    ap.add_argument("--out", default="bench_pruning.json")
    args = ap.parse_args()
    fns = contenders(args.official)
    rows, profiles = [], {}
    for B, T, H, D in SHAPES:
        for label, shift in GATES.items():
            if label.split()[0] not in args.gates:
                continue
            inputs = _inputs(B, T, H, D, shift)
            row = dict(B=B, T=T, H=H, D=D, gates=label, mean_log_f=inputs[3].mean().item())
            for name, fn in fns.items():
                ms = {}
                for timer, suffix in ((_time, ""), (_time_graph, " graph")):
                    for mode in ("fwd", "fwd+bwd"):
                        try:
                            ms[mode + suffix] = timer(fn, inputs, mode)
                        except Exception as e:  # a contender that cannot run a case is reported, not fatal
                            print(f"{name} failed at {label} ({mode}{suffix}): {type(e).__name__}: {str(e)[:200]}")
                            ms[mode + suffix] = float("nan")
                row[name] = dict(fwd_ms=ms["fwd"], fwdbwd_ms=ms["fwd+bwd"], bwd_ms=ms["fwd+bwd"] - ms["fwd"],
                                 fwd_tflops_eff=_flops(B, H, T, D, "fwd") / ms["fwd"] / 1e9,
                                 fwdbwd_tflops_eff=_flops(B, H, T, D, "fwd+bwd") / ms["fwd+bwd"] / 1e9,
                                 fwd_graph_ms=ms["fwd graph"], fwdbwd_graph_ms=ms["fwd+bwd graph"],
                                 bwd_graph_ms=ms["fwd+bwd graph"] - ms["fwd graph"])
            rows.append(row)
            print(f"\nB={B} T={T} H={H} D={D} gates {label} (mean log f {row['mean_log_f']:.4f}); "
                  "eager calls, then the same replayed from a CUDA graph (GPU time alone)")
            print(f"{'contender':32s} {'fwd ms':>8} {'f+b ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'f+b TF/s':>9} "
                  f"{'graph fwd':>9} {'graph f+b':>9} {'graph bwd':>9}")
            for name in fns:
                r = row[name]
                print(f"{name:32s} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:8.3f} {r['bwd_ms']:8.3f} "
                      f"{r['fwd_tflops_eff']:9.0f} {r['fwdbwd_tflops_eff']:9.0f} "
                      f"{r['fwd_graph_ms']:9.3f} {r['fwdbwd_graph_ms']:9.3f} {r['bwd_graph_ms']:9.3f}")
            if args.profile and shift == min(GATES.values()):
                for name, fn in fns.items():
                    try:
                        prof = _profile(fn, inputs)
                    except Exception as e:
                        print(f"profile of {name} failed: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    profiles[f"D={D} {name}"] = prof
                    print(f"  profile {name} (D={D}, fast gates): " + "; ".join(
                        f"{k} {us:.0f}us x{n}" for k, us, n in prof[:12]))
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(), options=current_options().key, cached_launch=launch.CACHED)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=rows, profiles=profiles), f, indent=1)
    print("\n" + " | ".join(f"{k}={v}" for k, v in env.items()))


if __name__ == "__main__":
    main()
