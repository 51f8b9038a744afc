"""The multi-node path of fox-train, as a cluster runs it: two torchrun "nodes" of one process each (gloo on
this machine's CPU) meet through a c10d rendezvous, train data-parallel with the loss curve of one process
at the same global batch, checkpoint, and resume on two nodes again."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from fox_train.cli import main

ARGS = ["model=fox-pro-tiny", "strategy.accelerator=cpu", "model.hidden_size=64", "model.num_hidden_layers=2",
        "model.num_heads=2", "data.seq_len=64", "micro_batch_size=2", "global_batch_tokens=256",
        "schedule.warmup_tokens=512", "eval_sequences=4", "checkpoint_every=2", "eval_every=1000", "log_every=1",
        "export=false", "keep_last=5"]


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def _two_nodes(args, timeout=600):
    """fox-train on two torchrun nodes (node ranks 0 and 1) of one process each, rendezvous on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={n}", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                               "--rdzv_id=fox-test", "-m", "fox_train.cli", *args, "strategy=ddp",
                               "strategy.devices=1", "strategy.num_nodes=2"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(2)]
    logs = [p.communicate(timeout=timeout)[0] for p in nodes]
    for n, (p, log) in enumerate(zip(nodes, logs)):
        assert p.returncode == 0, f"node {n}:\n{log[-3000:]}"
    return logs


def test_two_torchrun_nodes_train_checkpoint_and_resume(tmp_path):
    args = [f"out_dir={tmp_path}", *ARGS]
    # one process, extended after step 3 as the nodes' run is (a longer schedule from the tokens seen)
    main([*args, "run_name=one", "schedule.total_tokens=768"])
    main([*args, "run_name=one", "resume=true", "schedule.total_tokens=1280"])
    logs = _two_nodes([*args, "run_name=nodes", "schedule.total_tokens=768"])
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in logs[1]
    one, nodes = _losses(tmp_path / "one"), _losses(tmp_path / "nodes")
    assert sorted(nodes) == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "nodes" / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    logs = _two_nodes([*args, "run_name=nodes", "resume=true", "schedule.total_tokens=1280"])
    assert "resumed from step 3" in logs[0]
    nodes = _losses(tmp_path / "nodes")
    assert sorted(nodes) == [1, 2, 3, 4, 5]
    for step in one:
        assert abs(nodes[step] - one[step]) < 1e-4, (step, one[step], nodes[step])
