"""fox-train with context parallelism over real gloo processes: the loss curve of a tiny FoX (Pro) with each
sequence split across two ranks follows the one-process curve (float32: equal to rounding), its checkpoint
resumes in one process, and the configuration is checked before anything runs."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from fox_train.cli import main

ARGS = ["model=fox-pro-tiny", "strategy.accelerator=cpu", "model.hidden_size=64", "model.num_hidden_layers=2",
        "model.num_heads=2", "data.seq_len=64", "micro_batch_size=2", "global_batch_tokens=256",
        "schedule.warmup_tokens=512", "schedule.total_tokens=1280", "eval_sequences=4", "checkpoint_every=2",
        "eval_every=1000", "log_every=1", "export=false", "keep_last=5"]


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}, [r["heldout_loss"] for r in records if "heldout_loss" in r]


def test_context_parallel_training_follows_one_process_and_resumes_across_degrees(tmp_path):
    args = [f"out_dir={tmp_path}", *ARGS]
    main([*args, "run_name=one"])
    one, one_held = _losses(tmp_path / "one")
    run = subprocess.run([sys.executable, "-m", "fox_train.cli", *args, "run_name=cp2", "strategy=ddp",
                          "strategy.devices=2", "strategy.context_parallel=2"],
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    cp2, cp2_held = _losses(tmp_path / "cp2")
    assert sorted(cp2) == sorted(one) == list(range(1, 6))
    assert one[5]["loss"] < one[1]["loss"] - 0.3  # it learns
    for step in one:
        assert abs(cp2[step]["loss"] - one[step]["loss"]) < 1e-4, (step, one[step]["loss"], cp2[step]["loss"])
        # per-position windows of the loss: the shards were put back in sequence order
        for key in (k for k in one[step] if k.startswith("loss_pos")):
            assert abs(cp2[step][key] - one[step][key]) < 1e-4, (step, key)
    assert len(cp2_held) == len(one_held) and all(abs(a - b) < 1e-4 for a, b in zip(cp2_held, one_held))
    # a context-parallel checkpoint resumes at another degree (one process), continuing the curve
    (tmp_path / "on1" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "cp2" / "checkpoints" / "step-00000002", tmp_path / "on1" / "checkpoints" / "step-00000002")
    main([*args, "run_name=on1", "resume=true"])
    resumed, _ = _losses(tmp_path / "on1")
    assert sorted(resumed) == [3, 4, 5]
    for step in resumed:
        assert abs(resumed[step]["loss"] - one[step]["loss"]) < 1e-4, (step, one[step]["loss"], resumed[step]["loss"])


def test_context_parallel_configuration_is_checked(tmp_path):
    base = [f"out_dir={tmp_path}", *ARGS]
    with pytest.raises(SystemExit, match="data.seq_len must be a multiple of 2 x strategy.context_parallel = 12"):
        main([*base, "strategy.context_parallel=6"])
    with pytest.raises(SystemExit, match="strategy.context_parallel must be an int >= 1"):
        main([*base, "strategy.context_parallel=0"])
    with pytest.raises(SystemExit, match="does not run context-parallel"):
        main([*base, "model=mamba2-tiny", "strategy.context_parallel=2"])
    with pytest.raises(SystemExit, match="must divide the number of processes"):
        main([*base, "strategy.context_parallel=2"])
    assert not list(tmp_path.glob("*/config.yaml")) and not list(tmp_path.glob("*/checkpoints"))  # nothing ran
