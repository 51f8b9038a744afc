"""A run's directory and its life: where it is (``resolve_run_dir``), whether this call may write into it
(``claim_run_dir``), its ``config.yaml`` and ``fox-train.log`` (``RunLog``), and the signals that stop it
after saving a checkpoint (``StopSignals``, ``Interrupted``)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import warnings
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

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
    from fox_train import checkpoint as ckpt  # torch: imported once the config is checked

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


LOG_NAME = "fox-train.log"
FABRIC_LOGGER = "lightning.fabric"


class _Records(logging.Handler):
    def __init__(self, log: RunLog):
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log.write(record.getMessage())


class RunLog:
    """The run's log: ``print`` shows a line on the terminal and appends it, with its time, to
    ``<run>/fox-train.log``. Until the run is accepted (``open``, when config.yaml is written) the lines are
    held back and then written first, so that a refused run leaves its folder as it was. While active it
    also records Fabric's log records (logger ``lightning.fabric``) and Python warnings (they reach the
    terminal as before). Only global rank 0 prints and writes; ``rank_zero(False)`` silences a process."""

    def __init__(self):
        self._held: list[str] = []
        self._file = None
        self._active = True
        self._records = _Records(self)

    def __enter__(self) -> RunLog:
        logging.getLogger(FABRIC_LOGGER).addHandler(self._records)
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            self.write(f"{category.__name__}: {message}")
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(FABRIC_LOGGER).removeHandler(self._records)
        self._warnings.__exit__(*exc)
        if self._file is not None:
            self._file.close()
            self._file = None

    def rank_zero(self, is_global_zero: bool) -> None:
        """Known once Fabric has launched the processes: the others print and write nothing."""
        if not is_global_zero:
            self._active, self._held = False, []

    def print(self, line: str) -> None:
        if self._active:
            print(line, flush=True)
            self.write(line)

    def write(self, line: str) -> None:
        """The file only (a line the caller shows in its own way)."""
        if not self._active:
            return
        line = f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S')} {line}\n"
        if self._file is None:
            self._held.append(line)
        else:
            self._file.write(line)
            self._file.flush()

    def open(self, run_dir: Path) -> None:
        """The run is accepted: write the held lines to ``run_dir/fox-train.log`` (appended: a resumed run
        continues its log) and the later ones as they come."""
        if not self._active:
            return
        self._file = open(run_dir / LOG_NAME, "a", encoding="utf-8")  # noqa: SIM115 (closed in __exit__)
        self._file.writelines(self._held)
        self._file.flush()
        self._held = []


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
