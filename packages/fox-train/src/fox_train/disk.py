"""Writing files so that a full or read-only disk ends in one line naming the file, and leaves no part."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from fox_train.errors import first_line


def free_space(path: Path) -> str:
    """`` (N MiB free on its disk)`` for the nearest existing folder of ``path``; empty when unknown. Some
    writers (numpy, torch.save) report a full disk only as a short write, without an errno."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f" ({shutil.disk_usage(folder).free / 2**20:.1f} MiB free on its disk)"
    except OSError:
        return ""


def save_npy(path: Path, array: np.ndarray) -> None:
    """``np.save`` to a temporary file beside ``path``, renamed into place; on failure the temporary file is
    removed and OSError names ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.npy")  # ranks may write the same file at once
    try:
        np.save(tmp, array)
        tmp.replace(path)
    except OSError as e:
        note = free_space(path)
        tmp.unlink(missing_ok=True)
        first = first_line(e)
        raise OSError(f"cannot write {path}: {first}{note}") from None
