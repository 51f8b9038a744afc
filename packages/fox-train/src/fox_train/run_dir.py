"""A run's directory and its life: where it is (``resolve_run_dir``), whether this call may write into it
(``claim_run_dir``), its ``config.yaml``, and the signals that stop it after saving a checkpoint
(``StopSignals``, ``Interrupted``)."""

from __future__ import annotations

import os
import signal
import threading
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import OmegaConf

from fox_train import checkpoint as ckpt
from fox_train.config import TrainConfig, load_config, resume_conflicts


def resolve_run_dir(cfg: TrainConfig) -> Path:
    """``out_dir/run_name``; without a run name ``out_dir/<preset>-<source>-<time>``, or with ``resume`` the
    newest such directory."""
    root = Path(cfg.out_dir)
    if cfg.run_name:
        return root / cfg.run_name
    prefix = f"{cfg.model.preset}-{cfg.data.source}"
    if cfg.resume:
        runs = sorted(root.glob(f"{prefix}-*"), key=lambda p: p.stat().st_mtime)
        if runs:
            return runs[-1]
    return root / f"{prefix}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def claim_run_dir(cfg: TrainConfig, run_dir: Path) -> None:
    """A run directory holds one configuration's checkpoints. Without ``resume``, one that holds checkpoints
    is refused; with it, the saved ``config.yaml`` must agree with ``cfg`` outside ``RESUMABLE`` (the
    command line merges into the saved config: fox_train.cli)."""
    newest = ckpt.complete_checkpoints(run_dir / "checkpoints")
    if newest and not cfg.resume:
        raise ValueError(f"{run_dir} already holds checkpoints (newest {newest[0].name}): resume=true continues "
                         f"that run, another run_name starts a new one")
    saved = run_dir / "config.yaml"
    if cfg.resume and saved.exists():
        message = resume_conflicts(load_config(saved), OmegaConf.to_container(OmegaConf.structured(cfg)), saved)
        if message:
            raise ValueError(message)


def save_config(cfg: TrainConfig, run_dir: Path) -> None:
    """config.yaml, replaced in one step (a failed write leaves the previous one)."""
    tmp = run_dir / ".config.yaml.tmp"
    try:
        OmegaConf.save(OmegaConf.structured(cfg), tmp)
        os.replace(tmp, run_dir / "config.yaml")
    finally:
        tmp.unlink(missing_ok=True)


class Interrupted(Exception):
    """Training stopped by SIGINT or SIGTERM after saving a checkpoint; the message is one line."""

    def __init__(self, message: str, signum: int, is_global_zero: bool):
        super().__init__(message)
        self.signum, self.is_global_zero = signum, is_global_zero


class StopSignals:
    """While active, SIGINT (Ctrl-C) and SIGTERM (sent by clusters some time before they kill a job) are
    recorded instead of ending the process, so that the loop saves a checkpoint after the current step and
    stops. A second SIGINT interrupts at once (KeyboardInterrupt), a second SIGTERM ends the process."""

    def __init__(self):
        self.received = 0
        self._previous = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.received = signum
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def requested(self, fabric) -> int:
        """The signal received (0: none), agreed by all ranks: each stops after the same step. Across ranks
        this is a collective and a host sync each step, a small cost next to a multi-device step."""
        if fabric.world_size == 1:
            return self.received
        flag = torch.tensor(float(self.received), device=fabric.device)
        return int(fabric.all_reduce(flag, reduce_op="max").item())
