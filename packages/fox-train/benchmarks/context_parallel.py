"""Context parallelism: tokens/s, MFU and peak memory of training steps at growing sequence lengths, for each
context-parallel degree, until memory runs out; and a short training run of one long sequence per step.

    python packages/fox-train/benchmarks/context_parallel.py --preset fox-pro-125m --degrees 1 2 \\
        --lengths 16384 32768 65536 --out cp.json [--checkpointing] [--train-steps 0]

Each degree d runs as its own ``torchrun --nproc_per_node=d`` job (a rank that runs out of memory ends the
job; the lengths measured before it are kept), one sequence of each length per step split across the d
GPUs (zigzag shards, ``fox_kernel.context_parallel``), bf16 autocast over float32 weights and fused
AdamW, as fox-train trains. MFU counts the model's FLOPs (``fox_train.metrics.flops_per_token``: 6N per
token plus causal attention) against the GPUs' bf16 peak. ``--train-steps S`` then trains S steps at the
longest length with the largest degree on text (the bundled King James Bible, one sequence of that length a
step) and records the loss of every step. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fox_kernel.context_parallel import ContextParallel, shard_sequence
    from fox_layers import set_attention_kernel
    from fox_models import JSONGPT2Tokenizer
    from fox_models.presets import get_preset
    from fox_train.metrics import flops_per_token, peak_flops

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    device = torch.device("cuda")
    config = get_preset(args.preset, **({"log_pruning_tolerance": -10.0} if args.pruning else {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    if world > 1:
        set_attention_kernel(model, ContextParallel())
    if args.fsdp:  # parameters, gradients and optimizer state sharded over the ranks (FSDP2), as fox-train can
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    n_params = sum(p.numel() for n, p in model.named_parameters() if n != "model.embeddings.weight")
    peak = peak_flops(device)

    def record(row):  # rank 0 appends each result as it comes: a later out-of-memory keeps the earlier ones
        if rank == 0:
            with open(args.results, "a") as f:
                f.write(json.dumps(row) + "\n")

    def step(ids):
        inputs = torch.roll(ids, 1, dims=1)
        inputs[:, 0] = 50256
        inputs, labels = (shard_sequence(x, world, rank) if world > 1 else x for x in (inputs, ids))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=inputs, labels=labels, per_token_loss=True, use_cache=False).loss.mean()
        loss.backward()
        if world > 1 and not args.fsdp:  # each rank's loss is the mean over its tokens: average the gradients
            grads = [p.grad for p in model.parameters()]
            flat = torch._utils._flatten_dense_tensors(grads) / world
            dist.all_reduce(flat)
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for T in args.lengths:
        ids = torch.randint(0, config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)).to(device)
        torch.cuda.reset_peak_memory_stats()
        step(ids)  # warm-up (Triton compilation, allocator)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(ids)
        torch.cuda.synchronize()
        dist.barrier()
        dt = (time.perf_counter() - t0) / args.steps
        mem = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        row = {"preset": args.preset, "degree": world, "seq_len": T, "checkpointing": args.checkpointing,
               "pruning": args.pruning, "fsdp": args.fsdp,
               "step_s": dt, "tokens_per_s": T / dt, "peak_mem_gib": mem.item(),
               # with pruning the kernel skips attention tiles that the FLOP count includes: no MFU
               "mfu": flops_per_token(config, T, n_params) * T / dt / (peak * world)
               if peak and not args.pruning else None}
        record(row)
    if args.train_steps:
        from fox_train.data import bundled_documents, tokenize_documents

        T = args.train_length or args.lengths[-1]
        tokens = np.asarray(tokenize_documents(bundled_documents(), JSONGPT2Tokenizer()))
        losses = []
        for s in range(args.train_steps):
            start = (s * T) % max(1, len(tokens) - T)
            ids = torch.from_numpy(tokens[start:start + T].astype(np.int64))[None].to(device)
            loss = step(ids)
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        record({"train": True, "preset": args.preset, "degree": world, "seq_len": T, "losses": losses})
    dist.destroy_process_group()


def _failure_reason(stderr: str) -> str:
    """The failing rank's own error line (torchrun's summary after it names only the rank), then the tail."""
    errors = [line.strip() for line in stderr.splitlines()
              if re.match(r"^[\w.]*(Error|Exception)\b", line.strip()) and "ChildFailedError" not in line]
    return (errors[-1] + "\n" if errors else "") + stderr[-1500:]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="fox-pro-125m")
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2])
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    p.add_argument("--steps", type=int, default=2, help="timed steps per length (after one warm-up step)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every block")
    p.add_argument("--pruning", action="store_true",
                   help="adaptive computation pruning (log_pruning_tolerance -10): at initialisation the gates forget "
                        "fast and most attention tiles are skipped; memory does not depend on it")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over the ranks (else replicated parameters)")
    p.add_argument("--train-steps", type=int, default=0)
    p.add_argument("--train-length", type=int, help="tokens a step of the training run (default: the last length)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=int, default=540, help="seconds per degree")
    p.add_argument("--out", default="context_parallel.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    rows, train = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for d in args.degrees:
            results = Path(tmp) / f"d{d}.jsonl"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={d}", __file__,
                   "--worker", "--results", str(results), "--preset", args.preset, "--steps", str(args.steps),
                   "--lr", str(args.lr), "--train-steps", str(args.train_steps if d == max(args.degrees) else 0),
                   *(["--train-length", str(args.train_length)] if args.train_length else []),
                   "--lengths", *map(str, args.lengths), *(["--checkpointing"] if args.checkpointing else []),
                   *(["--pruning"] if args.pruning else []), *(["--fsdp"] if args.fsdp else [])]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                failure = None if run.returncode == 0 else run.stderr
            except subprocess.TimeoutExpired as e:
                failure = f"timed out after {args.timeout} s: {e.stderr[-2000:] if e.stderr else ''}"
            got = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
            rows += [r for r in got if not r.get("train")]
            train += [r for r in got if r.get("train")]
            done = {r["seq_len"] for r in got if not r.get("train")}
            missing = [T for T in args.lengths if T not in done]
            if missing:
                oom = failure is not None and "OutOfMemoryError" in failure
                reason = "out of memory" if oom else _failure_reason(failure or "")
                rows.append({"preset": args.preset, "degree": d, "seq_len": missing[0], "failed": reason})
    print(f"{'degree':>6} {'seq_len':>9} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}")
    for r in rows:
        if "failed" in r:
            print(f"{r['degree']:>6} {r['seq_len']:>9}  failed: {r['failed'][:80]}")
        else:
            mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "-"
            print(f"{r['degree']:>6} {r['seq_len']:>9} {r['step_s']:>8.3f} {r['tokens_per_s']:>10.0f} {mfu:>6} "
                  f"{r['peak_mem_gib']:>9.1f}")
    for r in train:
        print(f"training, degree {r['degree']}, {r['seq_len']} tokens a step: loss "
              + " ".join(f"{x:.3f}" for x in r["losses"]))
    import torch

    meta = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "checkpointing": args.checkpointing,
            "pruning": args.pruning, "fsdp": args.fsdp}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "train": train}, indent=1))


if __name__ == "__main__":
    main()
