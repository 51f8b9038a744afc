"""A real long-document corpus from a package registry: the Linux kernel's C sources (Debian's
``linux-source-6.12`` package, GPL-2.0 with per-file SPDX licences).

One C file is one document. Train and held-out are split by file, never inside one: a file is held out
when the SHA-1 of its path falls in the first ``heldout_percent`` of the hash range, so the split does
not depend on which files a slice holds.

    python -m fox_train.linux_corpus download DIR                # apt-get download (Debian's apt)
    python -m fox_train.linux_corpus slice DEB SLICE.jsonl.xz    # a compressed slice (default 45 MB of text budget)
    python -m fox_train.linux_corpus tokenize SLICE OUT_DIR      # -> train.npy, heldout.npy, heldout_index.json

``tokenize`` writes what fox-train reads (``data=tokens data.path=OUT_DIR/train.npy
data.heldout_path=OUT_DIR/heldout.npy``): GPT-2 tokens (JSON-escaped, as LongCrawl64), each file followed
by <|endoftext|>, and the file boundaries of the held-out stream for per-token loss over whole files.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

PACKAGE = "linux-source-6.12"
SUFFIXES = (".c", ".h")
EOT = 50256


def download(directory: Path) -> Path:
    """Fetch the package's .deb into ``directory`` with ``apt-get download`` (runs ``apt-get update`` once
    if apt knows no such package yet); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    found = sorted(directory.glob(f"{PACKAGE}_*.deb"))
    if found:
        return found[-1]
    cmd = ["apt-get", "download", PACKAGE]
    if subprocess.run(cmd, cwd=directory).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(cmd, cwd=directory, check=True)
    found = sorted(directory.glob(f"{PACKAGE}_*.deb"))
    if not found:
        raise FileNotFoundError(f"apt-get download {PACKAGE} left no .deb in {directory}")
    return found[-1]


def _deb_data(deb: Path) -> tarfile.TarFile:
    """The data archive of a .deb (an ar archive: a magic line, then 60-byte member headers)."""
    f = open(deb, "rb")  # noqa: SIM115 (the tarfile reads it lazily)
    if f.read(8) != b"!<arch>\n":
        raise ValueError(f"{deb} is not a Debian package (no ar header)")
    while header := f.read(60):
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        if name.startswith("data.tar"):
            return tarfile.open(fileobj=f, mode="r|*")
        f.seek(size + size % 2, io.SEEK_CUR)
    raise ValueError(f"{deb} has no data.tar member")


def iter_sources(deb: Path) -> Iterator[tuple[str, str]]:
    """(path inside the kernel tree, text) of every C source and header, in the tarball's order."""
    with _deb_data(deb) as outer:
        for member in outer:
            if member.name.endswith(".tar.xz") and "/usr/src/" in f"/{member.name.lstrip('./')}":
                with tarfile.open(fileobj=outer.extractfile(member), mode="r|xz") as inner:
                    for m in inner:
                        if m.isfile() and m.name.endswith(SUFFIXES):
                            path = m.name.split("/", 1)[1] if "/" in m.name else m.name
                            yield path, inner.extractfile(m).read().decode("utf-8", errors="replace")
                return
    raise ValueError(f"{deb} holds no kernel source tarball under /usr/src")


def is_heldout(path: str, heldout_percent: float) -> bool:
    return int(hashlib.sha1(path.encode()).hexdigest()[:8], 16) < heldout_percent / 100 * 16**8


def write_slice(deb: Path, out: Path, train_mb: float, heldout_percent: float = 2.0,
                max_file_kb: float = 512) -> dict:
    """Every held-out file and the train files in hash order up to ``train_mb`` MB of text (0: all) into
    ``out`` (JSON lines, xz). Files over ``max_file_kb`` KB are left out: they are machine-generated
    register tables (the largest, 24 MB of ``#define``s, would dominate the held-out set)."""
    if not deb.exists():
        raise FileNotFoundError(f"{str(deb)!r} does not exist (fetch it with `download DIR`)")
    files = {"train": [], "heldout": []}
    for path, text in iter_sources(deb):
        if len(text.encode()) <= max_file_kb * 1024:
            files["heldout" if is_heldout(path, heldout_percent) else "train"].append((path, text))
    files["train"].sort(key=lambda f: hashlib.sha1(f[0].encode()).hexdigest())
    budget, size, train = train_mb * 1e6, 0, []
    for path, text in files["train"]:
        if budget and size >= budget:
            break
        train.append((path, text))
        size += len(text.encode())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with lzma.open(tmp, "wt", encoding="utf-8", preset=6) as f:
        for split, chosen in (("heldout", files["heldout"]), ("train", train)):
            for path, text in chosen:
                f.write(json.dumps({"path": path, "split": split, "text": text}) + "\n")
    tmp.replace(out)
    return {"package": deb.name, "train_files": len(train), "heldout_files": len(files["heldout"]),
            "train_mb": size / 1e6, "heldout_mb": sum(len(t.encode()) for _, t in files["heldout"]) / 1e6,
            "compressed_mb": out.stat().st_size / 1e6, "heldout_percent": heldout_percent, "max_file_kb": max_file_kb}


def read_slice(path: Path) -> dict[str, list[tuple[str, str]]]:
    if not path.exists():
        raise FileNotFoundError(f"slice {str(path)!r} does not exist (make it with `slice`)")
    files: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": []}
    with lzma.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            files[row["split"]].append((row["path"], row["text"]))
    return files


def tokenize_files(texts: list[str], tokenizer, chunk: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """(stream, offsets): the files' tokens each followed by EOT as one uint16 stream, and where file i
    starts (offsets[i]) and ends (offsets[i + 1] - 1 is its EOT). Batches of ``chunk`` files run on all
    cores (the tokenizers library)."""
    from tqdm.auto import tqdm

    parts, lengths = [], []
    for s in tqdm(range(0, len(texts), chunk), desc="tokenize", unit="chunk", disable=len(texts) <= chunk):
        for ids in tokenizer(texts[s : s + chunk], add_special_tokens=False)["input_ids"]:
            parts.append(np.asarray([*ids, EOT], dtype=np.uint16))
            lengths.append(len(ids) + 1)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return (np.concatenate(parts) if parts else np.zeros(0, np.uint16)), offsets


def tokenize_slice(slice_path: Path, out_dir: Path, tokenizer=None) -> dict:
    """``train.npy`` and ``heldout.npy`` (token streams fox-train reads) and ``heldout_index.json``
    (the held-out files' paths and offsets into ``heldout.npy``)."""
    if tokenizer is None:
        from fox_models import JSONGPT2Tokenizer

        tokenizer = JSONGPT2Tokenizer()
    files = read_slice(slice_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"slice": slice_path.name}
    for split in ("train", "heldout"):
        paths, texts = zip(*files[split]) if files[split] else ((), ())
        stream, offsets = tokenize_files(list(texts), tokenizer)
        np.save(out_dir / f"{split}.npy", stream)
        summary[f"{split}_files"], summary[f"{split}_tokens"] = len(paths), int(len(stream))
        if split == "heldout":
            (out_dir / "heldout_index.json").write_text(json.dumps({"paths": list(paths), "offsets": offsets.tolist()}))
    (out_dir / "corpus.json").write_text(json.dumps(summary, indent=1))
    return summary


def heldout_documents(out_dir: Path, length: int, limit: int | None = None) -> np.ndarray:
    """(N, length) int64: the first ``length`` tokens of every held-out file at least that long (its EOT
    not counted), in stored order; one row per file, as LongCrawl64 evaluates one row per document."""
    stream = np.load(out_dir / "heldout.npy", mmap_mode="r")
    offsets = json.loads((out_dir / "heldout_index.json").read_text())["offsets"]
    rows = [np.asarray(stream[a : a + length], dtype=np.int64) for a, b in zip(offsets[:-1], offsets[1:])
            if b - a - 1 >= length]
    rows = rows[:limit] if limit is not None else rows
    if not rows:
        raise ValueError(f"no held-out file has {length} tokens (the longest has {max(np.diff(offsets), default=1) - 1})")
    return np.stack(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fox_train.linux_corpus", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download", help=f"apt-get download {PACKAGE} into DIR")
    d.add_argument("dir")
    s = sub.add_parser("slice", help="a compressed slice (JSON lines, xz) of the package's C files")
    s.add_argument("deb")
    s.add_argument("out")
    s.add_argument("--train-mb", type=float, default=160.0, help="MB of train text (0: every train file)")
    s.add_argument("--heldout-percent", type=float, default=2.0)
    s.add_argument("--max-file-kb", type=float, default=512.0)
    t = sub.add_parser("tokenize", help="slice -> train.npy, heldout.npy, heldout_index.json")
    t.add_argument("slice")
    t.add_argument("out_dir")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "download":
            print(download(Path(args.dir)))
        elif args.cmd == "slice":
            if args.train_mb < 0 or not 0 < args.heldout_percent < 100 or args.max_file_kb <= 0:
                raise ValueError("--train-mb must be >= 0, --heldout-percent in (0, 100), --max-file-kb > 0")
            print(json.dumps(write_slice(Path(args.deb), Path(args.out), args.train_mb, args.heldout_percent,
                                         args.max_file_kb), indent=1))
        else:
            print(json.dumps(tokenize_slice(Path(args.slice), Path(args.out_dir)), indent=1))
    except (FileNotFoundError, ValueError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"linux_corpus {args.cmd}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
