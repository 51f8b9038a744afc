"""Atomic checkpoints: written to a temporary directory beside the final one, marked complete, then renamed
into place; read back with ``weights_only`` (tensors and plain values: nothing in a file can run code)."""

from __future__ import annotations

import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from fox_train.disk import free_space
from fox_train.errors import first_line

MARKER = "COMPLETE"
TMP_PREFIX = ".tmp-"


class DirectTorchIO(TorchCheckpointIO):
    """Fabric's checkpoint writer for single and DDP runs, saving with ``torch.save`` straight into the
    checkpoint's temporary directory. Fabric's own writes through an fsspec transaction whose temporary
    file lives in the system temp directory, where a killed run leaves a checkpoint-sized file behind."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        torch.save(checkpoint, path)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def read_state(path: Path) -> dict:
    """A checkpoint file as a dict (memory-mapped tensors on the CPU), loaded with ``weights_only``.
    ValueError in one line for a file that holds anything else (a crafted pickle), or is truncated or not
    a PyTorch checkpoint."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        what = f" ({found.group(1)})" if found else ""
        raise ValueError(f"{path} refused: it holds objects other than tensors and plain values{what}, and "
                         f"loading them could run code") from None
    except Exception as e:  # truncated zip, not a zip, bad records
        first = first_line(e)
        raise ValueError(f"{path} cannot be read (truncated or not a PyTorch checkpoint): {first}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{path} is not a fox-train checkpoint (no 'model' entry)")
    return state


def save(fabric, root: Path, step: int, state: dict, keep_last: int, keep_every: int) -> Path:
    """Write ``state`` as ``root/step-XXXXXXXX`` (every rank calls it); the temporary directory is removed
    if the save fails. Then keep the newest ``keep_last`` and every ``keep_every``-th of the checkpoints up
    to this one (newer ones, which did not load when the run resumed, stay)."""
    final = step_dir(root, step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    try:
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
    except (OSError, RuntimeError) as e:  # a full or read-only disk (torch.save reports RuntimeError)
        note = free_space(root)  # before the partial files go
        if fabric.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        first = first_line(e)
        raise OSError(f"cannot save checkpoint {final}: {first}{note}") from None
    except BaseException:  # an interrupt during the save
        if fabric.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if fabric.is_global_zero:
        _prune(root, keep_last, keep_every, step)
    fabric.barrier()
    return final


def remove_partial(root: Path) -> None:
    """Delete the temporary directories of saves that a killed run left behind."""
    if root.exists():
        for path in root.glob(f"{TMP_PREFIX}step-*"):
            shutil.rmtree(path, ignore_errors=True)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, newest first."""
    if not root.exists():
        return []
    found = [p for p in root.glob("step-*") if (p / MARKER).exists()]
    return sorted(found, key=step_of, reverse=True)


def load_newest(fabric, root: Path, state: dict) -> int | None:
    """Load the newest checkpoint that loads; skip (with a warning) partial, corrupt or unsafe ones. Returns
    its step; None when there is none; ValueError naming each failure when there are some and none loads.
    Each file is read with ``weights_only`` before Fabric loads it: Fabric's FSDP loader unpickles a full
    checkpoint without that restriction."""
    failures = []
    for path in complete_checkpoints(root):
        try:
            read_state(path / "state.pt")
            remainder = fabric.load(path / "state.pt", state, weights_only=True)
        except Exception as e:
            first = first_line(e)
            warnings.warn(f"skipping checkpoint {path}: {first}", stacklevel=2)
            failures.append(f"{path.name}: {first}")
            continue
        return int(remainder.get("step", state.get("step", 0)))
    if failures:
        raise ValueError(f"resume=true: no checkpoint under {root} loads ({'; '.join(failures)})")
    return None


def _prune(root: Path, keep_last: int, keep_every: int, newest: int) -> None:
    older = [p for p in complete_checkpoints(root) if step_of(p) <= newest]
    for i, path in enumerate(older):
        if i < keep_last or (keep_every and step_of(path) % keep_every == 0):
            continue
        shutil.rmtree(path, ignore_errors=True)
