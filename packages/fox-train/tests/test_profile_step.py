"""benchmarks/profile_step.py: the step summary's arithmetic on a hand-made trace, and one recorded step of a
two-process FSDP2 run (gloo) with the parameter-prefetch variant, whose losses must equal one process's."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fox_train.cli import main

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_step.py"


def _kernel(name, ts, dur):
    return {"cat": "kernel", "ph": "X", "name": name, "ts": ts, "dur": dur}


def test_summary_splits_compute_nccl_and_gaps(benchmark_module):
    """Compute kernels on [0, 300) (two overlapping) and [1500, 1600); NCCL on [200, 1000) and [1550, 1700);
    a CPU op spans the gap. Busy = [0, 1000) + [1500, 1700) = 1200 us; compute = 300 + 100 = 400 us;
    NCCL alone = 1200 - 400; one compute gap over 0.5 ms: [300, 1500)."""
    events = [_kernel("gemm_a", 0, 200), _kernel("gemm_b", 100, 200), _kernel("ncclDevKernel_AllReduce", 200, 800),
              _kernel("gemm_a", 1500, 100), _kernel("ncclDevKernel_AllReduce", 1550, 150),
              {"cat": "cpu_op", "ph": "X", "name": "aten::_local_scalar_dense", "ts": 250, "dur": 1200}]
    s = benchmark_module("profile_step").summarize(events, wall_us=2000.0)
    assert s["wall_ms"] == pytest.approx(2.0)
    assert s["gpu_busy_ms"] == pytest.approx(1.2)
    assert s["compute_busy_ms"] == pytest.approx(0.4)
    assert s["nccl_ms"] == pytest.approx(0.95)
    assert s["nccl_exposed_ms"] == pytest.approx(0.8)
    assert s["compute_gaps_over_0.5ms"] == 1 and s["compute_gap_ms_total"] == pytest.approx(1.2)
    assert s["largest_gaps"][0]["cpu"] == ["aten::_local_scalar_dense"]
    assert s["top_kernels_ms"]["ncclDevKernel_AllReduce"] == pytest.approx(0.95)
    assert s["top_kernels_ms"]["gemm_a"] == pytest.approx(0.3)


@pytest.mark.parametrize("env, message", [
    ({"FOX_PROFILE_STEP": "2", "FOX_PROFILE_VARIANT": "prefech"}, "FOX_PROFILE_VARIANT must be syncall or prefetch, got 'prefech'"),
    ({"FOX_PROFILE_STEP": "two"}, "FOX_PROFILE_STEP must be a step index of at least 1 (the step before it warms up), got 'two'"),
    ({"FOX_PROFILE_STEP": "0"}, "FOX_PROFILE_STEP must be a step index of at least 1"),
    ({}, "FOX_PROFILE_STEP must be a step index of at least 1"),
], ids=["misspelt-variant", "word-step", "step-0", "no-step"])
def test_bad_settings_stop_in_one_line_before_any_training(benchmark_module, monkeypatch, env, message):
    """A SystemExit with a message: Python prints it as one line and exits 1, before the trainer starts."""
    for key in ("FOX_PROFILE_STEP", "FOX_PROFILE_VARIANT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    module = benchmark_module("profile_step")
    monkeypatch.setattr(module, "_install_profiler", lambda *a: pytest.fail("the profiler was installed"))
    with pytest.raises(SystemExit) as stop:
        module.main()
    text = str(stop.value.code)
    assert text.startswith("profile_step.py: ") and message in text and "\n" not in text


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_fsdp2_step_recorded_on_both_ranks_and_prefetch_keeps_the_losses(tmp_path):
    """The prefetch variant's losses equal one process's at the same global batch (float32: to rounding)."""
    args = [f"out_dir={tmp_path}", "model=fox-pro-tiny", "model.hidden_size=64", "model.num_hidden_layers=2",
            "model.num_heads=2", "strategy.accelerator=cpu", "data.seq_len=64", "global_batch_tokens=512",
            "micro_batch_size=2", "schedule.total_tokens=2560", "eval_sequences=2", "log_every=1",
            "eval_every=1000", "checkpoint_every=1000", "export=false"]
    fsdp2 = ["strategy=fsdp2", "strategy.devices=2", "strategy.fsdp_sharding=SHARD_GRAD_OP"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", FOX_PROFILE_STEP="2", FOX_PROFILE_OUT=str(tmp_path / "prof"),
               FOX_PROFILE_NAME="t", FOX_PROFILE_VARIANT="prefetch")
    run = subprocess.run([sys.executable, str(SCRIPT), *args, *fsdp2, "run_name=probe"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    main([*args, "run_name=plain"])
    for rank in (0, 1):
        summary = json.loads((tmp_path / "prof" / f"t-rank{rank}.json").read_text())
        assert summary["wall_ms"] > 0 and "aten::" in summary["cpu_top"]
    trace = json.loads(gzip.decompress((tmp_path / "prof" / "t-rank0-trace.json.gz").read_bytes()))
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])
    probe, base = _losses(tmp_path / "probe"), _losses(tmp_path / "plain")
    assert sorted(probe) == sorted(base) == [1, 2, 3, 4, 5]
    for step in base:
        assert probe[step] == pytest.approx(base[step], abs=1e-4), step
