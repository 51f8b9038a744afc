"""Plot context_parallel.py results: peak memory and tokens/s against the sequence length, one line per model
and context-parallel degree, a cross at the first length that ran out of memory.

    python packages/fox-train/benchmarks/plot_context_parallel.py RESULT.json [...] --out cp.png [--title T]

Takes the JSON that context_parallel.py writes (``rows``) and files that hold several such outputs under
their own keys (each with ``rows``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows_of(data) -> list[dict]:
    """Every result row in a context_parallel.py output, or in a dict of such outputs."""
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        return list(data["rows"])
    if isinstance(data, dict):
        return [r for v in data.values() for r in rows_of(v)]
    return []


def plot(rows: list[dict], out: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise SystemExit("plot_context_parallel.py: no result rows in the given files")
    fig, (mem_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    lines = sorted({(r["preset"], r["degree"]) for r in rows})
    for i, (preset, degree) in enumerate(lines):
        color = f"C{i}"
        ok = sorted((r for r in rows if (r["preset"], r["degree"]) == (preset, degree) and "failed" not in r),
                    key=lambda r: r["seq_len"])
        failed = [r for r in rows if (r["preset"], r["degree"]) == (preset, degree) and "failed" in r]
        label = f"{preset}, degree {degree}"
        x = [r["seq_len"] / 1024 for r in ok]
        mem_ax.plot(x, [r["peak_mem_gib"] for r in ok], "o-", color=color, label=label)
        speed_ax.plot(x, [r["tokens_per_s"] / 1000 for r in ok], "o-", color=color, label=label)
        for r in failed:
            top = max((q["peak_mem_gib"] for q in ok), default=0)
            mem_ax.plot([r["seq_len"] / 1024], [top], "x", color=color, markersize=10, mew=2)
    mem_ax.set(xlabel="tokens per sequence (k)", ylabel="peak memory per GPU (GiB)",
               title="memory (x: first length out of memory)")
    speed_ax.set(xlabel="tokens per sequence (k)", ylabel="tokens/s per sequence (thousands)", title="speed")
    for ax in (mem_ax, speed_ax):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    speed_ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("context_parallel.png"))
    p.add_argument("--title")
    args = p.parse_args(argv)
    rows = [r for path in args.results for r in rows_of(json.loads(path.read_text()))]
    plot(rows, args.out, args.title)
    print(f"wrote {args.out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
