"""Decoding bandwidth of two source trees of fox-kernel side by side on one GPU: this checkout and another
(``--before``, e.g. ``git archive <commit> packages/fox-kernel/src | tar -x -C before``), in interleaved
rounds of fresh processes, with SDPA without a gate in every round. Each process checks its outputs against
a float32 PyTorch reference. Prints the bandwidth (the cache's K/V bytes over the median time) of every
round, eager and replayed from a CUDA graph (GPU time: no host cost), and the host time of one call (a
small cache, so the GPU never holds the host back) with whether the calls went through the cached
launchers (``launch.CACHED``), and writes JSON.

    python packages/fox-kernel/benchmarks/decode_trees_ab.py --before before/packages/fox-kernel/src \\
        --out decode-trees-ab.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [(8, 32768, 32, 8, 128), (64, 4096, 32, 8, 128), (1, 131072, 32, 8, 128), (8, 16384, 32, 8, 128),
          (32, 8192, 32, 8, 128)]
HERE = Path(__file__).resolve()
AFTER = HERE.parents[1] / "src"


def reference(q, k, v, c, lens):
    """float32 decode of the last token: softmax(q k^T / sqrt(D) + c_q - c_k) v over the whole cache."""
    import torch

    B, _, H, D = q.shape
    group = H // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2)
    vf = v.float().repeat_interleave(group, dim=2)
    s = torch.einsum("bhd,bthd->bht", q[:, 0].float(), kf) * D**-0.5
    s = s + (c[:, -1:, :] - c).transpose(1, 2)
    return torch.einsum("bht,bthd->bhd", s.softmax(-1), vf)[:, None]


def worker() -> None:
    """One round in this process: the bandwidth of ours and of SDPA at every shape, as one JSON line."""
    import torch
    import torch.nn.functional as F
    import triton

    from fox_kernel import forgetting_attention_with_kvcache
    from fox_kernel.testing import decode_inputs

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def graphed(fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    q, k, v, c, lens = decode_inputs(1, 1024, 32, 8, 128)
    for _ in range(20):
        forgetting_attention_with_kvcache(q, k, v, c, lens)
    # the median of 11 batches of 100 calls, each batch timed from a synchronised start: one batch caught by
    # another process or by the garbage collector moves the median little
    batches = []
    for _ in range(11):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            forgetting_attention_with_kvcache(q, k, v, c, lens)
        batches.append((time.perf_counter() - start) / 100 * 1e6)
    torch.cuda.synchronize()
    host_us = statistics.median(batches)
    from fox_kernel.ops.triton import launch

    # whether the calls went through the compiled kernels' launchers (False: Triton's slower path, for good
    # after a launcher refused the arguments), so a difference in host time can be told from a fallback
    cached = getattr(launch, "CACHED", None)
    row = {}
    for B, T, H, Hkv, D in SHAPES:
        q, k, v, c, lens = decode_inputs(B, T, H, Hkv, D)
        out = forgetting_attention_with_kvcache(q, k, v, c, lens).float()
        err = (out - reference(q, k, v, c, lens)).abs().max().item()
        if not err < 2e-2:
            raise SystemExit(f"decode_trees_ab.py: B={B} T={T} differs from the reference by {err:.3g}")
        kv_bytes = 2 * k.numel() * k.element_size()
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        ours = functools.partial(forgetting_attention_with_kvcache, q, k, v, c, lens)
        sdpa = functools.partial(F.scaled_dot_product_attention, qt, kt, vt, enable_gqa=True)
        row[f"B={B} T={T}"] = dict(ours=kv_bytes / bench(ours) / 1e9, sdpa=kv_bytes / bench(sdpa) / 1e9,
                                   ours_graph=kv_bytes / bench(graphed(ours)) / 1e9,
                                   sdpa_graph=kv_bytes / bench(graphed(sdpa)) / 1e9, max_err=err)
        del q, k, v, c, out, qt, kt, vt, ours, sdpa
        torch.cuda.empty_cache()
    print(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                          host_us=host_us, host_us_batches=batches, cached_launch=cached, tbps=row)))


def run_tree(src: Path, script: Path = HERE, *worker_args: str, cpu: int | None = None) -> dict:
    """The last JSON line of ``script --worker *worker_args`` run in a fresh process that imports fox_kernel
    from ``src``, on CPU ``cpu`` alone when given."""
    paths = [str(src)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and "fox-kernel" not in p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    done = subprocess.run([sys.executable, str(script), "--worker", *worker_args], env=env, capture_output=True,
                          text=True, preexec_fn=pin)
    if done.returncode != 0:
        raise SystemExit(f"{script.name}: the run of {src} failed: {(done.stderr or done.stdout)[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def tree_args(doc: str, rounds: int, out: str) -> argparse.ArgumentParser:
    """The command line both tree comparisons share: --before, --rounds, --out, --cpu (and the hidden
    --worker)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--before", type=Path, help="the other tree's fox-kernel src folder")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--out", default=out)
    # the lent GPU hosts are virtual machines whose CPUs differ: the same call pinned to each of eight CPUs of
    # one host took 76-140 us of host time, so a comparison of host times keeps both trees on one CPU
    ap.add_argument("--cpu", type=int, help="run every worker process on this CPU alone (default: any)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def interleaved_rounds(args, script: Path, describe, *worker_args: str) -> dict:
    """{"before": [...], "after": [...]}: ``args.rounds`` rounds, each one fresh process of ``script``'s worker per
    tree, the trees in turn; ``describe(result)`` is printed after each. Bad --before or --rounds stop it in
    one line."""
    if args.before is None or not (args.before / "fox_kernel").is_dir():
        raise SystemExit(f"{script.name}: --before must be a folder holding fox_kernel/, got {args.before}")
    if args.rounds < 1:
        raise SystemExit(f"{script.name}: --rounds must be >= 1, got {args.rounds}")
    if args.cpu is not None and args.cpu not in os.sched_getaffinity(0):
        raise SystemExit(f"{script.name}: --cpu must be one of this process's CPUs "
                         f"{sorted(os.sched_getaffinity(0))}, got {args.cpu}")
    trees = {"before": args.before.resolve(), "after": AFTER}
    rounds = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, src in trees.items():
            rounds[name].append(run_tree(src, script, *worker_args, cpu=args.cpu))
            print(f"round {r + 1} {name}: {describe(rounds[name][-1])}", flush=True)
    return rounds


def save_rounds(args, rounds: dict, summary: dict) -> None:
    """Writes the comparison's JSON: the GPU and versions of its first round, the summary and every round."""
    env = {k: rounds["after"][0][k] for k in ("gpu", "torch", "triton")}
    with open(args.out, "w") as f:
        json.dump(dict(env=env, before=str(args.before), cpu=args.cpu, summary=summary, rounds=rounds), f, indent=1)


def main() -> None:
    args = tree_args(__doc__, 3, "decode-trees-ab.json").parse_args()
    if args.worker:
        return worker()
    rounds = interleaved_rounds(args, HERE, lambda last: f"host {last['host_us']:.0f} us/call "
        f"(cached launches: {last.get('cached_launch')}); " + ", ".join(
        f"{s} {v['ours']:.2f} (graph {v['ours_graph']:.2f}; SDPA {v['sdpa']:.2f})" for s, v in last["tbps"].items()))
    trees = list(rounds)
    summary = {name: dict(host_us=statistics.median(r["host_us"] for r in rounds[name])) for name in trees}
    print(f"host time per call (us): before {summary['before']['host_us']:.0f}, after {summary['after']['host_us']:.0f}")
    print(f"{'shape':14} {'mode':6} {'before':>7} {'after':>7} {'SDPA':>7} {'after/SDPA':>10}  (TB/s, medians of the rounds)")
    for shape in rounds["after"][0]["tbps"]:
        for mode, key in (("eager", ""), ("graph", "_graph")):
            med = {name: statistics.median(r["tbps"][shape]["ours" + key] for r in rounds[name]) for name in trees}
            sdpa = statistics.median(r["tbps"][shape]["sdpa" + key] for name in trees for r in rounds[name])
            summary.setdefault(shape, {})[mode] = dict(before=med["before"], after=med["after"], sdpa=sdpa,
                                                       after_over_sdpa=med["after"] / sdpa)
            print(f"{shape:14} {mode:6} {med['before']:7.2f} {med['after']:7.2f} {sdpa:7.2f} {med['after'] / sdpa:10.3f}")
    save_rounds(args, rounds, summary)


if __name__ == "__main__":
    main()
