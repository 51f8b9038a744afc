"""The Linux C corpus: a .deb made here (the real one is 150 MB) -> slice -> token files fox-train reads."""

import io
import json
import random
import tarfile

import numpy as np
import pytest

from fox_models import JSONGPT2Tokenizer
from fox_train import linux_corpus as lc


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _ar(members: dict[str, bytes]) -> bytes:
    out = bytearray(b"!<arch>\n")
    for name, data in members.items():
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode()
        out += data + (b"\n" if len(data) % 2 else b"")
    return bytes(out)


def c_file(rng: random.Random, lines: int) -> str:
    words = ["int", "static", "struct", "return", "if", "for", "u32", "dev", "ret", "err", "->", "&&", "NULL"]
    body = [f"\t{rng.choice(words)} {rng.choice(words)}_{rng.randint(0, 99)} = {rng.randint(0, 9999)}; /* é {i} */"
            for i in range(lines)]
    return "// SPDX-License-Identifier: GPL-2.0\n#include <linux/module.h>\n" + "\n".join(body) + "\n"


def make_deb(path, n_files: int = 60, seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    sources = {f"drivers/x{i % 7}/file{i}.{'c' if i % 3 else 'h'}": c_file(rng, rng.randint(5, 120)) for i in range(n_files)}
    tree = {f"linux-source-6.12/{p}": t.encode() for p, t in sources.items()}
    tree["linux-source-6.12/README"] = b"not a C file"
    data = _tar_xz({"./usr/src/linux-source-6.12.tar.xz": _tar_xz(tree), "./usr/share/doc/x/copyright": b"GPL"})
    path.write_bytes(_ar({"debian-binary": b"2.0\n", "control.tar.xz": _tar_xz({"./control": b"Package: x\n"}),
                          "data.tar.xz": data}))
    return sources


def test_sources_split_and_tokens(tmp_path):
    deb = tmp_path / "linux-source-6.12_1_all.deb"
    sources = make_deb(deb)
    assert dict(lc.iter_sources(deb)) == sources  # every .c/.h file, nothing else, text intact

    summary = lc.write_slice(deb, tmp_path / "slice.jsonl.xz", train_mb=0, heldout_percent=30)
    files = lc.read_slice(tmp_path / "slice.jsonl.xz")
    train, held = dict(files["train"]), dict(files["heldout"])
    assert set(train) | set(held) == set(sources) and not set(train) & set(held)  # split by file
    assert held and train and summary["heldout_files"] == len(held)
    assert all(lc.is_heldout(p, 30) for p in held) and not any(lc.is_heldout(p, 30) for p in train)
    # the split of a file does not depend on which others a slice holds
    small = lc.write_slice(deb, tmp_path / "small.jsonl.xz", train_mb=0.002, heldout_percent=30)
    assert small["train_files"] < len(train) and dict(lc.read_slice(tmp_path / "small.jsonl.xz")["heldout"]) == held

    tok = JSONGPT2Tokenizer()
    out = lc.tokenize_slice(tmp_path / "slice.jsonl.xz", tmp_path / "data", tok)
    stream = np.load(tmp_path / "data" / "train.npy")
    assert stream.dtype == np.uint16 and out["train_tokens"] == len(stream)
    docs = np.split(stream, np.flatnonzero(stream == lc.EOT) + 1)[:-1]
    assert [tok.decode(d[:-1].tolist()) for d in docs] == list(train.values())

    index = json.loads((tmp_path / "data" / "heldout_index.json").read_text())
    held_stream = np.load(tmp_path / "data" / "heldout.npy")
    lengths = np.diff(index["offsets"]) - 1
    T = int(np.median(lengths))
    rows = lc.heldout_documents(tmp_path / "data", T)
    assert rows.shape == ((lengths >= T).sum(), T)
    first = next(i for i, n in enumerate(lengths) if n >= T)
    np.testing.assert_array_equal(rows[0], held_stream[index["offsets"][first] : index["offsets"][first] + T])
    assert tok.decode(rows[0].tolist()) == held[index["paths"][first]][: len(tok.decode(rows[0].tolist()))]
    with pytest.raises(ValueError, match="no held-out file has"):
        lc.heldout_documents(tmp_path / "data", int(lengths.max()) + 1)


def test_bad_inputs_are_named(tmp_path):
    (tmp_path / "x.deb").write_bytes(b"not an archive")
    with pytest.raises(ValueError, match="not a Debian package"):
        list(lc.iter_sources(tmp_path / "x.deb"))
    with pytest.raises(SystemExit, match="slice 'nope.jsonl.xz' does not exist"):
        lc.main(["tokenize", "nope.jsonl.xz", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="nope.deb' does not exist"):
        lc.main(["slice", str(tmp_path / "nope.deb"), str(tmp_path / "s.jsonl.xz")])
    with pytest.raises(SystemExit, match="--heldout-percent"):
        lc.main(["slice", "x.deb", "y", "--heldout-percent", "0"])
