"""Hardware counters of our kernels beside cuDNN's and SDPA's, read with Nsight Compute (ncu).

Where the time of a forward+backward goes against cuDNN SDPA (bf16, causal, T=16k at D=128 and D=64,
and 4 x 4k at D=128), and of decoding against SDPA without a gate (GQA 32/8, D=128, 8 x 32k). The script
runs itself under ``ncu`` once per case (``--child CASE``: warm up, then one profiled call between
``cudaProfilerStart`` and ``cudaProfilerStop``), reads the counters of every kernel of that call from
ncu's raw CSV page and prints, per kernel: its time, SM and DRAM throughput (% of peak), tensor-pipe
activity, the MUFU (exponential) pipe's share, issue-slot use, achieved occupancy, registers, and the three largest warp-stall reasons (cycles
per issued instruction). Writes JSON with every collected counter of each kernel.

    python packages/fox-kernel/benchmarks/ncu_profile.py --out ncu-profile.json
    python packages/fox-kernel/benchmarks/ncu_profile.py --cases train-16k-d128 decode --out ncu.json
    python packages/fox-kernel/benchmarks/ncu_profile.py --plot-from ncu.json --plot ncu.png   # no GPU

``--plot`` draws each case's kernel time, ours beside the reference, one bar segment per kernel, labelled
with its tensor-pipe activity (decoding: its DRAM activity).

Clocks are left as the GPU runs them (``--clock-control none``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys

from plot_args import add_plot_args, plotted_from_json

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats",
            "WarpStateStats", "SchedulerStats", "InstructionStats")
CASES = {  # name -> (B, T, H, Hkv, D, what)
    "train-16k-d128": (1, 16384, 16, 16, 128, "train"),
    "train-16k-d64": (1, 16384, 32, 32, 64, "train"),
    "train-4x4k-d128": (4, 4096, 16, 16, 128, "train"),
    "decode": (8, 32768, 32, 8, 128, "decode"),
}
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
# name in the table -> ncu metric
COLUMNS = {
    "us": "gpu__time_duration.sum",
    "SM %": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "DRAM %": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "tensor %": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "MUFU %": "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "issue %": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "occupancy %": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
}


def _child(case: str) -> None:
    """One warmed-up call of ``case``, ours then the reference, inside the profiled range."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fox_kernel import forgetting_attention, forgetting_attention_with_kvcache

    B, T, H, Hkv, D, what = CASES[case]
    torch.manual_seed(0)
    if what == "decode":
        from fox_kernel.testing import decode_inputs

        q, k, v, c, lens = decode_inputs(B, T, H, Hkv, D)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        calls = [lambda: forgetting_attention_with_kvcache(q, k, v, c, lens),
                 lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)]
    else:
        q, k, v = (torch.randn(B, T, h, D, device="cuda", dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
        lf = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 4.0)
        leaves = [x.requires_grad_() for x in (q, k, v, lf)]
        do = torch.randn_like(q)

        def ours():
            torch.autograd.grad(forgetting_attention(*leaves, zero_gates=False), leaves, do)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves[:3]), is_causal=True)
            torch.autograd.grad(out.transpose(1, 2), leaves[:3], do)
        calls = [ours, cudnn]
    for _ in range(3):
        for call in calls:
            call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _parse_raw(text: str) -> list[dict]:
    """ncu's ``--page raw --csv`` output: one dict per kernel, metric -> value (str), units dropped."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        return []
    header = rows[0]
    return [dict(zip(header, r)) for r in rows[2:]]  # rows[1] holds the units


def _number(x: str | None) -> float:
    try:
        return float(str(x).replace(",", ""))
    except (TypeError, ValueError):
        return float("nan")


def _summary(kernel: dict) -> dict:
    out = dict(name=kernel.get("Kernel Name", "?"))
    for label, metric in COLUMNS.items():
        out[label] = _number(kernel.get(metric))
    out["us"] /= 1e3  # ns -> us
    stalls = {STALL.match(m).group(1): _number(v) for m, v in kernel.items() if STALL.match(m)}
    out["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    return out


def _short(name: str) -> str:
    return name.split("(")[0][:44]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--out", default="ncu_profile.json")
    add_plot_args(ap, "the kernel times")
    ap.add_argument("--child", choices=list(CASES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child)
        return
    if plotted_from_json(args, plot):
        return
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("ncu (Nsight Compute) is not on the PATH")
    import torch
    import triton

    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    result = dict(env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           ncu=version[-1] if version else "?", clock_control="none"))
    for case in args.cases:
        cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
               *[a for s in SECTIONS for a in ("--section", s)], sys.executable, os.path.abspath(__file__),
               "--child", case]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        kernels = _parse_raw(proc.stdout)
        if proc.returncode != 0 or not kernels:
            print(f"{case}: ncu failed (rc {proc.returncode}): {proc.stderr[-2000:]}{proc.stdout[-2000:]}")
            result[case] = dict(error=proc.stderr[-4000:] + proc.stdout[-4000:])
            continue
        summaries = [_summary(k) for k in kernels]
        result[case] = dict(shape=dict(zip(("B", "T", "H", "Hkv", "D"), CASES[case][:5])), kernels=summaries,
                            raw=kernels)
        print(f"\n{case}: B, T, H, Hkv, D = {CASES[case][:5]}; every kernel of one call, ours first")
        print(f"{'kernel':44s} {'us':>8} {'SM %':>6} {'DRAM %':>6} {'tensor %':>8} {'MUFU %':>6} {'issue %':>7} "
              f"{'occup %':>7} {'regs':>5}  largest stalls (cycles per issued instruction)")
        for s in summaries:
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(s["stalls"].items())[:3])
            print(f"{_short(s['name']):44s} {s['us']:8.1f} {s['SM %']:6.1f} {s['DRAM %']:6.1f} "
                  f"{s['tensor %']:8.1f} {s['MUFU %']:6.1f} {s['issue %']:7.1f} {s['occupancy %']:7.1f} {s['regs']:5.0f}  {top}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)


def is_reference(name: str) -> bool:
    """Whether a kernel is the reference's (cuDNN, as SDPA runs it here) rather than ours."""
    return "cudnn" in name


def _label(name: str) -> str:
    """A short name of a large kernel for the plot."""
    for part, label in (("bprop", "backward"), ("fprop", "forward"), ("dkdv", "dK/dV pass"), ("dq_kernel", "dQ pass"),
                        ("fwd_kernel", "forward"), ("decode", "decode")):
        if part in name:
            return label
    return _short(name)[:16]


def plot(result: dict, path: str) -> None:
    """Per case, two stacked bars (ours, the reference): one segment per kernel, the large ones labelled with
    their tensor-pipe activity (decoding: their DRAM activity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c, v in result.items() if isinstance(v, dict) and "kernels" in v]
    fig, axes = plt.subplots(len(cases), 1, figsize=(10, 1.9 * len(cases) + 0.8), squeeze=False)
    for ax, case in zip(axes[:, 0], cases):
        kernels = result[case]["kernels"]
        total = max(sum(k["us"] for k in kernels if is_reference(k["name"]) == ref) for ref in (False, True))
        for y, ref in ((1, False), (0, True)):
            left = 0.0
            for k in (k for k in kernels if is_reference(k["name"]) == ref):
                big = k["us"] > 0.08 * total
                ax.barh(y, k["us"], left=left, color=("tab:gray" if ref else "tab:blue") if big else "tab:orange",
                        edgecolor="white")
                if big:
                    what = f"DRAM {k['DRAM %']:.0f}%" if case.startswith("decode") else f"tensor {k['tensor %']:.0f}%"
                    ax.text(left + k["us"] / 2, y, f"{_label(k['name'])}\n{what}", ha="center", va="center",
                            fontsize=7, color="white")
                left += k["us"]
            ax.text(left, y, f" {left:,.0f} us", va="center", fontsize=8)
        ax.set_yticks([0, 1], ["cuDNN / SDPA", "ours"])
        ax.set_xlim(0, total * 1.15)
        ax.set_title(f"{case}: B, T, H, Hkv, D = {tuple(result[case]['shape'].values())}", fontsize=9)
    axes[-1, 0].set_xlabel("kernel time under Nsight Compute (us); orange: kernels under 8% of the longer bar")
    env = result.get("env", {})
    fig.suptitle(f"{env.get('gpu', '')}, torch {env.get('torch', '')}, triton {env.get('triton', '')}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
