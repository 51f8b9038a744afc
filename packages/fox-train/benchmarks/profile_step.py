"""Where a training step's time goes, on every rank: ``fox_train.cli`` with one step recorded by torch.profiler.

Usage (any fox-train overrides; settings by environment, since Fabric starts the other ranks of a multi-GPU
run with this process's command line, and the environment reaches them):

    FOX_PROFILE_STEP=11 FOX_PROFILE_OUT=prof FOX_PROFILE_NAME=ddp4 \\
        python packages/fox-train/benchmarks/profile_step.py model=fox-pro-125m strategy=ddp strategy.devices=4 ...

The step of index ``FOX_PROFILE_STEP`` (0-based; the run must have at least that many steps plus one) is
recorded after a warm-up step, so the profiler's own start-up does not land in it. Each rank writes
``OUT/NAME-rankR.json``: the step's wall time; the GPU time with any kernel running, with a compute (non-NCCL)
kernel running, and with only NCCL kernels running (on a data-parallel step, mostly one rank waiting in a
collective for a slower one); the gaps over 0.5 ms between compute kernels with the CPU op running at each
gap's start (the host falling behind the GPU shows here); the kernels taking the most time; and the CPU ops
table. Rank 0 also writes its Chrome trace, gzipped (``OUT/NAME-rank0-trace.json.gz``, open it in Perfetto).

``FOX_PROFILE_VARIANT`` tries a change to FSDP2's gradient accumulation without editing the trainer:
``syncall`` reduce-scatters the gradients in every micro-batch (no ``no_backward_sync``); ``prefetch``
starts gathering every FSDP2 module's parameters for the next step right after the optimizer step.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import fox_train.train as trainer

GAP_US = 500  # compute gaps shorter than this are a kernel launch's ordinary latency


def _union(intervals: list[tuple[float, float]]) -> list[list[float]]:
    """The union of [start, end) intervals, as sorted disjoint intervals."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _covered(intervals: list[list[float]]) -> float:
    return sum(e - s for s, e in intervals)


def summarize(events: list[dict], wall_us: float) -> dict:
    """The step's time by what the GPU ran (see the module docstring), from Chrome trace events."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return {"wall_ms": wall_us / 1e3}
    start = min(e["ts"] for e in kernels)
    is_nccl = [("nccl" in e["name"].lower()) for e in kernels]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    compute = _union([sp for sp, n in zip(spans, is_nccl) if not n])
    nccl = _union([sp for sp, n in zip(spans, is_nccl) if n])
    busy = _union(spans)
    gaps = [(compute[i][1], compute[i + 1][0]) for i in range(len(compute) - 1)
            if compute[i + 1][0] - compute[i][1] > GAP_US]
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op", "user_annotation")]
    largest = []
    for s, e in sorted(gaps, key=lambda g: g[0] - g[1])[:15]:
        running = sorted((c for c in cpu if c["ts"] <= s <= c["ts"] + c["dur"]), key=lambda c: -c["dur"])
        largest.append({"at_ms": (s - start) / 1e3, "ms": (e - s) / 1e3, "cpu": [c["name"][:80] for c in running[-4:]]})
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e["name"][:60]] = by_name.get(e["name"][:60], 0.0) + e["dur"]
    return {"wall_ms": wall_us / 1e3, "gpu_busy_ms": _covered(busy) / 1e3, "compute_busy_ms": _covered(compute) / 1e3,
            "nccl_ms": _covered(nccl) / 1e3, "nccl_exposed_ms": (_covered(busy) - _covered(compute)) / 1e3,
            "compute_gaps_over_0.5ms": len(gaps), "compute_gap_ms_total": sum(e - s for s, e in gaps) / 1e3,
            "largest_gaps": largest,
            "top_kernels_ms": {k: v / 1e3 for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]}}


def _fsdp_modules(model):
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _apply_variant(variant: str) -> None:
    if variant == "syncall":
        @contextmanager
        def micro_batch(fabric, model, strategy, last):
            for m in _fsdp_modules(model):
                m.set_reshard_after_backward(last, recurse=False)
            yield
        trainer._micro_batch = micro_batch
    elif variant == "prefetch":
        models, plain_micro_batch, plain_step = [], trainer._micro_batch, torch.optim.AdamW.step

        @contextmanager
        def micro_batch(fabric, model, strategy, last):
            models[:] = [model]
            with plain_micro_batch(fabric, model, strategy, last):
                yield

        def step(self, *args, **kwargs):
            out = plain_step(self, *args, **kwargs)
            for m in _fsdp_modules(models[0]) if models else ():
                m.unshard(async_op=True)
            return out
        trainer._micro_batch, torch.optim.AdamW.step = micro_batch, step
    elif variant:
        raise ValueError(f"FOX_PROFILE_VARIANT must be syncall or prefetch, got {variant!r}")


def _install_profiler(step: int, out: Path, name: str) -> None:
    """Record step ``step`` (warm-up in the step before it). The trainer asks for the learning rate once at
    the start of every step, which marks the step boundaries here."""
    from torch.profiler import ProfilerActivity, profile, schedule

    calls, state = [0], {}
    lr_at = trainer.lr_at
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def report(prof):
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            result = summarize(json.loads(trace.read_text())["traceEvents"], state["wall_us"])
            if rank == 0:
                with open(trace, "rb") as src, gzip.open(out / f"{name}-rank0-trace.json.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
        result["cpu_top"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        (out / f"{name}-rank{rank}.json").write_text(json.dumps(result, indent=1))

    def marked_lr_at(tokens, cfg):
        i = calls[0]
        calls[0] += 1
        if i == step - 1:
            state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                    schedule=schedule(wait=0, warmup=1, active=1, repeat=1), on_trace_ready=report)
            state["prof"].__enter__()
        elif i == step and "prof" in state:
            sync()
            state["prof"].step()
            state["t0"] = time.perf_counter()
        elif i == step + 1 and "prof" in state:
            sync()
            state["wall_us"] = (time.perf_counter() - state["t0"]) * 1e6
            prof = state.pop("prof")
            prof.step()
            prof.__exit__(None, None, None)
        return lr_at(tokens, cfg)

    trainer.lr_at = marked_lr_at


def main() -> None:
    raw = os.environ.get("FOX_PROFILE_STEP", "")
    if not raw.strip().isdigit() or int(raw) < 1:
        raise SystemExit(f"profile_step.py: FOX_PROFILE_STEP must be a step index of at least 1 (the step before it "
                         f"warms up), got {raw!r}")
    step = int(raw)
    try:
        _apply_variant(os.environ.get("FOX_PROFILE_VARIANT", ""))
    except ValueError as error:
        raise SystemExit(f"profile_step.py: {error}") from None
    _install_profiler(step, Path(os.environ.get("FOX_PROFILE_OUT", "profile")),
                      os.environ.get("FOX_PROFILE_NAME", "run"))
    from fox_train.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
