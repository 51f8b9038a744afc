"""benchmarks/decode_trees_ab.py and pruning_trees_ab.py: the decoding reference is the decoding call's
result, bad arguments stop either script in one line, and --cpu runs the worker processes on that CPU alone."""

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
@pytest.mark.parametrize("script", ["decode_trees_ab", "pruning_trees_ab"])
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
