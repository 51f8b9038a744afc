"""Run logging (console, JSONL, CSV, optional TensorBoard / W&B), FLOP counts and per-token loss plots."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import torch

# Dense bf16 peaks (FLOP/s) for MFU; unknown devices report no MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "RTX 4090": 165e12}


def flops_per_token(config, seq_len: int, num_params_no_embed: int) -> float:
    """Training FLOPs per token: 6 N (matmuls, forward + backward) + causal attention 6 L T d."""
    return 6 * num_params_no_embed + 6 * config.num_hidden_layers * seq_len * config.hidden_size


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def _jsonl_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _csv_step(line: str) -> int | None:
    try:
        return int(line.split(",", 1)[0])
    except ValueError:
        return None


def _keep_until(path: Path, start: int, step_of, header: bool) -> None:
    """Rewrite ``path`` with the records of steps <= ``start`` (and its header line), in one replace."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = lines[:1] if header else []
    for line in lines[len(kept):]:
        step = step_of(line) if line.endswith("\n") else None  # a line cut by a kill has no end
        if step is not None and step <= start:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


class MetricsWriter:
    """Appends records to the run's metrics.jsonl and metrics.csv (and TensorBoard / W&B). A run that
    starts at ``start_step`` first drops the records of later steps, which it will log again (a resume
    replays the steps after its checkpoint); a run starting at step 0 starts the files afresh."""

    def __init__(self, run_dir: Path, config_dict: dict, tensorboard: bool, wandb: bool, wandb_project: str,
                 start_step: int = 0):
        self.csv_path = run_dir / "metrics.csv"
        if start_step:
            _keep_until(run_dir / "metrics.jsonl", start_step, _jsonl_step, header=False)
            _keep_until(self.csv_path, start_step, _csv_step, header=True)
        else:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            self.csv_path.unlink(missing_ok=True)
        self.jsonl = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (open for the whole run)
        self.tb = self.wb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard drops its events from purge_step on, as the files above drop their records
            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else 0)
        if wandb:
            import wandb as wb

            self.wb = wb.init(project=wandb_project, name=run_dir.name, config=config_dict, dir=str(run_dir))

    def log(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        new = not self.csv_path.exists()
        with open(self.csv_path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["step", "key", "value"])
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    w.writerow([record["step"], k, v])
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, record["step"])
        if self.wb is not None:
            self.wb.log(scalars, step=record["step"])

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def position_windows(loss: torch.Tensor, windows: int = 4) -> dict[str, float]:
    """Mean training loss over position windows [0, T/w), [T/w, 2T/w)...: how the loss uses context."""
    T = loss.shape[-1]
    edges = np.linspace(0, T, windows + 1).astype(int)
    return {f"loss_pos_{a}_{b}": loss[..., a:b].mean().item() for a, b in zip(edges[:-1], edges[1:])}


def plot_per_token_loss(losses: np.ndarray, path: Path, title: str, train_len: int | None = None) -> None:
    """L(i) (moving average) and its cumulative average over positions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = len(losses)
    k = max(1, T // 32)
    smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(len(smooth)) + k // 2 + 1, smooth, label=f"L(i), moving average ({k})")
    ax.plot(np.arange(1, T + 1), np.cumsum(losses) / np.arange(1, T + 1), label="cumulative average", alpha=0.8)
    if train_len:
        ax.axvline(train_len, color="gray", linestyle="--", label="training length")
    ax.set_xscale("log")
    ax.set_xlabel("token position i")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
