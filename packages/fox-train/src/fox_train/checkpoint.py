"""Atomic checkpoints: written to a temporary directory, marked complete, then renamed into place."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

MARKER = "COMPLETE"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def save(fabric, root: Path, step: int, state: dict, keep_last: int, keep_every: int) -> Path:
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    if fabric.is_global_zero:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    fabric.barrier()
    fabric.save(tmp / "state.pt", state)
    fabric.barrier()
    if fabric.is_global_zero:
        (tmp / MARKER).write_text(str(step))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _prune(root, keep_last, keep_every)
    fabric.barrier()
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, newest first."""
    if not root.exists():
        return []
    found = [p for p in root.glob("step-*") if (p / MARKER).exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]), reverse=True)


def load_newest(fabric, root: Path, state: dict) -> int | None:
    """Load the newest checkpoint that loads; skip (with a warning) partial or corrupt ones. Returns its step."""
    for path in complete_checkpoints(root):
        try:
            remainder = fabric.load(path / "state.pt", state)
        except Exception as e:  # a truncated or corrupt file: fall back to the one before
            warnings.warn(f"skipping checkpoint {path}: {type(e).__name__}: {e}", stacklevel=2)
            continue
        return int(remainder.get("step", state.get("step", 0)))
    return None


def _prune(root: Path, keep_last: int, keep_every: int) -> None:
    for i, path in enumerate(complete_checkpoints(root)):
        step = int(path.name.split("-")[1])
        if i < keep_last or (keep_every and step % keep_every == 0):
            continue
        shutil.rmtree(path, ignore_errors=True)
