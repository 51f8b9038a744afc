"""Host (CPU) time per call of Forgetting Attention against cuDNN SDPA, at a length where the GPU work is
negligible, so the numbers are the Python and launch cost that a training step pays per layer.

A training step of a small model at long context can wait on its host (the GPU idles between launches):
the 125M FoX (Pro) with pruning runs ~40 ms of kernels a step against ~50 ms of host work. This measures
the attention op's share: the custom ops as a compiled graph calls them (forward, backward, with and
without the "auto" pruning bound), the public function through autograd, and SDPA-cuDNN through
autograd for scale. Each row is the mean of ``--calls`` calls queued without synchronising. Prints a
table and writes JSON: wall time per call, and the process's CPU time per call.

``--rounds N`` times every case N times, the cases in turn, and reports the medians (the hosts' spread
between runs is wider than some of the differences measured here). ``--launch-ab`` times every case with the
kernels' cached launches (``ops/triton/launch.run``) and through Triton's own launch path, in alternating
rounds in this one process, and reports the median of each; ``--reports-ab`` likewise with the prefix sums'
zero-gate reports read and not read (``ops/zero_flags.py``); ``--descriptors-ab`` with the Gluon launchers'
TMA descriptors kept between calls and built afresh (``ops/gluon/host.py``); ``--plans-ab`` with the Gluon
forward's recorded launches replayed and every call launched through ``launch.run`` (``ops/gluon/host.py``).

    python packages/fox-kernel/benchmarks/host_overhead.py --out host.json [--seq-len 256] [--rounds 5] \\
        [--launch-ab | --reports-ab | --descriptors-ab | --plans-ab]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from fox_kernel import forgetting_attention
from fox_kernel.pruning import DEFAULT_LOG_TOLERANCE, pruning_threshold


def host_us(fn, calls: int, clock=time.perf_counter) -> float:
    """Mean host microseconds per call of ``fn`` (launches queued, one synchronisation at the end), by
    ``clock``: wall time, or with ``time.process_time`` the CPU time of this process (the time it ran, not
    the time it waited for a CPU; on the shared H100 hosts of 2026-11-28 it spread between runs as widely as
    wall time)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = clock()
    for _ in range(calls):
        fn()
    host = clock() - t
    torch.cuda.synchronize()
    return host / calls * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default="host_overhead.json")
    ap.add_argument("--official", help="path of the official pruning kernel's forgetting_attention.py (needs einops): "
                    "adds its fwd+bwd through autograd, exact and with a per-head bound")
    ab = ap.add_mutually_exclusive_group()
    ab.add_argument("--launch-ab", action="store_true",
                    help="each case with cached launches and through Triton's launch path, alternating rounds")
    ab.add_argument("--reports-ab", action="store_true",
                    help="each case with the prefix sums' zero-gate reports read (zero-gate passes skipped once a "
                         "clean report is in) and not read (passes always launched), alternating rounds")
    ab.add_argument("--descriptors-ab", action="store_true",
                    help="each case with the Gluon launchers' TMA descriptors kept between calls and built afresh "
                         "(ops/gluon/host.CACHED_DESCRIPTORS), alternating rounds")
    ab.add_argument("--plans-ab", action="store_true",
                    help="each case with the Gluon forward's recorded launches replayed and launched anew each call "
                         "(ops/gluon/host.PLANS), alternating rounds")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds: every case once per round, the cases in turn; each row is the median over rounds "
                         "(the A/B options: 3 if not given)")
    ap.add_argument("--profile", action="store_true",
                    help="also print cProfile's top functions (own time) of the autograd calls (zero_gates=False, without "
                         "and with the auto bound; with a per-head bound), or of the --profile-case cases")
    ap.add_argument("--profile-case", action="append", default=None, metavar="CASE",
                    help="a case to profile with --profile (repeatable; the names of the table's rows)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_overhead.py needs a CUDA GPU")
    T, H, D = args.seq_len, args.heads, args.head_dim
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    lf = F.logsigmoid(torch.randn(1, T, H, device="cuda") + 3.0)
    s = D**-0.5
    fwd, bwd = torch.ops.fox_kernel.forgetting_attention_fwd, torch.ops.fox_kernel.forgetting_attention_bwd
    out, lse, _ = fwd(q, k, v, lf, None, None, s, None, None)
    bound = pruning_threshold(q, k, s, T)
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    lfg = lf.clone().requires_grad_()
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

    def fox_autograd():
        o = forgetting_attention(qg, kg, vg, lfg)
        o.backward(o)

    def fox_autograd_no_zero_gates():
        o = forgetting_attention(qg, kg, vg, lfg, zero_gates=False)
        o.backward(o)

    def fox_autograd_pruned():
        o = forgetting_attention(qg, kg, vg, lfg, adaptive_threshold="auto")
        o.backward(o)

    def fox_autograd_pruned_no_zero_gates():  # the call fox-layers' pruned layers make
        o = forgetting_attention(qg, kg, vg, lfg, adaptive_threshold="auto", zero_gates=False)
        o.backward(o)

    def sdpa_autograd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        o.backward(o)

    def fox_autograd_per_head():
        o = forgetting_attention(qg, kg, vg, lfg, adaptive_threshold=per_head)
        o.backward(o)

    def fox_forward_pruned(**kw):  # bench_attention.py's forward cells: the public call without autograd
        with torch.no_grad():
            forgetting_attention(q, k, v, lf, adaptive_threshold="auto", **kw)

    from fox_kernel.ops import dispatch
    from fox_kernel.ops.call import AttentionCall
    from fox_kernel.ops.triton import sums
    from fox_kernel.options import current_options

    opts = current_options()
    per_head = bound.amin(dim=0)
    cases = {
        "forward op": lambda: fwd(q, k, v, lf, None, None, s, None, None),
        "forward op, auto pruning": lambda: fwd(q, k, v, lf, None, None, s, None, DEFAULT_LOG_TOLERANCE),
        "forward op, zero_gates=False": lambda: fwd(q, k, v, lf, None, None, s, None, None, 0, "", False),
        "backward op": lambda: bwd(do, q, k, v, lf, out, lse, None, None, s, None),
        "backward op, zero_gates=False": lambda: bwd(do, q, k, v, lf, out, lse, None, None, s, None, 0, "", False),
        "backward op, pruning": lambda: bwd(do, q, k, v, lf, out, lse, None, None, s, bound),
        "forgetting_attention fwd+bwd (autograd)": fox_autograd,
        "forgetting_attention fwd+bwd, zero_gates=False (autograd)": fox_autograd_no_zero_gates,
        "forgetting_attention fwd+bwd, auto pruning (autograd)": fox_autograd_pruned,
        "forgetting_attention fwd+bwd, auto pruning, zero_gates=False (autograd)": fox_autograd_pruned_no_zero_gates,
        "forgetting_attention fwd+bwd, per-head bound (autograd)": fox_autograd_per_head,
        "forgetting_attention forward, auto pruning (no grad)": fox_forward_pruned,
        "forgetting_attention forward, auto pruning, zero_gates=False (no grad)":
            lambda: fox_forward_pruned(zero_gates=False),
        "dispatch.forward (no op, no checks)": lambda: dispatch.forward(q, k, v, lf, AttentionCall(s, options=opts)),
        "dispatch.backward, pruning (no op)": lambda: dispatch.backward(do, q, k, v, lf, out, lse,
                                                                        AttentionCall(s, threshold=bound, options=opts)),
        "one Triton launch (prefix sums)": lambda: sums.prefix_sums(lf, None, zeros=True),
        "SDPA cuDNN fwd+bwd (autograd)": sdpa_autograd,
    }
    if args.official:
        import importlib.util

        spec = importlib.util.spec_from_file_location("official_pruning_kernel", args.official)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        qh, kh, vh, lfh = (x.detach().clone().requires_grad_() for x in (q, k, v, lf))

        def official(threshold):
            o = module.forgetting_attention(qh, kh, vh, lfh, adaptive_threshold=threshold)
            o.backward(o)

        cases["official fwd+bwd (autograd)"] = lambda: official(None)
        cases["official fwd+bwd, per-head bound (autograd)"] = lambda: official(per_head)
    switch = None
    if args.launch_ab:
        from fox_kernel.ops.triton import launch

        switch = (launch, "CACHED", "host_us_triton_launch", "cached us", "Triton us")
    elif args.reports_ab:
        from fox_kernel.ops import zero_flags

        switch = (zero_flags, "USED", "host_us_reports_unread", "read us", "unread us")
    elif args.descriptors_ab:
        from fox_kernel.ops.gluon import host

        switch = (host, "CACHED_DESCRIPTORS", "host_us_descriptors_built", "kept us", "built us")
    elif args.plans_ab:
        from fox_kernel.ops.gluon import host

        switch = (host, "PLANS", "host_us_launched", "replay us", "launch us")
    rounds = args.rounds if args.rounds is not None else 3 if switch else 1
    if rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {rounds}")
    profiled = args.profile_case or ["forgetting_attention fwd+bwd, zero_gates=False (autograd)",
                                     "forgetting_attention fwd+bwd, auto pruning, zero_gates=False (autograd)",
                                     "forgetting_attention fwd+bwd, per-head bound (autograd)"]
    unknown = [name for name in profiled if name not in cases]
    if unknown:
        raise SystemExit(f"--profile-case: no case {unknown[0]!r}; the cases: {', '.join(cases)}")
    rows = switch_ab(cases, args.calls, rounds, *switch[:3]) if switch else in_rounds(cases, args.calls, rounds)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(), cpu=platform.processor() or platform.machine())
    print(" | ".join(f"{k}={v}" for k, v in env.items()) + f" | T={T} H={H} D={D} bf16")
    if switch:
        off_key, on_label, off_label = switch[2:]
        print(f"{'case':72s} {on_label:>10s} {off_label:>10s} {'ratio':>6s}")
        for r in rows:
            print(f"{r['case']:72s} {r['host_us']:10.1f} {r[off_key]:10.1f} {r['host_us'] / r[off_key]:6.3f}")
    else:
        print(f"{'case':72s} {'host us/call':>12s} {'CPU us/call':>12s}")
        for r in rows:
            print(f"{r['case']:72s} {r['host_us']:12.1f} {r['host_cpu_us']:12.1f}")
    profiles = {}
    if args.profile:
        for name in profiled:
            profiles[name] = python_profile(cases[name], args.calls)
            print(f"\n{name}: top functions by own time (us per call, cumulative us per call)")
            for row in profiles[name][:30]:
                print(f"  {row['own_us']:8.1f} {row['cum_us']:8.1f}  {row['function']}")
            print("  ... by cumulative time:")
            for row in sorted(profiles[name], key=lambda r: -r["cum_us"])[:45]:
                print(f"  {row['own_us']:8.1f} {row['cum_us']:8.1f}  {row['function']}")
    with open(args.out, "w") as f:
        json.dump(dict(env=env, seq_len=T, heads=H, head_dim=D, calls=args.calls, rows=rows, profiles=profiles), f,
                  indent=1)


def in_rounds(cases, calls: int, rounds: int) -> list[dict]:
    """Per case, the median over ``rounds`` rounds (each round times every case in turn, so a slow spell of
    the host falls on all cases alike) of the wall and CPU time per call, and each round's wall time."""
    import statistics

    wall = {name: [] for name in cases}
    cpu = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            wall[name].append(host_us(fn, calls))
            cpu[name].append(host_us(fn, calls, time.process_time))
    return [dict(case=name, host_us=statistics.median(wall[name]), host_cpu_us=statistics.median(cpu[name]),
                 rounds=wall[name]) for name in cases]


def switch_ab(cases, calls: int, rounds: int, module, attribute: str, off_key: str) -> list[dict]:
    """Per case, the median host time over ``rounds`` rounds with ``module.attribute`` True (``host_us``) and
    False (``off_key``), the two alternating within each round."""
    import statistics

    times = {name: {True: [], False: []} for name in cases}
    before = getattr(module, attribute)
    try:
        for _ in range(rounds):
            for name, fn in cases.items():
                for on in (False, True):
                    setattr(module, attribute, on)
                    times[name][on].append(host_us(fn, calls))
    finally:
        setattr(module, attribute, before)
    return [dict(case=name, host_us=statistics.median(t[True]), **{off_key: statistics.median(t[False])},
                 rounds=dict(on=t[True], off=t[False])) for name, t in times.items()]


def python_profile(fn, calls: int) -> list[dict]:
    """cProfile of ``calls`` calls of ``fn``: per function, own and cumulative microseconds per call."""
    import cProfile
    import pstats

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    rows = []
    for (file, line, func), (_, _, own, cum, _) in pstats.Stats(prof).stats.items():
        rows.append(dict(function=f"{func} ({'/'.join(file.rsplit('/', 2)[-2:])}:{line})", own_us=own / calls * 1e6,
                         cum_us=cum / calls * 1e6))
    return sorted(rows, key=lambda r: -r["own_us"])


if __name__ == "__main__":
    main()
