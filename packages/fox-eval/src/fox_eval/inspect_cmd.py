"""``fox-eval inspect``: forget gates, decay times, F and attention maps, and what pruning would skip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from fox_models import inspect as fi


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _downsample(m: torch.Tensor, size: int = 512) -> tuple[np.ndarray, int]:
    """Average a (T, T) matrix over f x f tiles, f = ceil(T / size), for display: (the ceil(T / f) square
    image, f). Pixel (r, c) covers rows [r f, (r + 1) f) and columns [c f, (c + 1) f); the last row and column
    of tiles reach past T when f does not divide T, and their means count only the entries inside the matrix."""
    T = m.shape[0]
    f = -(-T // size)
    if f == 1:
        return m.float().numpy(), 1
    n = -(-T // f)
    pad = n * f - T
    x = torch.nn.functional.pad(m.double(), (0, pad, 0, pad))[None, None]
    sums = torch.nn.functional.avg_pool2d(x, f)[0, 0] * (f * f)
    inside = torch.full((n,), float(f), dtype=torch.float64)
    inside[-1] = T - (n - 1) * f  # entries of the last tile row / column inside the matrix
    return (sums / (inside[:, None] * inside[None, :])).float().numpy(), f


def decay_heatmap(stats, path: Path, title: str):
    """The layers x heads heat map of decay times (log colour scale); returns the (closed) figure."""
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    times = np.array([[h["decay_time"] for h in layer] for layer in stats], dtype=float)
    finite = np.where(np.isfinite(times), times, np.nan)
    # at least 3.2 inches tall: the colorbar's label runs along its height
    fig, ax = plt.subplots(figsize=(max(4.5, 0.35 * times.shape[1] + 2.5), max(3.2, 0.3 * times.shape[0] + 1.5)),
                           layout="constrained")
    lo, hi = np.nanmin(finite), np.nanmax(finite)
    im = ax.imshow(finite, aspect="auto", cmap="viridis", norm=LogNorm(vmin=max(lo, 1e-2), vmax=max(hi, lo * 1.01)))
    fig.colorbar(im, ax=ax, label="decay time (tokens)")
    # heads and layers are whole numbers: ticks at whole numbers only, at most about 12 per axis
    ax.set_xticks(range(0, times.shape[1], -(-times.shape[1] // 12)))
    ax.set_yticks(range(0, times.shape[0], -(-times.shape[0] // 12)))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize="medium")
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return fig


def matrix_figure(F: torch.Tensor, A: torch.Tensor, path: Path, title: str):
    """F and attention side by side, axes in tokens 0..T whatever the downsampling; returns the (closed) figure."""
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), layout="constrained")
    T = F.shape[0]
    for ax, m, name in ((axes[0], F, "forget gate matrix F_ij = exp(c_i - c_j)"), (axes[1], A, "attention")):
        img, f = _downsample(m)
        edge = img.shape[0] * f  # the image's tiles span tokens [0, edge), edge >= T
        im = ax.imshow(np.clip(img, 1e-8, None), cmap="magma", norm=LogNorm(vmin=1e-6, vmax=1.0),
                       extent=(0, edge, edge, 0), interpolation="nearest")
        ax.set_xlim(0, T)
        ax.set_ylim(T, 0)
        ax.set_title(name)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return fig


def run(model, input_ids: torch.Tensor, out: Path, layers: list[int] | None, heads: list[int] | None,
        block: int = 128) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    caps = fi.capture(model, input_ids)
    stats = fi.gate_statistics(model, input_ids, block)
    T = input_ids.shape[1]
    per_layer = [float(np.mean([h["pruned_fraction"] for h in layer])) for layer in stats]
    report = {"tokens": T, "block": block, "log_eps": fi.LOG_EPS, "layers": stats,
              "pruned_fraction_per_layer": per_layer, "pruned_fraction_model": float(np.mean(per_layer))}
    (out / "inspect.json").write_text(json.dumps(report, indent=1))
    decay_heatmap(stats, out / "decay_times.png", f"decay time -1/mean(log f) per head\n({T} tokens)")
    for li in layers if layers is not None else [0, len(caps) - 1]:
        if not 0 <= li < len(caps):
            raise ValueError(f"--layers: layer {li} does not exist (the model has {len(caps)})")
        for h in heads if heads is not None else range(caps[li].log_fgate.shape[1]):
            if not 0 <= h < caps[li].log_fgate.shape[1]:
                raise ValueError(f"--heads: head {h} does not exist (layer {li} has {caps[li].log_fgate.shape[1]})")
            t = stats[li][h]["decay_time"]
            matrix_figure(fi.forget_matrix(caps[li], h), fi.attention_matrix(caps[li], h),
                          out / f"layer{li}_head{h}.png", f"layer {li}, head {h}: decay time {t:.3g} tokens")
    return report
