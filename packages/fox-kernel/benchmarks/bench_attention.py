"""Side-by-side speed of Forgetting Attention contenders: one GPU, bf16, median times.

Times SDPA (cuDNN and flash backends, no gate: the ceiling), FlexAttention with a FoX score_mod,
flash-linear-attention's ``parallel_forgetting_attn`` (if installed), the official FoX kernel (given
``--official PATH``, a local copy of the pruning paper's ``forgetting_attention.py``; not shipped) and ours,
forward and forward+backward, at B*T = 16384 tokens and H*D = 2048; a GQA case; pruning (ACP) at T=16k, D=64
and D=128, with fast and slow gates: ours exact, with the "auto" bound (also with ``zero_gates=False``) and
with one per-head bound, and the official kernel exact and with that same per-head bound; decoding. Prints
tables and writes JSON, rewritten after every row (a run cut short keeps what it measured).

Calls are eager (the host's Python and launches included: what a plain PyTorch loop sees). With ``--graph``
every contender's attention and pruning cell is also timed replayed from a CUDA graph captured once (the GPU time alone,
``bench_pruning.py``'s capture), as a second table and the JSON keys "NAME graph": where a contender's eager
cell is below its graph cell, that call waits on its host. Decoding's contiguous, pruned and SDPA cells are
timed the same way (JSON keys "NAME_graph_ms" and "NAME_graph_TBps"). ``--rounds N`` times each pruning cell's eager
calls N times, the contenders in turn, and reports the medians.

    python packages/fox-kernel/benchmarks/bench_attention.py --out bench.json [--quick] [--official PATH] [--graph] \\
        [--rounds 5]
    python packages/fox-kernel/benchmarks/bench_attention.py --plot-from bench.json --plot bench.png   # no GPU

``--plot`` draws the run's three tables into one PNG: each FoX kernel's speed over cuDNN's, the official
pruned call's time over ours, and decoding bandwidth. ``--markdown-from JSON`` prints an earlier run's three
tables in markdown, as the kernel README shows them (no GPU):

    python packages/fox-kernel/benchmarks/bench_attention.py --markdown-from bench.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import time

import torch
import torch.nn.functional as F
import triton
from bench_pruning import GATES, SHAPES, _load_official, in_rotating_rounds
from bench_pruning import _time_graph as graph_time  # the same capture and timing as bench_pruning's
from plot_args import add_plot_args, plotted_from_json, read_run
from torch.nn.attention import SDPBackend, sdpa_kernel

from fox_kernel import current_options, forgetting_attention, gate_cache
from fox_kernel.pruning import pruning_threshold


def _flops(B, H, T, D, mode):
    fwd = 4 * B * H * T * T * D / 2
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def _inputs(B, T, H, Hkv, D, gate_shift=4.0):
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    lf = F.logsigmoid(torch.randn(B, T, H, device="cuda") + gate_shift)
    return q, k, v, lf


def _sdpa(backend):
    def run(q, k, v, lf):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=k.shape[2] != q.shape[2],
            ).transpose(1, 2)
    return run


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Every case is a new compile; past dynamo's default cache limit flex would silently run eager.
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, lf):
        B, T, H, _ = q.shape
        if T not in masks:
            masks[T] = create_block_mask(lambda b, h, i, j: j <= i, None, None, T, T, device="cuda")
        c_q = torch.cumsum(lf.transpose(1, 2), dim=-1)  # (B, H, T), contiguous time axis
        c_k = c_q.clone()  # FlexAttention's backward needs one captured tensor per indexing

        def score_mod(score, b, h, i, j):
            return score + c_q[b, h, i] - c_k[b, h, j]

        return compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
                        block_mask=masks[T], enable_gqa=k.shape[2] != H).transpose(1, 2)
    return run


def _fla():
    from fla.ops.forgetting_attn import parallel_forgetting_attn

    return lambda q, k, v, lf: parallel_forgetting_attn(q, k, v, lf)


def _ours(backward="two-pass", **kw):
    """Our kernels with the environment's options (FOX_KERNEL_*) but this backward mode."""
    def run(q, k, v, lf):
        return forgetting_attention(q, k, v, lf, options=current_options().replace(backward=backward), **kw)
    return run


def _time(fn, args, mode):
    q, k, v, lf = args
    if mode == "fwd":
        with torch.no_grad():
            return triton.testing.do_bench(lambda: fn(q, k, v, lf), warmup=50, rep=200, return_mode="median")
    leaves = [x.detach().requires_grad_() for x in args]
    do = torch.randn_like(q)

    def step():
        out = fn(*leaves)
        torch.autograd.grad(out, leaves, do, allow_unused=True)  # plain SDPA has no gates
    return triton.testing.do_bench(step, warmup=50, rep=200, return_mode="median")


def eager_rounds(contenders: dict, args, mode, rounds: int) -> dict:
    """Each contender's eager time (ms), ``rounds`` times: round r starts at the r-th contender and takes the
    others in turn, so that none always follows the same one."""
    return in_rotating_rounds(contenders, rounds, lambda fn: _time(fn, args, mode))


def _time_graph(fn, args, mode):
    """``_time``'s call replayed from a CUDA graph captured once: the GPU time alone."""
    return graph_time(lambda q, k, v, lf, _: fn(q, k, v, lf), (*args, None), mode)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_attention.json")
    ap.add_argument("--quick", action="store_true", help="only T=4k and 16k")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--decode-only", action="store_true", help="only the decoding cases")
    ap.add_argument("--official", help="path of the official FoX kernel's forgetting_attention.py (pruning paper)")
    ap.add_argument("--graph", action="store_true", help="also time each attention cell from a CUDA graph (GPU time)")
    ap.add_argument("--attention-only", action="store_true",
                    help="only the attention table (no pruning or decoding cases)")
    ap.add_argument("--no-zero-gates", action="store_true",
                    help="also time our kernels as fox-layers' layers call them: zero_gates=False (no zero-gate passes)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="pruning rows: time each contender's eager call this many times, the contenders in turn, "
                         "and report the median (at ~1 ms a call these cells time the host, whose single samples "
                         "move by 10-25%%); every round's time is kept in the JSON")
    add_plot_args(ap, "the run's tables")
    ap.add_argument("--markdown-from", metavar="JSON",
                    help="print that earlier run's tables in markdown, as the kernel README shows them (no GPU)")
    args = ap.parse_args()
    if args.markdown_from:
        print("\n\n".join(markdown_tables(read_run(args.markdown_from, "--markdown-from"))))
        return
    if plotted_from_json(args, plot):
        return
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    official = None
    if args.official:
        official = _load_official(args.official)  # the same file, loaded the same way as bench_pruning's
    if args.decode_only:
        decode = bench_decode(args.graph)
        with open(args.out, "w") as f:
            json.dump(dict(env=_env(), decode=decode), f, indent=1)
        return

    contenders = {"sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION)}
    if not args.no_flex:
        contenders["flex_fox"] = _flex()
    try:
        contenders["fla"] = _fla()
    except ImportError:
        print("fla not installed: skipping parallel_forgetting_attn")
    if official is not None:
        contenders["official"] = lambda q, k, v, lf: official(q, k, v, lf)
    contenders["fox one-pass"] = _ours("fused")  # opt-in backward with atomic dQ (same forward)
    contenders["fox (ours)"] = _ours()
    if args.no_zero_gates:
        contenders["fox zero_gates=False"] = _ours(zero_gates=False)

    rows, acp, decode, env, start = [], [], [], _env(), time.perf_counter()
    result = dict(env=env, attention=rows, acp=acp, decode=decode)  # the lists fill in place

    def save():  # after every row: a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    lengths = [4096, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384]
    cases = [(16384 // T, T, 2048 // D, 2048 // D, D) for D in (64, 128) for T in lengths]
    cases += [(2, 8192, 32, 8, 128), (2, 8192, 32, 32, 128)]  # GQA and the equivalent MHA
    for B, T, H, Hkv, D in cases:
        torch.manual_seed(0)
        inputs = _inputs(B, T, H, Hkv, D)
        for mode in ("fwd", "fwd+bwd"):
            row = dict(B=B, T=T, H=H, Hkv=Hkv, D=D, mode=mode)
            for name, fn in contenders.items():
                if name == "fox one-pass" and mode == "fwd":
                    row[name] = row[f"{name} graph"] = float("nan")
                    continue
                for timer, key in ((_time, name), *([(_time_graph, f"{name} graph")] if args.graph else [])):
                    try:
                        row[key] = _flops(B, H, T, D, mode) / timer(fn, inputs, mode) / 1e9
                    except Exception as e:  # a contender that cannot run (or be captured) is reported, not fatal
                        print(f"{key} failed at {row}: {type(e).__name__}: {str(e)[:200]}")
                        row[key] = float("nan")
            rows.append(row)
            save()
            print(_fmt_row(row, contenders), f"[{time.perf_counter() - start:.0f} s]", flush=True)

    # bench_pruning's shapes and gates
    for (B, T, H, D), (label, shift) in [] if args.attention_only else [(s, g) for s in SHAPES for g in GATES.items()]:
        torch.manual_seed(0)
        inputs = _inputs(B, T, H, H, D, gate_shift=shift)
        mean = inputs[3].mean().item()
        # one bound per head for both kernels: the q/k-norm bound of the whole row (ln eps = -10)
        per_head = pruning_threshold(inputs[0], inputs[1], D**-0.5, T).amin(dim=0)
        pruning = {"exact": _ours(), "auto": _ours(adaptive_threshold="auto"),
                   "auto zero_gates=False": _ours(adaptive_threshold="auto", zero_gates=False),
                   "per-head": _ours(adaptive_threshold=per_head)}
        if official is not None:
            pruning["official exact"] = contenders["official"]
            pruning["official per-head"] = lambda q, k, v, lf: official(q, k, v, lf, adaptive_threshold=per_head)
        for mode in ("fwd", "fwd+bwd"):
            flops = _flops(B, H, T, D, mode)
            row = dict(B=B, T=T, H=H, D=D, gates=label, mean_log_f=mean, mode=mode)
            if args.rounds > 1:
                row["rounds"] = args.rounds
            for name, times in eager_rounds(pruning, inputs, mode, args.rounds).items():
                row[f"ms {name}"] = statistics.median(times)
                if args.rounds > 1:
                    row[f"rounds ms {name}"] = times
            for name, fn in pruning.items():
                if args.graph:
                    row[f"ms {name} graph"] = _time_graph(fn, inputs, mode)
            for key in [k[3:] for k in row if k.startswith("ms ")]:
                row[f"tflops_effective {key}"] = flops / row[f"ms {key}"] / 1e9
            row["speedup"] = row["ms exact"] / row["ms auto"]
            acp.append(row)
            save()
            print(f"ACP D={D} {label:30s} {mode:8s} " + "  ".join(
                f"{k.replace('tflops_effective ', '')} {v:6.1f}" for k, v in row.items() if k.startswith("tflops")))
        print(f"[{time.perf_counter() - start:.0f} s]", flush=True)

    if not args.attention_only:
        decode.extend(bench_decode(args.graph))
        save()
    print("\n" + " | ".join(f"{k}={v}" for k, v in env.items()))
    print("TFLOP/s (bf16, causal; fwd FLOPs 2BHT^2D, fwd+bwd 3.5x)")
    print(_fmt_header(contenders))
    for row in rows:
        print(_fmt_row(row, contenders))
    if args.graph:
        print("TFLOP/s replayed from a CUDA graph (GPU time alone)")
        print(_fmt_header(contenders))
        for row in rows:
            print(_fmt_row(row, contenders, suffix=" graph"))
    if args.plot:
        plot(result, args.plot)


def _env():
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version())


def bench_decode(graph: bool = False):
    """One new token per sequence against a cache: bandwidth = K/V bytes of the cache / time.

    Contiguous caches, paged caches (shuffled pages of 16 and 256 tokens) and, with fast gates, cache-tile
    pruning at the eps = e^-10 bound (its bandwidth is effective: the whole cache's bytes over the time).
    With ``graph`` the contiguous, pruned and SDPA calls are also timed replayed from a CUDA graph (GPU time
    alone): a small cache's eager call can wait on the host."""
    from fox_kernel import forgetting_attention_with_kvcache
    from fox_kernel.testing import decode_inputs

    def timed(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")

    rows = []
    for B, T in ((8, 32768), (64, 4096), (1, 131072)):  # the three shapes of the decoding target
        H, Hkv, D = 32, 8, 128
        q, k, v, c, lens = decode_inputs(B, T, H, Hkv, D)
        kv_bytes = 2 * k.numel() * k.element_size()
        row = dict(B=B, T=T, H=H, Hkv=Hkv, D=D, mean_log_f=float(c[:, -1].mean() / T))
        calls = {}  # name: (fn, (q, k, v, gates, lengths)), as capture_graph takes a call to replay it

        def eager(name, fn, *args):
            calls[name] = (fn, args)
            row[f"{name}_ms"] = timed(functools.partial(fn, *args))

        eager("ours", forgetting_attention_with_kvcache, q, k, v, c, lens)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        eager("sdpa_no_gate", lambda a, b, d, *_: F.scaled_dot_product_attention(a, b, d, enable_gqa=True),
              qt, kt, vt, c, lens)
        ref = forgetting_attention_with_kvcache(q, k, v, c, lens)  # what each paged layout must give
        for page in (16, 256):
            n_pages = B * T // page
            perm = torch.randperm(n_pages, device="cuda")
            table = perm.view(B, T // page).to(torch.int32)
            pool = [torch.empty(n_pages, page, *x.shape[2:], device="cuda", dtype=x.dtype) for x in (k, v)]
            pool.append(gate_cache(n_pages, page, c.shape[2], device="cuda"))  # head-major, as the caches made here
            for dst, src in zip(pool, (k, v, c)):
                dst[perm] = src.reshape(n_pages, page, *src.shape[2:])
            got = forgetting_attention_with_kvcache(q, *pool, lens, block_table=table)
            assert (got.float() - ref.float()).abs().max().item() < 2e-2, "paged decode differs from contiguous"
            row[f"paged{page}_ms"] = timed(lambda: forgetting_attention_with_kvcache(q, *pool, lens, block_table=table))
        # the bound of fox_kernel.pruning, -(2U + ln T) + ln eps, eps = e^-10, from the max norms of q and k
        u = q.float().norm(dim=-1).amax() * k.float().norm(dim=-1).amax() * D**-0.5
        bound = float(-(2 * u + math.log(T)) - 10)
        row["pruning_bound"] = bound
        eager("pruned", functools.partial(forgetting_attention_with_kvcache, adaptive_threshold=bound),
              q, k, v, c, lens)
        for name in ("ours", "sdpa_no_gate", "paged16", "paged256", "pruned"):
            row[f"{name}_TBps"] = kv_bytes / row[f"{name}_ms"] / 1e9
        for name, (fn, args) in calls.items() if graph else ():  # the same calls replayed from a CUDA graph
            row[f"{name}_graph_ms"] = graph_time(fn, args, "fwd")
            row[f"{name}_graph_TBps"] = kv_bytes / row[f"{name}_graph_ms"] / 1e9
        rows.append(row)
        print(f"decode B={B} T={T} (TB/s): ours {row['ours_TBps']:.2f} ({row['ours_ms'] * 1e3:.0f} us), paged 16 "
              f"{row['paged16_TBps']:.2f}, paged 256 {row['paged256_TBps']:.2f}, pruned (eff.) {row['pruned_TBps']:.2f}"
              f" ({row['pruned_ms'] * 1e3:.0f} us), SDPA without gate {row['sdpa_no_gate_TBps']:.2f}" + (
              f"; GPU time: ours {row['ours_graph_TBps']:.2f}, pruned (eff.) {row['pruned_graph_TBps']:.2f}, SDPA "
              f"{row['sdpa_no_gate_graph_TBps']:.2f}" if graph else ""))
    return rows


def _fmt_header(contenders):
    return f"{'B':>3} {'T':>6} {'H':>3} {'Hkv':>3} {'D':>4} {'mode':8} " + " ".join(f"{n:>11}" for n in contenders) + "  ours/cudnn"


def _fmt_row(row, contenders, suffix=""):
    ours, cudnn = row.get("fox (ours)" + suffix), row.get("sdpa_cudnn" + suffix)
    ratio = ours / cudnn if ours is not None and cudnn else math.nan
    vals = " ".join(f"{row.get(n + suffix, math.nan):11.1f}" for n in contenders)
    return f"{row['B']:3d} {row['T']:6d} {row['H']:3d} {row['Hkv']:3d} {row['D']:4d} {row['mode']:8} {vals}  {ratio:10.2f}"


# The three markdown tables of a run, as the kernel README shows them (``--markdown-from JSON``): attention
# (TFLOP/s of every contender; bold: the row's fastest FoX kernel and ratios of 1 or more), pruning (effective
# TFLOP/s; bold: the row's fastest call) and decoding (TB/s).
ATTENTION_COLUMNS = {"sdpa_cudnn": "SDPA cuDNN", "sdpa_flash": "SDPA flash", "flex_fox": "FlexAttention FoX",
                     "fla": "fla", "official": "official FoX", "fox one-pass": "ours, one-pass bwd",
                     "fox (ours)": "ours"}
FOX_KERNELS = ("flex_fox", "fla", "official", "fox one-pass", "fox (ours)")
PRUNING_COLUMNS = {"exact": "ours exact", "auto": "ours auto", "auto zero_gates=False": "ours auto, `zero_gates=False`",
                   "per-head": "ours per-head", "official exact": "official exact",
                   "official per-head": "official per-head"}
DECODE_COLUMNS = {"paged16": "paged, 16-token pages", "paged256": "paged, 256-token pages",
                  "pruned": "pruned (effective)", "sdpa_no_gate": "SDPA, no gate"}


def _table(header: list[str], rows: list[list[str]]) -> str:
    row = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return "\n".join([row(header), "|" + "---|" * len(header), *map(row, rows)])


def _bold_max(values: dict, digits: int) -> dict:
    """name -> cell: each value at ``digits`` decimals, "—" for NaN, the largest in bold."""
    shown = {n: round(v, digits) for n, v in values.items() if not math.isnan(v)}
    top = max(shown.values(), default=None)
    return {n: "—" if n not in shown else (f"**{shown[n]:.{digits}f}**" if shown[n] == top else f"{shown[n]:.{digits}f}")
            for n in values}


def _ratio(value: float, bold_from_one: bool) -> str:
    cell = f"{value:.2f}"
    return f"**{cell}**" if bold_from_one and round(value, 2) >= 1 else cell


def markdown_tables(result: dict) -> list[str]:
    """The run's attention, pruning and decoding tables in markdown (a table for each part the run has)."""
    tables = []
    if result.get("attention"):
        rows = []
        for r in result["attention"]:
            values = {n: r.get(n, math.nan) for n in ATTENTION_COLUMNS}
            cells = {**{n: f"{v:.1f}" if not math.isnan(v) else "—" for n, v in values.items()},
                     **_bold_max({n: values[n] for n in FOX_KERNELS}, 1)}
            if "official" in r and math.isnan(r["official"]) and r["Hkv"] != r["H"]:
                cells["official"] = "(refuses GQA)"
            shape = f"{r['T'] // 1024}k" + (f" ×{r['B']}" if r["B"] > 1 else "")
            rows.append([shape, f"{r['H']}/{r['Hkv']}", str(r["D"]), r["mode"], *cells.values(),
                         _ratio(r["fox (ours)"] / r["sdpa_cudnn"], True),
                         _ratio(r.get("fox (ours) graph", math.nan) / r.get("sdpa_cudnn graph", math.nan), True)])
        tables.append(_table(["T", "H/Hkv", "D", "mode", *ATTENTION_COLUMNS.values(), "ours / cuDNN",
                              "ours / cuDNN, GPU time"], rows))
    if result.get("acp"):
        rows = []
        for r in result["acp"]:
            mean = r["mean_log_f"]
            gates = f"{r['gates'].split()[0]} ({mean:.{3 if abs(mean) < 0.1 else 2}f})"
            cells = _bold_max({n: r.get(f"tflops_effective {n}", math.nan) for n in PRUNING_COLUMNS}, 1)
            ratios = [_ratio(r.get(f"ms official per-head{g}", math.nan) / r[f"ms auto{g}"], False)
                      if f"ms auto{g}" in r else "—" for g in ("", " graph")]
            rows.append([str(r["D"]), gates, r["mode"], *cells.values(), *ratios])
        tables.append(_table(["D", "gates (mean log f)", "mode", *PRUNING_COLUMNS.values(), "official / ours auto",
                              "same, GPU time"], rows))
    if result.get("decode"):
        # a run with --graph adds the ratio in GPU time (both calls replayed from a CUDA graph)
        graph = all("ours_graph_TBps" in r for r in result["decode"])
        rows = [[f"{r['B']} × {r['T'] // 1024}k", f"{r['ours_TBps']:.2f} ({r['ours_ms'] * 1e3:.0f} us)",
                 *(f"{r[f'{n}_TBps']:.2f}" for n in DECODE_COLUMNS), _ratio(r["ours_TBps"] / r["sdpa_no_gate_TBps"], False),
                 *([_ratio(r["ours_graph_TBps"] / r["sdpa_no_gate_graph_TBps"], False)] if graph else [])]
                for r in result["decode"]]
        tables.append(_table(["B × T", "ours", *DECODE_COLUMNS.values(), "ours / SDPA",
                              *(["same, GPU time"] if graph else [])], rows))
    return tables


def _case(row) -> str:
    shape = f"{row['T'] // 1024}k" + (f"x{row['B']}" if row["B"] > 1 else "")
    heads = f" {row['H']}/{row['Hkv']}" if row["Hkv"] != row["H"] else ""
    return f"{shape}{heads} D{row['D']}\n{row['mode']}"


def plot(result: dict, path: str) -> None:
    """Three panels from a run's JSON: per attention case, each FoX kernel's TFLOP/s over cuDNN's (ours also
    in GPU time where the run has it); per pruning case, the official per-head call's time over our "auto"
    call's (eager, GPU time, and ours with ``zero_gates=False``); per decoding shape, TB/s of K/V read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    attention, acp, decode = result.get("attention", []), result.get("acp", []), result.get("decode", [])
    panels = [p for p, rows in (("attention", attention), ("acp", acp), ("decode", decode)) if rows]
    if not panels:
        raise ValueError("the JSON has no attention, acp or decode rows to plot")
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * len(panels)), squeeze=False)

    def bars(ax, labels, series, ylabel, line=None):
        x = np.arange(len(labels))
        width = 0.8 / len(series)
        for i, (name, values, style) in enumerate(series):
            ax.bar(x - 0.4 + width * (i + 0.5), values, width, label=name, **style)
        if line is not None:
            ax.axhline(line, color="black", linewidth=0.8)
        top = np.nanmax([v for _, values, _ in series for v in values])
        ax.set_ylim(0, top * 1.2)  # room for the legend above the bars
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(fontsize=7, ncol=len(series))

    for ax, panel in zip(axes[:, 0], panels):
        if panel == "attention":
            names = [n for n in ("flex_fox", "fla", "official", "fox (ours)") if n in attention[0]]
            series = [(n, [r[n] / r["sdpa_cudnn"] for r in attention], {}) for n in names]
            if "fox (ours) graph" in attention[0]:
                series.append(("fox (ours), GPU time", [r["fox (ours) graph"] / r["sdpa_cudnn graph"] for r in attention],
                               dict(hatch="//", edgecolor="white")))
            bars(ax, [_case(r) for r in attention], series, "TFLOP/s over cuDNN SDPA's (no gate)", line=1.0)
            ax.set_title("Attention: each FoX kernel against cuDNN (1 = cuDNN; missing bar: the kernel refuses "
                         "the case)", fontsize=9)
        elif panel == "acp":
            labels = [f"{r['gates'].split()[0]} {r['mean_log_f']:.3g}\nD{r['D']} {r['mode']}" for r in acp]
            series = [(name, [r[f"ms official per-head{g}"] / r[f"ms {key}{g}"] for r in acp], style)
                      for name, key, g, style in (("ours auto, eager", "auto", "", {}),
                                                  ("ours auto, zero_gates=False, eager", "auto zero_gates=False", "", {}),
                                                  ("ours auto, GPU time", "auto", " graph", dict(hatch="//", edgecolor="white")))
                      if f"ms official per-head{g}" in acp[0] and f"ms {key}{g}" in acp[0]]
            if not series:
                ax.set_visible(False)
                continue
            bars(ax, labels, series, "official per-head time / ours", line=1.0)
            ax.set_title("Pruning (T=16k): the official pruned call's time over ours (above 1: ours is faster)",
                         fontsize=9)
        else:
            names = [("ours", "ours"), ("paged, 16-token pages", "paged16"), ("paged, 256-token pages", "paged256"),
                     ("SDPA, no gate", "sdpa_no_gate")]
            series = [(label, [r[f"{key}_TBps"] for r in decode], {}) for label, key in names]
            if all("ours_graph_TBps" in r for r in decode):  # a --graph run: ours and SDPA in GPU time too
                series[1:1] = [("ours, GPU time", [r["ours_graph_TBps"] for r in decode],
                                dict(hatch="//", edgecolor="white"))]
                series.append(("SDPA, no gate, GPU time", [r["sdpa_no_gate_graph_TBps"] for r in decode],
                               dict(hatch="//", edgecolor="white")))
            bars(ax, [f"B={r['B']} x T={r['T'] // 1024}k, {r['H']}/{r['Hkv']}" for r in decode], series,
                 "TB/s of K/V read")
            ax.set_title("Decoding: one new token per sequence", fontsize=9)
    env = result.get("env", {})
    fig.suptitle(f"bench_attention.py: {env.get('gpu', '')}, torch {env.get('torch', '')}, "
                 f"triton {env.get('triton', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
