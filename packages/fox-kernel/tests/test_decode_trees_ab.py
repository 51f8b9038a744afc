"""benchmarks/decode_trees_ab.py, pruning_trees_ab.py and attention_trees_ab.py: the decoding reference is the
decoding call's result, bad arguments stop each script in one line, --cpu runs the worker processes on that
CPU alone, and attention_trees_ab's table is made of the right rounds' medians. Also launch_groups_ab's
settings: set for the call timed, restored after it; eager_pruned_forward.py stops in one line without a GPU;
launch_groups_ab.py and plans_ab.py stop in one line on a bad --rounds or without a GPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from fox_kernel import forgetting_attention_with_kvcache
from fox_kernel.testing import decode_inputs

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "decode_trees_ab.py"


@pytest.mark.parametrize("B,T,H,Hkv,D", [(2, 37, 6, 3, 24), (1, 129, 4, 1, 16)])
def test_reference_is_the_decoding_call(B, T, H, Hkv, D, benchmark_script):
    q, k, v, c, lens = decode_inputs(B, T, H, Hkv, D, device="cpu", dtype=torch.float64, seed=3)
    expected = forgetting_attention_with_kvcache(q, k, v, c, lens)
    got = benchmark_script("decode_trees_ab").reference(q, k, v, c, lens)
    assert (got.double() - expected).abs().max().item() < 1e-5  # the reference is float32


@pytest.mark.parametrize("argv,message", [
    (["--before", "/nonexistent"], "--before must be a folder holding fox_kernel/"),
    (["--before", str(SCRIPT.parents[1] / "src"), "--rounds", "0"], "--rounds must be >= 1"),
    (["--before", str(SCRIPT.parents[1] / "src"), "--cpu", "100000"], "--cpu must be one of this process's CPUs"),
])
@pytest.mark.parametrize("script", ["decode_trees_ab", "pruning_trees_ab", "attention_trees_ab"])
def test_bad_arguments_stop_in_one_line(monkeypatch, argv, message, script, benchmark_script):
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # pruning_trees_ab imports decode_trees_ab
    with pytest.raises(SystemExit) as stop:
        benchmark_script(script).main()
    assert message in str(stop.value) and "\n" not in str(stop.value)


@pytest.mark.parametrize("pinned", [True, False])
def test_run_tree_pins_the_worker_to_the_cpu_asked(tmp_path, pinned, benchmark_script):
    """A worker started by run_tree reports the CPUs it may run on: the one asked for, or all of ours."""
    worker = tmp_path / "worker.py"
    worker.write_text("import json, os, sys\nassert sys.argv[1:] == ['--worker', 'x']\n"
                      "print(json.dumps(sorted(os.sched_getaffinity(0))))\n")
    ours = sorted(os.sched_getaffinity(0))
    cpu = ours[-1] if pinned else None
    got = benchmark_script("decode_trees_ab").run_tree(SCRIPT.parents[1] / "src", worker, "x", cpu=cpu)
    assert got == ([cpu] if pinned else ours)


def test_attention_trees_table_takes_each_cells_medians(monkeypatch, capsys, benchmark_script):
    """Before/after medians per cell over the rounds, cuDNN's time over ours from the after tree's rounds,
    and the cells only one tree has (one program per tile) kept without a before."""
    script = benchmark_script("attention_trees_ab")
    case = "B=1 T=16384 H=16/16 D=128 fwd"
    rounds = {
        "before": [{"cells": {f"{case}|ours": ms, f"{case}|cudnn": 1.0}} for ms in (2.0, 9.0, 2.2)],
        "after": [{"cells": {f"{case}|ours": ms, f"{case}|cudnn": c, f"{case}|ours per tile": 3.0}}
                  for ms, c in ((1.8, 1.5), (1.9, 1.6), (1.0, 1.7))],
    }
    saved = {}
    monkeypatch.setattr(script, "interleaved_rounds", lambda *a, **k: rounds)
    monkeypatch.setattr(script, "save_rounds", lambda args, r, summary: saved.update(summary))
    monkeypatch.setattr(sys, "argv", ["attention_trees_ab.py", "--before", "x"])
    script.main()
    assert saved[f"{case}|ours"] == {"before_ms": 2.2, "after_ms": 1.8}
    assert saved[f"{case}|ours per tile"] == {"after_ms": 3.0}
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{case} ours "))
    assert row.split()[-3:] == [f"{1.8:.3f}", f"{1.8 / 2.2:.3f}", f"{1.6 / 1.8:.3f}"]


def test_launch_groups_settings_are_restored(benchmark_script):
    """A contender's head groups or one-program-per-tile forward hold while it is timed and not after."""
    from fox_kernel.ops.gluon import tiles

    script = benchmark_script("launch_groups_ab")
    with script._groups("dq", 4):
        assert tiles.HEAD_GROUPS == {"dq": 4} and tiles.PERSISTENT["fwd"]
    with script._groups("per-tile fwd", None):
        assert tiles.HEAD_GROUPS == {} and not tiles.PERSISTENT["fwd"]
    assert tiles.HEAD_GROUPS == {} and tiles.PERSISTENT["fwd"]


@pytest.mark.parametrize("script", ["launch_groups_ab", "plans_ab"])
@pytest.mark.parametrize("argv,message", [(["--rounds", "0"], "--rounds must be at least 1, got 0"),
                                          ([], "{script}.py needs a CUDA GPU")])
def test_ab_scripts_bad_arguments_stop_in_one_line(monkeypatch, script, argv, message, benchmark_script):
    if not argv and torch.cuda.is_available():
        pytest.skip("the GPU check needs a machine without one")
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as stop:
        benchmark_script(script).main()
    assert str(stop.value) == message.format(script=script)


def test_eager_pruned_forward_without_a_gpu_stops_in_one_line(monkeypatch, benchmark_script):
    if torch.cuda.is_available():
        pytest.skip("the GPU check needs a machine without one")
    monkeypatch.setattr(sys, "argv", ["eager_pruned_forward.py"])
    with pytest.raises(SystemExit) as stop:
        benchmark_script("eager_pruned_forward").main()
    assert str(stop.value) == "eager_pruned_forward.py needs a CUDA GPU"
