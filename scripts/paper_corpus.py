"""Long documents of related text for the paper-scale reproduction: one source directory of the Linux
kernel (Debian's ``linux-source-6.12``, read by ``fox_train.linux_corpus``) is one document, its C files
and headers concatenated in path order, each after a one-line ``/* file: PATH */`` header.

A directory is held out when the SHA-1 of its path falls in the first ``heldout_percent`` of the hash range
(``linux_corpus.is_heldout`` applied to directory paths), so every file of a held-out directory is out of
training and the split does not depend on which directories a slice holds. Held-out documents are kept only
when long enough for the evaluation (``min_heldout_kb`` of text, checked again in tokens by ``tokenize``)
and are cut after the first file that passes ``heldout_kb`` (the evaluation reads their first 4 x 16k
tokens), so the compressed slice stays small:

    python scripts/paper_corpus.py slice --deb linux-source-6.12_*.deb SLICE.jsonl.xz   # ~56 MB
    python scripts/paper_corpus.py slice --tree DIR SLICE.jsonl.xz                       # a folder of .c/.h files
    python scripts/paper_corpus.py tokenize SLICE OUT_DIR --max-train-tokens N

The slice has linux_corpus's format (JSON lines ``{"path", "split", "text"}``, xz), with a directory as
``path``; ``tokenize`` writes what fox-train and ``linux_corpus.heldout_documents`` read (train.npy,
heldout.npy, heldout_index.json, corpus.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from fox_train import linux_corpus


def iter_tree(root: Path) -> Iterator[tuple[str, str]]:
    """(path relative to ``root``, text) of every C source and header under ``root``, in path order: the
    stand-in for ``linux_corpus.iter_sources`` on a folder (tests, a kernel tree checked out elsewhere)."""
    if not root.is_dir():
        raise FileNotFoundError(f"--tree {str(root)!r} is not a folder")
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name.endswith(linux_corpus.SUFFIXES):
            yield p.relative_to(root).as_posix(), p.read_text(encoding="utf-8", errors="replace")


def group_by_directory(sources: Iterable[tuple[str, str]], max_file_kb: float) -> dict[str, list[tuple[str, str]]]:
    """Directory -> its (path, text) files in path order; files over ``max_file_kb`` KB (machine-generated
    register tables) are left out, as linux_corpus does."""
    dirs: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for path, text in sources:
        if len(text.encode()) <= max_file_kb * 1024:
            dirs[os.path.dirname(path) or "."].append((path, text))
    return {d: sorted(files) for d, files in dirs.items()}


def document(files: list[tuple[str, str]], max_chars: int | None = None) -> str:
    """The files of one directory as one document, in the given (path) order; with ``max_chars``, ends
    after the first file that takes it past that many characters (never inside a file)."""
    parts, size = [], 0
    for path, text in files:
        part = f"/* file: {path} */\n{text}" + ("" if text.endswith("\n") else "\n")
        parts.append(part)
        size += len(part)
        if max_chars is not None and size >= max_chars:
            break
    return "".join(parts)


def _hash(path: str) -> str:
    return hashlib.sha1(path.encode()).hexdigest()


def write_slice(sources: Iterable[tuple[str, str]], out: Path, train_mb: float = 250.0, heldout_percent: float = 10.0,
                min_heldout_kb: float = 160.0, heldout_kb: float = 256.0, max_heldout_docs: int = 128,
                max_file_kb: float = 512.0) -> dict:
    """The compressed slice: held-out directories (hash split) with at least ``min_heldout_kb`` KB of text,
    at most ``max_heldout_docs`` of them in hash order, each cut after ``heldout_kb`` KB; then train
    directories in hash order up to ``train_mb`` MB of text (0: all). Returns a summary."""
    dirs = group_by_directory(sources, max_file_kb)
    held, train = [], []
    for d in sorted(dirs, key=_hash):
        (held if linux_corpus.is_heldout(d, heldout_percent) else train).append(d)
    held_docs = []
    for d in held:
        if sum(len(t) for _, t in dirs[d]) >= min_heldout_kb * 1024 and len(held_docs) < max_heldout_docs:
            held_docs.append((d, document(dirs[d], int(heldout_kb * 1024))))
    budget, size, train_docs = train_mb * 1e6, 0, []
    for d in train:
        if budget and size >= budget:
            break
        text = document(dirs[d])
        train_docs.append((d, text))
        size += len(text.encode())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with lzma.open(tmp, "wt", encoding="utf-8", preset=6) as f:
        for split, docs in (("heldout", held_docs), ("train", train_docs)):
            for path, text in docs:
                f.write(json.dumps({"path": path, "split": split, "text": text}) + "\n")
    tmp.replace(out)
    return {"document": "one source directory, its files in path order", "directories": len(dirs),
            "heldout_directories": len(held), "heldout_docs": len(held_docs), "train_docs": len(train_docs),
            "train_mb": size / 1e6, "heldout_mb": sum(len(t.encode()) for _, t in held_docs) / 1e6,
            "compressed_mb": out.stat().st_size / 1e6, "heldout_percent": heldout_percent,
            "min_heldout_kb": min_heldout_kb, "heldout_kb": heldout_kb, "max_file_kb": max_file_kb}


FILE_START = re.compile(r"(?<=\n)(?=/\* file: )")


def tokenize_documents(texts: list[str], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """``linux_corpus.tokenize_files`` of directory documents, tokenized file by file: a document's files
    are split at their ``/* file: PATH */`` headers, which start after a newline, so no BPE word crosses the
    cut (the tokens equal the whole document's, ``test_reproduce_paper.py`` checks), and the tokenizer's
    threads share the files of one batch instead of waiting on its longest directory."""
    pieces, owner = [], []
    for i, text in enumerate(texts):
        split = FILE_START.split(text) if text else [text]
        pieces.extend(split)
        owner.extend([i] * len(split))
    stream, offsets = linux_corpus.tokenize_files(pieces, tokenizer)
    # drop the EOT after every piece but a document's last, and regroup the offsets by document
    ends = np.ones(len(pieces), dtype=bool)
    ends[:-1] = np.asarray(owner[1:]) != np.asarray(owner[:-1])
    keep = np.ones(len(stream), dtype=bool)
    keep[offsets[1:][~ends] - 1] = False
    lengths = np.diff(offsets) - (~ends)
    doc_lengths = np.bincount(np.asarray(owner, dtype=np.int64), weights=lengths, minlength=len(texts)).astype(np.int64)
    doc_offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=doc_offsets[1:])
    return stream[keep], doc_offsets


def tokenize(slice_path: Path, out_dir: Path, max_train_tokens: int | None = None, min_heldout_tokens: int = 65536,
             tokenizer=None, chunk: int = 64) -> dict:
    """train.npy (the train documents in slice order, tokenized only until ``max_train_tokens`` are there:
    tokenizing is the slow part of a job that keeps nothing), heldout.npy and heldout_index.json (every
    held-out document), corpus.json (counts, and how many held-out documents reach ``min_heldout_tokens``)."""
    if tokenizer is None:
        from fox_models import JSONGPT2Tokenizer

        tokenizer = JSONGPT2Tokenizer()
    files = linux_corpus.read_slice(slice_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = [t for _, t in files["train"]]
    parts, done, used = [], 0, 0
    for s in range(0, len(texts), chunk):
        stream, _ = tokenize_documents(texts[s : s + chunk], tokenizer)
        parts.append(stream)
        done, used = done + len(stream), s + len(texts[s : s + chunk])
        if max_train_tokens and done >= max_train_tokens:
            break
    np.save(out_dir / "train.npy", np.concatenate(parts) if parts else np.zeros(0, np.uint16))
    paths = [p for p, _ in files["heldout"]]
    stream, offsets = tokenize_documents([t for _, t in files["heldout"]], tokenizer)
    np.save(out_dir / "heldout.npy", stream)
    (out_dir / "heldout_index.json").write_text(json.dumps({"paths": paths, "offsets": offsets.tolist()}))
    lengths = np.diff(offsets) - 1
    summary = {"slice": slice_path.name, "train_files": used, "train_tokens": int(done),
               "train_docs_in_slice": len(texts), "heldout_files": len(paths), "heldout_tokens": int(len(stream)),
               "heldout_long_docs": int((lengths >= min_heldout_tokens).sum()), "min_heldout_tokens": min_heldout_tokens,
               "heldout_median_tokens": int(np.median(lengths)) if len(lengths) else 0,
               "document": "one source directory, its files in path order"}
    (out_dir / "corpus.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="paper_corpus.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slice", help="a compressed slice of directory documents")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--deb", type=Path, help=f"Debian's {linux_corpus.PACKAGE} .deb")
    src.add_argument("--tree", type=Path, help="a folder of .c/.h files")
    s.add_argument("out", type=Path)
    s.add_argument("--train-mb", type=float, default=250.0)
    s.add_argument("--heldout-percent", type=float, default=10.0)
    s.add_argument("--min-heldout-kb", type=float, default=160.0)
    s.add_argument("--heldout-kb", type=float, default=256.0)
    s.add_argument("--max-heldout-docs", type=int, default=128)
    t = sub.add_parser("tokenize", help="slice -> train.npy, heldout.npy, heldout_index.json, corpus.json")
    t.add_argument("slice", type=Path)
    t.add_argument("out_dir", type=Path)
    t.add_argument("--max-train-tokens", type=int)
    t.add_argument("--min-heldout-tokens", type=int, default=65536)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "slice":
            sources = linux_corpus.iter_sources(args.deb) if args.deb else iter_tree(args.tree)
            if args.deb and not args.deb.exists():
                raise FileNotFoundError(f"--deb {str(args.deb)!r} does not exist")
            summary = write_slice(sources, args.out, args.train_mb, args.heldout_percent, args.min_heldout_kb,
                                  args.heldout_kb, args.max_heldout_docs)
        else:
            summary = tokenize(args.slice, args.out_dir, args.max_train_tokens, args.min_heldout_tokens)
        print(json.dumps(summary, indent=1))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"paper_corpus {args.cmd}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
