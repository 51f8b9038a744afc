"""The run's log (<run>/fox-train.log: what fox-train prints, by rank 0 only) and the micro-batch of runs
over several devices."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from fox_train.cli import main
from fox_train.data import micro_batch_for

SMALL = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_heads=2", "data.seq_len=64", "micro_batch_size=4",
         "global_batch_tokens=256", "schedule.warmup_tokens=512", "eval_sequences=4", "export=false"]


def _log(run_dir) -> list[str]:
    """The log's lines without their time, less Python warnings (which depend on the libraries' versions)."""
    lines = (run_dir / "fox-train.log").read_text(encoding="utf-8").splitlines()
    stamped = [line[20:] for line in lines if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", line)]
    return [line for line in stamped if not re.match(r"\w+Warning: ", line)]


def test_single_process_run_logs_warm_start_resume_and_done(tmp_path, capsys):
    main([f"out_dir={tmp_path}", "run_name=a", "schedule.total_tokens=256", *SMALL])
    assert capsys.readouterr().out.count("done:") == 1
    assert _log(tmp_path / "a") == [f"done: {tmp_path / 'a'}"]

    main([f"out_dir={tmp_path}", "run_name=b", f"init_from={tmp_path / 'a'}", "schedule.total_tokens=256", *SMALL])
    state = tmp_path / "a" / "checkpoints" / "step-00000001" / "state.pt"
    warm = f"warm start from {state} (model weights only, step 0)"
    assert warm in capsys.readouterr().out
    assert _log(tmp_path / "b") == [warm, f"done: {tmp_path / 'b'}"]

    # a resumed run appends to its log; the micro-batch is lowered to divide the step's 4 sequences
    main([f"out_dir={tmp_path}", "run_name=a", "resume=true", "schedule.total_tokens=512", "micro_batch_size=3"])
    assert _log(tmp_path / "a") == [f"done: {tmp_path / 'a'}",
                                    "micro_batch_size 3 -> 2, which divides a step's 4 sequences",
                                    f"resumed from step 1 ({tmp_path / 'a' / 'checkpoints'})",
                                    f"done: {tmp_path / 'a'}"]


def test_micro_batch_is_lowered_to_divide_each_ranks_share_or_the_error_names_what_works():
    assert micro_batch_for(1024, 128, 8, 1) == 8
    assert micro_batch_for(1024, 128, 8, 2) == 4  # the defaults over 2 devices
    assert micro_batch_for(1536, 128, 8, 2) == 6
    assert micro_batch_for(1536, 128, 4, 2) == 3
    assert micro_batch_for(1024, 128, 3, 1) == 2
    with pytest.raises(ValueError, match=r"^global_batch_tokens=1024 is 8 sequences of data.seq_len=128, which 3 "
                                         r"data-parallel ranks .* must be a multiple of data.seq_len x 3 = 384, "
                                         r"e.g. 768 or 1152$"):
        micro_batch_for(1024, 128, 8, 3)
    with pytest.raises(ValueError, match=r"multiple of data.seq_len x 4 = 256, e.g. 256$"):
        micro_batch_for(128, 64, 8, 4)


def test_two_process_ddp_run_with_the_default_batch_logs_once(tmp_path):
    """``strategy=ddp strategy.devices=2`` with the default batch (1024 tokens of 128: 4 sequences a rank,
    micro_batch_size 8) trains with micro-batches of 4, says so once, prints ``done:`` once and writes
    rank 0's lines, Fabric's included, to fox-train.log."""
    run = subprocess.run([sys.executable, "-m", "fox_train.cli", f"out_dir={tmp_path}", "run_name=ddp", "strategy=ddp",
                          "strategy.devices=2", "strategy.accelerator=cpu", "model.hidden_size=64",
                          "model.num_hidden_layers=2", "model.num_heads=2", "schedule.total_tokens=2048",
                          "eval_sequences=4", "log_every=1", "export=false"],
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = tmp_path / "ddp"
    lowered = "micro_batch_size 8 -> 4, which divides the 4 of a step's 8 sequences each of 2 data-parallel ranks takes"
    assert run.stdout.count(lowered) == 1 and run.stdout.count("done:") == 1, run.stdout
    log = _log(run_dir)
    assert log.count(lowered) == 1 and log[-1] == f"done: {run_dir}" and log.count(log[-1]) == 1
    assert "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in log
    assert not any("GLOBAL_RANK: 1" in line for line in log)
    assert sorted(p.name for p in run_dir.glob("*.log")) == ["fox-train.log"]
    losses = [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
