"""Does a contender's place in the timing order move its forward+backward time? ``bench_attention.py`` times
each cell's contenders once, always in the same order (cuDNN first, ours last). Here the same contenders and
timing (``bench_attention._time``: the median of ``triton.testing.do_bench``) run in ``--rounds`` rounds in
rotating order (each takes each place), and the GPU's SM clock, power draw and temperature are sampled
every 100 ms by ``nvidia-smi`` beside them, so each time can be read against the clock it ran at. Prints a
table (median and range of each contender's rounds, cuDNN's time over its per round, the median SM clock
it ran at) and writes JSON (every sample with its clock and power).

    python packages/fox-kernel/benchmarks/order_ab.py --rounds 4 --out order.json
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import time

import torch
from bench_attention import _env, _flops, _inputs, _ours, _sdpa, _time
from bench_pruning import rotated
from plot_args import read_run
from torch.nn.attention import SDPBackend

SHAPES = [(1, 16384, 16, 128), (1, 16384, 32, 64), (4, 4096, 16, 128), (4, 4096, 32, 64)]  # (B, T, H, D)


def clock_log(path: str):
    """``nvidia-smi`` sampling time, SM clock (MHz), power (W) and temperature (C) every 100 ms into path."""
    return subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits",
         "-lms", "100", "-f", path])


def annotate(result: dict, log_path: str) -> None:
    """Adds to each sample the median SM clock (MHz) and power (W) of the log's samples inside its timing
    window (``nvidia-smi`` stamps local time, as ``time.time()`` reads it on the same host)."""
    log = []
    with open(log_path) as f:
        for row in csv.reader(f):
            try:
                stamp = datetime.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                log.append((stamp, float(row[1]), float(row[2])))
            except (ValueError, IndexError):  # a line cut short when the logger stopped
                continue
    for cell in result["cells"]:
        for s in cell["samples"]:
            inside = [x for x in log if s["start"] <= x[0] <= s["end"]]
            s["sm_clock_mhz"] = statistics.median(x[1] for x in inside) if inside else None
            s["power_w"] = statistics.median(x[2] for x in inside) if inside else None


def table(result: dict) -> str:
    """Per cell and contender: median time of the rounds, its range, TFLOP/s, cuDNN's time over its per
    round, and the median SM clock it ran at."""
    lines = []
    for cell in result["cells"]:
        B, T, H, D = (cell[x] for x in "BTHD")
        lines.append(f"\nB={B} T={T} H={H} D={D}, fwd+bwd, {result['rounds']} rotating rounds")
        names = list(dict.fromkeys(s["contender"] for s in cell["samples"]))
        by = {n: [s for s in cell["samples"] if s["contender"] == n] for n in names}
        cudnn = [s["ms"] for s in by["sdpa_cudnn"]]
        for name, samples in by.items():
            ms = [s["ms"] for s in samples]
            clocks = [s["sm_clock_mhz"] for s in samples if s.get("sm_clock_mhz") is not None]
            clock = f"{statistics.median(clocks):5.0f} MHz" if clocks else "   (no log)"
            lines.append(f"{name:>13} | median {statistics.median(ms):7.3f} ms ({min(ms):.3f}-{max(ms):.3f}) | "
                         f"{_flops(B, H, T, D, 'fwd+bwd') / statistics.median(ms) / 1e9:6.1f} TFLOP/s | SM clock "
                         f"{clock} | cuDNN / it per round: {' '.join(f'{c / m:.3f}' for c, m in zip(cudnn, ms))}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="order_ab.json")
    ap.add_argument("--clock-log", default="order_ab_clocks.csv", help="where nvidia-smi's samples go")
    ap.add_argument("--from-json", metavar="JSON", help="print that earlier run's table, its samples annotated "
                    "with --clock-log's clocks (no GPU), and write it back annotated")
    args = ap.parse_args()
    if args.from_json:
        result = read_run(args.from_json, "--from-json")
        if not os.path.isfile(args.clock_log):
            raise SystemExit(f"--clock-log: no such file: {args.clock_log}")
        annotate(result, args.clock_log)
        with open(args.from_json, "w") as f:
            json.dump(result, f, indent=1)
        print(table(result))
        return
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        raise SystemExit("order_ab.py needs a CUDA GPU")
    contenders = {"sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
                  "fox one-pass": _ours("fused"), "fox (ours)": _ours()}
    logger = clock_log(args.clock_log)
    result = dict(env=_env(), rounds=args.rounds, clock_log=os.path.basename(args.clock_log), cells=[])
    try:
        for B, T, H, D in SHAPES:
            torch.manual_seed(0)
            inputs = _inputs(B, T, H, H, D)
            cell = dict(B=B, T=T, H=H, D=D, mode="fwd+bwd", samples=[])
            for r in range(args.rounds):
                for place, name in enumerate(rotated(list(contenders), r)):
                    start = time.time()
                    ms = _time(contenders[name], inputs, "fwd+bwd")
                    cell["samples"].append(dict(round=r, place=place, contender=name, ms=ms, start=start,
                                                end=time.time()))
            result["cells"].append(cell)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            print(f"B={B} T={T} H={H} D={D} done", flush=True)
    finally:
        logger.terminate()
        logger.wait()
    annotate(result, args.clock_log)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


if __name__ == "__main__":
    main()
