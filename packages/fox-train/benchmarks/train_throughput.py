"""Training throughput of FoX and Transformer models side by side (one GPU, bf16 autocast).

For each model: a few warm-up steps, then timed optimizer steps of one sequence of ``--seq-len`` tokens
(AdamW, gradient checkpointing off unless --checkpointing), reporting tokens/s, MFU (6N + attention
FLOPs per token over the bf16 peak), peak memory and the Python garbage collections that ran while
timing. Prints a table and writes JSON. ``--profile N`` lists each model's N costliest GPU kernels in one
step, with the step's wall time against its kernel time (a step slower than its kernels waits on the
host); ``--trace DIR`` also writes that step's Chrome trace; ``--compile-mode reduce-overhead`` runs the
compiled blocks as CUDA graphs; ``--unfused-loss`` times the models with the unfused cross-entropy.

    python packages/fox-train/benchmarks/train_throughput.py --sizes 125m 760m --seq-len 16384 --out tp.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import re
import time

import torch
import triton
from transformers import AutoModelForCausalLM

import fox_models  # noqa: F401
from fox_models.fox import SIZES
from fox_models.presets import get_preset
from fox_train.metrics import flops_per_token, peak_flops
from fox_train.parallelize import CUDA_GRAPH_MODES, compile_blocks

# (name, preset family, config overrides (``head_dim``: the number of heads that gives it), recompute_projections,
# activation memory budget of the compiled blocks or None)
MODELS = [
    ("FoX (Pro)", "fox-pro", {}, False, None),
    ("FoX (Pro) + pruning", "fox-pro", {"log_pruning_tolerance": -10.0}, False, None),
    ("FoX (Pro) + recompute", "fox-pro", {}, True, None),
    ("FoX (Pro) + memory budget 0.8", "fox-pro", {}, False, 0.8),
    # not the paper's FoX (it uses head dim 64): how much of the gap is the head dim
    ("FoX (Pro), head dim 128", "fox-pro", {"head_dim": 128}, False, None),
    ("FoX (LLaMA)", "fox-llama", {}, False, None),
    ("Transformer (Pro)", "transformer-pro", {}, False, None),
    ("Transformer (LLaMA, SDPA)", "transformer-llama", {}, False, None),
    ("Transformer (LLaMA, SDPA) + memory budget 0.8", "transformer-llama", {}, False, 0.8),
]
# --baselines: (name, preset family, built by flash-linear-attention); the fla rows are its models of our configs
BASELINES = [
    ("Mamba-2", "mamba2", False),
    ("Mamba-2 (fla's model)", "mamba2", True),
    ("HGRN2", "hgrn2", False),
    ("HGRN2 (fla's model)", "hgrn2", True),
    ("DeltaNet", "delta_net", False),
    ("DeltaNet (fla's model)", "delta_net", True),
    ("SAMBA", "samba", False),
    ("Transformer-SWA", "transformer-swa", False),
]
# MFU counts full causal attention FLOPs: only these families have them
FULL_ATTENTION = {"fox-pro", "fox-llama", "transformer-pro", "transformer-llama"}


def kernel_kind(name):
    """A rough class of a GPU kernel by its name: inductor (compiled pointwise and reductions), loss (the
    fused cross-entropy), attention, gemm (cuBLAS/CUTLASS), other."""
    n = name.lower()
    if n.startswith("triton_"):
        return "inductor"
    if n.startswith("_ce_"):
        return "loss"
    if any(s in n for s in ("cudnn", "flash", "fmha", "gluon_", "_fwd_kernel", "_bwd_kernel", "_dkdv", "_dq_", "attention")):
        return "attention"
    if any(s in n for s in ("nvjet", "xmma", "cutlass", "gemm")):
        return "gemm"
    return "other"


def kernel_profile(step, top, trace=None):
    """GPU time of one step by kernel name (ms, costliest first), with the step's total GPU time and
    wall time; ``trace``: also write a Chrome trace (CPU and GPU) of the step to this path."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    if trace:
        prof.export_chrome_trace(trace)
    times = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time / 1e3
    ranked = sorted(times.items(), key=lambda kv: -kv[1])
    kinds = {}
    for n, t in times.items():
        kind = kernel_kind(n)
        kinds[kind] = kinds.get(kind, 0.0) + t
    return dict(gpu_ms=sum(times.values()), wall_ms=wall * 1e3, by_kind=kinds,
                kernels=[dict(name=n, ms=t) for n, t in ranked[:top]])


def set_memory_budget(budget):
    """Inductor's activation memory budget for the blocks compiled next (None: torch's default, 1.0); a
    change drops dynamo's caches, which would otherwise reuse blocks partitioned under the old budget."""
    import torch._functorch.config as functorch_config

    budget = 1.0 if budget is None else budget
    if functorch_config.activation_memory_budget != budget:
        functorch_config.activation_memory_budget = budget
        torch._dynamo.reset()


def measure(name, family, size, extra, recompute, seq_len, steps, warmup, checkpointing, compiled,
            profile_top=0, trace=None, compile_mode=None, memory_budget=None, fla=False):
    """One model's row; ``fla``: flash-linear-attention's model of the preset's config instead of ours
    (eager, its own loss)."""
    compiled = compiled and not fla
    set_memory_budget(memory_budget if compiled else None)
    extra = dict(extra)
    if "head_dim" in extra:  # as many heads as the hidden size holds
        extra["num_heads"] = SIZES[size][0] // extra.pop("head_dim")
    config = get_preset(f"{family}-{size}", **extra)
    torch.manual_seed(0)
    if fla:
        from fox_models.fla_reference import fla_model

        model = fla_model(config).cuda()
    else:
        model = AutoModelForCausalLM.from_config(config).cuda()
    if checkpointing:
        model.gradient_checkpointing_enable()
    if recompute:
        model.enable_projection_recompute()
    if compiled:
        compile_blocks(model, compile_mode)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    embedding = model.get_input_embeddings().weight
    n_params = sum(p.numel() for p in model.parameters() if p is not embedding)
    labels = torch.randint(0, config.vocab_size, (1, seq_len), device="cuda")
    inputs = torch.roll(labels, 1, 1)
    torch.cuda.reset_peak_memory_stats()

    def step():
        if compiled and compile_mode in CUDA_GRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fla:  # its models shift the labels themselves
                loss = model(input_ids=labels, labels=labels).loss
            else:
                loss = model(input_ids=inputs, labels=labels, per_token_loss=True).loss.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    pauses = []  # (generation, ms) of every garbage collection while timing
    started = {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - started.pop("t", time.perf_counter())) * 1e3))

    gc.callbacks.append(on_gc)
    try:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / steps
    finally:
        gc.callbacks.remove(on_gc)
    tps = seq_len / dt
    peak = peak_flops(torch.device("cuda"))
    row = dict(model=name, size=size, seq_len=seq_len, tokens_per_s=tps, step_s=dt,
               mfu=tps * flops_per_token(config, seq_len, n_params) / peak
               if peak and family in FULL_ATTENTION else None,
               peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30, params_non_embedding=n_params,
               gc_collections=len(pauses), gc_ms=sum(ms for _, ms in pauses),
               gc_longest=max(pauses, key=lambda x: x[1], default=None), activation_memory_budget=memory_budget,
               compiled=compiled, checkpointing=checkpointing)
    if profile_top:
        path = None
        if trace:
            os.makedirs(trace, exist_ok=True)
            path = os.path.join(trace, re.sub(r"\W+", "-", f"{name} {size}").strip("-").lower() + ".json")
        row["profile"] = kernel_profile(step, profile_top, path)
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["125m", "760m"])
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block")
    ap.add_argument("--compile-mode", default=None,
                    help='torch.compile mode of the blocks, e.g. "reduce-overhead" (CUDA graphs)')
    ap.add_argument("--unfused-loss", action="store_true",
                    help="the unfused loss (fuse_cross_entropy=False: float32 log-softmax per chunk) for comparison")
    ap.add_argument("--models", nargs="*", default=None, help="names to run (substring match, or the whole name after '='); default all")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, profile one step per model and list its N costliest GPU kernels")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="with --profile: write a Chrome trace of each profiled step into DIR")
    ap.add_argument("--budgets", nargs="*", type=float, default=[], metavar="B",
                    help="also FoX (Pro) with each of these activation memory budgets (0 < B <= 1), e.g. 0.9 0.95")
    ap.add_argument("--baselines", action="store_true",
                    help="the recurrent baselines beside flash-linear-attention's models of their configs, SAMBA "
                         "and Transformer-SWA, instead of FoX and the Transformers")
    ap.add_argument("--out", default="train_throughput.json")
    args = ap.parse_args()
    if any(not 0 < b <= 1 for b in args.budgets):
        ap.error(f"--budgets: each budget must be in (0, 1], got {args.budgets}")
    swept = {f"FoX (Pro) + memory budget {b:g}": b for b in args.budgets}  # a repeated budget runs once
    if args.baselines and args.budgets:
        ap.error("--budgets applies to FoX (Pro), which --baselines does not run")
    if args.baselines:
        models = [(name, family, {}, False, None, fla) for name, family, fla in BASELINES]
    else:
        models = [(*m, False) for m in MODELS] + [(name, "fox-pro", {}, False, b, False) for name, b in swept.items()
                                                  if name not in {m[0] for m in MODELS}]
    if args.trace and not args.profile:
        ap.error("--trace DIR writes the trace of the profiled step: add --profile N")
    def chosen(name, pattern):
        return name == pattern[1:] if pattern.startswith("=") else pattern in name

    unmatched = [m for m in args.models or [] if not any(chosen(name, m) for name, *_ in models)]
    if unmatched:
        ap.error(f"--models: no model matches {unmatched}; the models are {[name for name, *_ in models]}")
    rows = []
    for size in args.sizes:
        for name, family, extra, recompute, budget, fla in models:
            if args.models and not any(chosen(name, m) for m in args.models):
                continue
            if fla and family == "mamba2" and importlib.util.find_spec("mamba_ssm") is None:
                # without mamba_ssm its Mamba-2 falls back to a PyTorch SSD that runs out of memory at 16k
                # (an H200's 139 GiB at 125M): a row that says so instead of minutes spent reaching the error
                row = dict(model=name, size=size, seq_len=args.seq_len, error="needs mamba_ssm (not installed)")
                rows.append(row)
                print(row, flush=True)
                continue
            try:
                if args.unfused_loss:
                    extra = {**extra, "fuse_cross_entropy": False}
                row = measure(name, family, size, extra, recompute, args.seq_len, args.steps, args.warmup,
                              args.checkpointing, args.compile, args.profile, args.trace, args.compile_mode,
                              budget, fla)
            except torch.OutOfMemoryError:
                row = dict(model=name, size=size, seq_len=args.seq_len, error="out of memory")
            if "error" in row:  # outside the handler, whose traceback holds the failed step's tensors
                gc.collect()
                torch.cuda.empty_cache()
                if args.baselines and not args.checkpointing:  # a baseline that does not fit: its speed with
                    with contextlib.suppress(torch.OutOfMemoryError):  # gradient checkpointing, marked in the row
                        row = measure(name, family, size, extra, recompute, args.seq_len, args.steps,
                                      args.warmup, True, args.compile, args.profile, args.trace,
                                      args.compile_mode, budget, fla)
                    gc.collect()
                    torch.cuda.empty_cache()
            rows.append(row)
            print({k: v for k, v in row.items() if k != "profile"}, flush=True)
            if "profile" in row:
                prof = row["profile"]
                kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(prof["by_kind"].items()))
                print(f"  one profiled step: {prof['wall_ms']:.1f} ms wall, {prof['gpu_ms']:.1f} ms of GPU kernels ({kinds}); costliest:")
                for kern in prof["kernels"]:
                    print(f"  {kern['ms']:8.2f} ms  {kern['name'][:110]}")
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               compile=args.compile, compile_mode=args.compile_mode, checkpointing=args.checkpointing,
               fused_loss=not args.unfused_loss)
    print("\n" + " | ".join(f"{k}={v}" for k, v in env.items()))
    reference, label = ("Transformer-SWA", "vs Transformer-SWA") if args.baselines else \
        ("Transformer (LLaMA", "vs Transformer (LLaMA)")
    print(f"{'model':46s} {'size':5s} {'tokens/s':>10s} {'MFU':>6s} {'peak GiB':>9s} {label:>23s}")
    for size in args.sizes:
        base = next((r["tokens_per_s"] for r in rows if r["size"] == size and r["model"].startswith(reference) and "tokens_per_s" in r), None)
        for r in rows:
            if r["size"] != size:
                continue
            if "error" in r:
                print(f"{r['model']:46s} {size:5s} {r['error']}")
                continue
            ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"  # "-": the reference did not run
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            name = r["model"] + (" (checkpointing)" if r.get("checkpointing") and not args.checkpointing else "")
            print(f"{name:46s} {size:5s} {r['tokens_per_s']:10,.0f} {mfu:>6s} {r['peak_mem_gib']:9.1f} {ratio:>23s}")
    if args.baselines:
        print("\nours against flash-linear-attention's model of the same config (tokens/s ratio, peak memory ratio):")
        by_name = {(r["model"], r["size"]): r for r in rows if "tokens_per_s" in r}
        for size in args.sizes:
            for name, _, fla in BASELINES:
                ours, theirs = by_name.get((name, size)), by_name.get((f"{name} (fla's model)", size))
                if not fla and ours and theirs:
                    print(f"  {name:10s} {size:5s} {ours['tokens_per_s'] / theirs['tokens_per_s']:5.2f}x  "
                          f"{ours['peak_mem_gib'] / theirs['peak_mem_gib']:5.2f}x memory")
    with open(args.out, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
