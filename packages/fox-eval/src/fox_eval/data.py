"""Held-out sequences for evaluation: token files, text files or folders, LongCrawl64 zarr."""

from __future__ import annotations

from pathlib import Path

import numpy as np

EOT = 50256


KINDS = ("tokens", "text", "zarr")


def check_spec(spec: str) -> tuple[str, Path]:
    """The kind and path of a ``--data`` spec; one-line errors for a malformed spec or a missing path."""
    kind, _, path = spec.partition(":")
    if not path:
        raise ValueError(f"--data must look like tokens:PATH, text:PATH or zarr:PATH, got {spec!r}")
    if not Path(path).exists():
        raise FileNotFoundError(f"--data path {path!r} does not exist")
    if kind not in KINDS:
        raise ValueError(f"--data kind must be tokens, text or zarr, got {kind!r}")
    if kind == "text" and Path(path).is_dir() and not any(Path(path).rglob("*.txt")):
        raise FileNotFoundError(f"--data {spec!r}: the folder holds no .txt files (text:PATH takes a .txt file "
                                f"or a folder of them)")
    return kind, Path(path)


def load_sequences(spec: str, seq_len: int, limit: int | None, tokenizer=None) -> np.ndarray:
    """(N, seq_len) int64 sequences from ``tokens:PATH`` (.npy/.bin), ``text:PATH`` (.txt file or
    folder, JSON-GPT-2 tokenized, documents joined by EOT) or ``zarr:PATH`` (documents x length)."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {seq_len}")
    kind, p = check_spec(spec)
    if kind == "zarr":
        try:
            import zarr
        except ImportError as e:
            raise ImportError("zarr data needs the zarr package: pip install zarr") from e
        arr = zarr.open(str(p), mode="r")
        if arr.shape[1] < seq_len:
            raise ValueError(f"--seq-len {seq_len} is longer than the documents ({arr.shape[1]} tokens)")
        n = arr.shape[0] if limit is None else min(limit, arr.shape[0])
        return np.asarray(arr[:n, :seq_len], dtype=np.int64)
    if kind == "tokens":
        if p.is_dir():
            raise ValueError(f"--data {spec} must be a .npy or .bin file, not a directory")
        try:
            stream = np.load(p, mmap_mode="r") if p.suffix == ".npy" else np.memmap(p, dtype=np.uint16, mode="r")
        except (OSError, ValueError) as e:
            raise ValueError(f"--data {spec!r} is not a readable token file: {e}") from None
        if stream.ndim != 1 or not np.issubdtype(stream.dtype, np.integer):
            raise ValueError(f"--data {spec!r} must hold a 1-D array of integer token ids, got {stream.dtype} "
                             f"of shape {stream.shape}")
    elif kind == "text":
        files = sorted(p.rglob("*.txt")) if p.is_dir() else [p]
        docs = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
        stream = np.fromiter((t for d in ids for t in (*d, EOT)), dtype=np.int64)
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"--data holds {len(stream)} tokens, fewer than one sequence of --seq-len {seq_len}")
    n = n if limit is None else min(limit, n)
    # a copy: a read-only memory map of int64 ids came back as is, and torch warned on every tensor made from it
    return np.array(stream[: n * seq_len], dtype=np.int64).reshape(n, seq_len)
