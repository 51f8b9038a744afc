"""Build the GPT-2 BPE files shipped in fox-models from the public GPT-2 ranks.

The ranks (MIT, identical to tiktoken's r50k_base) are in the openai-whisper source distribution as
``whisper/assets/gpt2.tiktoken``: one ``base64(token bytes) rank`` per line. This writes the
byte-level vocab.json and merges.txt that ``transformers.GPT2Tokenizer`` reads, gzipped:

    python scripts/make_gpt2_assets.py path/to/gpt2.tiktoken packages/fox-models/src/fox_models/assets
"""

from __future__ import annotations

import base64
import gzip
import json
import sys
from pathlib import Path


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def split_by_lower_ranks(ranks: dict[bytes, int], token: bytes) -> list[bytes]:
    """Apply BPE merges of rank below the token's own rank: what is left is the pair that makes it."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best[1]):
                best = (i, r)
        if best is None:
            return parts
        i = best[0]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2 :]


def main(src: str, out_dir: str) -> None:
    ranks = {}
    for line in Path(src).read_text().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    enc = bytes_to_unicode()
    show = lambda b: "".join(enc[x] for x in b)
    vocab = {show(tok): rank for tok, rank in ranks.items()}
    vocab["<|endoftext|>"] = len(ranks)
    merges = []
    for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            pair = split_by_lower_ranks(ranks, tok)
            assert len(pair) == 2, (tok, pair)
            merges.append(f"{show(pair[0])} {show(pair[1])}")
    out = Path(out_dir)
    with gzip.open(out / "gpt2_vocab.json.gz", "wt", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with gzip.open(out / "gpt2_merges.txt.gz", "wt", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    print(f"vocab {len(vocab)} tokens, {len(merges)} merges -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
