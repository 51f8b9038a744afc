"""Plot data-parallel runs side by side: the training loss and tokens/s of every step, one line per run.

    python packages/fox-train/benchmarks/plot_multi_gpu.py RESULT.json --out dp.png [--title T] [--runs A B ...]

Takes a JSON whose ``runs`` (or top level) maps run names to ``{"loss": {step: value}, "tokens_per_s":
{step: value}}``, as the multi-GPU result files in this folder hold them. The loss panel shows whether the
multi-GPU runs follow the one-GPU curve; the speed panel shows each step, the first (compilation) and last
(evaluation) included.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def runs_of(data: dict, names: list[str] | None = None) -> dict[str, dict]:
    """Run name -> {"loss": {step: v}, "tokens_per_s": {step: v}}, steps as ints, in ``names`` order."""
    runs = data.get("runs", data)
    picked = {k: v for k, v in runs.items() if isinstance(v, dict) and "loss" in v}
    if names:
        missing = [n for n in names if n not in picked]
        if missing:
            raise SystemExit(f"plot_multi_gpu.py: --runs names {missing} not in the file (it has {sorted(picked)})")
        picked = {n: picked[n] for n in names}
    if not picked:
        raise SystemExit("plot_multi_gpu.py: no runs with a per-step loss in the given file")
    return {name: {key: {int(s): float(v) for s, v in run[key].items()} for key in ("loss", "tokens_per_s")}
            for name, run in picked.items()}


def plot(runs: dict[str, dict], out: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, run) in enumerate(runs.items()):
        style = dict(color=f"C{i}", marker="o", markersize=3, label=name)
        steps = sorted(run["loss"])
        loss_ax.plot(steps, [run["loss"][s] for s in steps], linestyle="-" if i == 0 else "--", **style)
        steps = sorted(run["tokens_per_s"])
        speed_ax.plot(steps, [run["tokens_per_s"][s] / 1e3 for s in steps], **style)
    loss_ax.set(xlabel="step", ylabel="training loss (nats)", title="loss")
    speed_ax.set(xlabel="step", ylabel="thousand tokens/s", title="speed of each step")
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title")
    p.add_argument("--runs", nargs="+", help="runs to draw, in this order (default: all)")
    args = p.parse_args(argv)
    plot(runs_of(json.loads(args.result.read_text()), args.runs), args.out, args.title)
    print(args.out)


if __name__ == "__main__":
    main()
