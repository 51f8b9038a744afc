"""benchmarks/ncu_profile.py, benchmarks/pruning_overhead.py and bench_attention.py's plot: what they read and
compute, without a GPU.

ncu_profile reads Nsight Compute's raw CSV page; pruning_overhead reports the share of key tiles a per-head
bound keeps. Both are checked against values worked out here by hand or by a plain loop. bench_attention
draws the tables of a run's JSON."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


RAW = "\n".join([
    "==PROF== Connected to process 1",
    '"ID","Kernel Name","gpu__time_duration.sum","sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
    '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","launch__registers_per_thread"',
    '"","","nsecond","%","ratio","ratio","register/thread"',
    '"0","gluon_dkdv_kernel(int)","3,406,512","67.83","3.12","1.51","168"',
    '"1","cudnn_generated_fort_native_sdpa_sm90_flash_bprop","4,545,900","64.2","1.87","2.5","168"',
    "==PROF== Disconnected from process 1",
])


def test_ncu_raw_page_is_read_per_kernel(benchmark_script):
    ncu = benchmark_script("ncu_profile")
    kernels = ncu._parse_raw(RAW)
    assert [k["Kernel Name"] for k in kernels] == ["gluon_dkdv_kernel(int)", "cudnn_generated_fort_native_sdpa_sm90_flash_bprop"]
    first = ncu._summary(kernels[0])
    assert first["us"] == pytest.approx(3406.512)  # ns, with thousands separators, to us
    assert first["tensor %"] == pytest.approx(67.83) and first["regs"] == 168
    assert math.isnan(first["DRAM %"])  # a counter the page lacks is NaN, not 0
    assert list(first["stalls"].items()) == [("barrier", 3.12), ("wait", 1.51)]  # largest first
    assert list(ncu._summary(kernels[1])["stalls"]) == ["wait", "barrier"]
    assert ncu._parse_raw("==PROF== nothing profiled") == []
    assert not ncu.is_reference(kernels[0]["Kernel Name"]) and ncu.is_reference(kernels[1]["Kernel Name"])


def test_ncu_plot_draws_a_png(tmp_path, benchmark_script):
    pytest.importorskip("matplotlib")
    ncu = benchmark_script("ncu_profile")
    kernels = [ncu._summary(k) for k in ncu._parse_raw(RAW)]
    result = dict(env=dict(gpu="test"), case=dict(shape=dict(B=1, T=2, H=3, Hkv=3, D=4), kernels=kernels))
    path = tmp_path / "ncu.png"
    ncu.plot(result, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("cited", ["bench-attention-zero-reports-h200-2026-11-28.json",  # without FlexAttention
                                   "bench-attention-official-h200-2026-11-28.json"])
def test_bench_attention_plot_draws_the_cited_run_and_a_partial_one(tmp_path, cited, benchmark_script):
    pytest.importorskip("matplotlib")
    import json

    bench = benchmark_script("bench_attention")
    run = json.loads((BENCH / cited).read_text())
    for name, result in (("whole", run), ("attention-only", dict(env=run["env"], attention=run["attention"][:3]))):
        path = tmp_path / f"{name}.png"
        bench.plot(result, str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no attention, acp or decode rows"):
        bench.plot(dict(env=run["env"]), str(tmp_path / "empty.png"))


@pytest.mark.parametrize("text,message", [(None, "no such file"), ("{not json", "is not JSON")])
def test_plot_from_a_missing_or_broken_file_is_one_clear_error(tmp_path, text, message, benchmark_script):
    import argparse

    plot_args = benchmark_script("plot_args")
    path = tmp_path / "run.json"
    if text is not None:
        path.write_text(text)
    args = argparse.Namespace(plot_from=str(path), plot=str(tmp_path / "out.png"))
    with pytest.raises(SystemExit, match=f"--plot-from: .*{message}"):
        plot_args.plotted_from_json(args, lambda result, out: None)
    assert not (tmp_path / "out.png").exists()


@pytest.mark.parametrize("shift,bound", [(7.4, -10.0), (0.0, -3.0), (1.0, -6.0)])
def test_kept_share_counts_tile_pairs_as_a_loop_does(shift, bound, benchmark_script):
    overhead = benchmark_script("pruning_overhead")
    g = torch.Generator().manual_seed(11)
    B, T, H = 2, 320, 3
    lf = F.logsigmoid(torch.randn(B, T, H, generator=g) + shift)
    q = torch.zeros(B, T, H, 8)
    threshold = torch.full((H,), bound) + torch.arange(H) * 0.5  # one bound per head
    c = torch.cumsum(lf.double(), dim=1)
    n, kept, total = T // 64, 0, 0
    for b in range(B):
        for h in range(H):
            for i in range(n):
                for j in range(i + 1):  # causal tile pairs
                    total += 1
                    largest = c[b, 64 * i, h] - c[b, 64 * j + 63, h]  # first query, last key
                    kept += bool(largest >= threshold[h].double())
    got = overhead.kept_share(q, q, lf, threshold)
    assert got == pytest.approx(kept / total, abs=1e-6)  # one tile pair is 1/90 here
    assert 0 < got <= 1


def test_bench_attention_rounds_time_every_pruning_contender_in_turn(monkeypatch, benchmark_script):
    """``--rounds``: each contender is timed once per round, and round r starts at the r-th contender, so
    that none always follows the same one; every sample is returned in its own round's place."""
    bench = benchmark_script("bench_attention")
    order = []

    def timed(fn, args, mode):
        order.append(fn)
        return float(len(order))  # the n-th timing of the run reads n ms

    monkeypatch.setattr(bench, "_time", timed)
    times = bench.eager_rounds({"a": "a", "b": "b", "c": "c"}, None, "fwd", 4)
    assert order == list("abc" "bca" "cab" "abc")
    assert times == {"a": [1.0, 6.0, 8.0, 10.0], "b": [2.0, 4.0, 9.0, 11.0], "c": [3.0, 5.0, 7.0, 12.0]}
    assert bench.eager_rounds({"a": "a"}, None, "fwd", 1) == {"a": [13.0]}


def test_bench_attention_refuses_fewer_than_one_round(monkeypatch, benchmark_script):
    bench = benchmark_script("bench_attention")
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--rounds", "0"])
    with pytest.raises(SystemExit, match=r"^--rounds must be at least 1, got 0$"):
        bench.main()


def test_zero_reports_ab_switches_name_real_bool_attributes(benchmark_script):
    """Each ``--switch`` of zero_reports_ab.py sets a module attribute that exists and is a bool, and its
    round times our default call with it on and off beside the floor and the official call."""
    import importlib

    ab = benchmark_script("zero_reports_ab")
    for switch, (module, attribute, on, off) in ab.SWITCHES.items():
        if switch == "descriptors":
            pytest.importorskip("triton.experimental.gluon")
        assert isinstance(getattr(importlib.import_module(module), attribute), bool)
        calls = ab.calls_of(switch)
        assert calls[on] == ("ours auto", True) and calls[off] == ("ours auto", False) and len(calls) == 4


def test_markdown_tables_of_a_partial_run(benchmark_script):
    """A run without the official kernel or FlexAttention shows dashes there and bolds the fastest FoX kernel
    it has; a run with attention rows alone gives one table."""
    bench = benchmark_script("bench_attention")
    row = dict(B=2, T=8192, H=32, Hkv=8, D=128, mode="fwd+bwd", sdpa_cudnn=500.0, sdpa_flash=300.0, fla=190.04,
               **{"fox one-pass": 480.0, "fox (ours)": 510.26, "sdpa_cudnn graph": 490.0, "fox (ours) graph": 480.0})
    (table,) = bench.markdown_tables(dict(env={}, attention=[row]))
    assert table.splitlines()[1] == "|---|" * 1 + "---|" * 12
    assert table.splitlines()[2] == ("| 8k ×2 | 32/8 | 128 | fwd+bwd | 500.0 | 300.0 | — | 190.0 | — | 480.0 | **510.3** "
                                     "| **1.02** | 0.98 |")


def test_markdown_from_a_missing_file_is_one_clear_error(monkeypatch, tmp_path, benchmark_script):
    bench = benchmark_script("bench_attention")
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", "--markdown-from", str(tmp_path / "none.json")])
    with pytest.raises(SystemExit, match=r"^--markdown-from: no such file: .*none\.json$"):
        bench.main()


def test_decode_layout_ab_keeps_the_values_in_both_layouts(monkeypatch, benchmark_script):
    """decode_layout_ab.py: the head-major copy holds the same (B, T, H) values over (B, H, T) memory, a paged
    pool puts page i of the cache at slot perm[i], and fewer than one round is refused in one line."""
    ab = benchmark_script("decode_layout_ab")
    c = torch.randn(2, 8, 3, dtype=torch.float64)
    head_major = ab.head_major(c)
    assert torch.equal(head_major, c) and head_major.stride() == (24, 1, 8)
    perm = torch.tensor([2, 0, 3, 1])
    pool = ab.paged(c, perm, 4)
    for i in range(4):
        assert torch.equal(pool[perm[i]], c.reshape(4, 4, 3)[i])
    monkeypatch.setattr(sys, "argv", ["decode_layout_ab.py", "--rounds", "0"])
    with pytest.raises(SystemExit, match=r"^--rounds must be at least 1, got 0$"):
        ab.main()


def test_order_ab_reads_each_samples_clock_from_its_window(benchmark_script, tmp_path):
    """order_ab.annotate takes the median SM clock and power of the log lines inside each sample's window
    (a line cut short is skipped), and its table gives cuDNN's time over each contender's per round."""
    import datetime

    order = benchmark_script("order_ab")
    t0 = datetime.datetime(2026, 11, 29, 4, 23, 11, 700000)

    def stamp(seconds):
        return (t0 + datetime.timedelta(seconds=seconds)).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]

    clocks = [1980, 1965, 1700, 1710, 1690, 1845, 1830, 1815]
    lines = [f"{stamp(0.1 * i)}, {c}, {300 + 50 * i:.2f}, 40" for i, c in enumerate(clocks)]
    lines.insert(3, f"{stamp(0.25)}, 17")  # cut short
    log = tmp_path / "clocks.csv"
    log.write_text("\n".join(lines) + "\n")
    start = t0.timestamp()
    samples = [dict(round=0, place=0, contender="sdpa_cudnn", ms=7.3, start=start + 0.15, end=start + 0.45),
               dict(round=0, place=1, contender="fox (ours)", ms=7.9, start=start + 0.45, end=start + 0.75),
               dict(round=1, place=0, contender="fox (ours)", ms=8.0, start=start + 5, end=start + 6)]
    result = dict(rounds=1, cells=[dict(B=1, T=16384, H=16, D=128, samples=samples)])
    order.annotate(result, str(log))
    assert samples[0]["sm_clock_mhz"] == 1700 and samples[0]["power_w"] == 450  # 0.2, 0.3, 0.4 s
    assert samples[1]["sm_clock_mhz"] == 1830  # 0.5, 0.6, 0.7 s: 1845, 1830, 1815
    assert samples[2]["sm_clock_mhz"] is None  # no log line inside its window
    text = order.table(result)
    assert f"cuDNN / it per round: {7.3 / 7.9:.3f}" in text
    assert "1830 MHz" in text and "1700 MHz" in text


@pytest.mark.parametrize("which", ["json", "log"])
def test_order_ab_names_a_missing_file_in_one_line(benchmark_script, monkeypatch, tmp_path, which):
    order = benchmark_script("order_ab")
    run = tmp_path / "run.json"
    run.write_text('{"rounds": 1, "cells": []}')
    argv = ["order_ab.py", "--from-json", str(tmp_path / "none.json") if which == "json" else str(run),
            "--clock-log", str(tmp_path / "none.csv")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stop:
        order.main()
    flag = "--from-json" if which == "json" else "--clock-log"
    assert str(stop.value).startswith(f"{flag}: no such file: ") and "\n" not in str(stop.value)
