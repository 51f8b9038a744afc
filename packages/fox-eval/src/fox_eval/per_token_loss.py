"""Per-token loss L(i): the mean loss at position i over held-out sequences (FOX.md section 5)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

EOT = 50256


def check_model_dir(path: str) -> None:
    if not Path(path).exists():
        raise FileNotFoundError(f"--model {path!r} does not exist")
    if not (Path(path) / "config.json").exists():
        raise FileNotFoundError(f"--model {path!r} is not a Hugging Face model directory (no config.json)")


def load_model(path: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    import fox_models  # noqa: F401  (registers the FoX model types)

    check_model_dir(path)
    return AutoModelForCausalLM.from_pretrained(path).to(device).eval()


@torch.no_grad()
def sequence_losses(model, seqs: np.ndarray, batch_size: int, device: torch.device, bos: int = EOT, desc: str = ""):
    """Yields (start, per-token loss (b, T) float64) batch by batch; inputs are [BOS] + seq[:-1]."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    for s in tqdm(range(0, len(seqs), batch_size), desc=desc, unit="batch"):
        labels = torch.from_numpy(seqs[s : s + batch_size]).to(device)
        inputs = torch.roll(labels, 1, dims=1)
        inputs[:, 0] = bos
        with autocast:
            loss = model(input_ids=inputs, labels=labels).loss
        yield s, loss.double().cpu().numpy()


def run(models: list[str], seqs: np.ndarray, out: Path, batch_size: int, device: torch.device, train_len: int | None):
    """Resumable: per-model sums are stored in ``out/<name>.npz`` after every batch."""
    out.mkdir(parents=True, exist_ok=True)
    curves = {}
    for path in models:
        name = Path(path).resolve().name
        part = out / f"{name}.npz"
        total, done = np.zeros(seqs.shape[1]), 0
        if part.exists():
            z = np.load(part)
            if z["total"].shape == total.shape:
                total, done = z["total"], int(z["done"])
        if done < len(seqs):
            model = load_model(path, device)
            for s, loss in sequence_losses(model, seqs[done:], batch_size, device, desc=name):
                total += loss.sum(0)
                np.savez(part, total=total, done=done + s + len(loss))
            del model
        curves[name] = total / len(seqs)
    np.savez(out / "per_token_loss.npz", **curves)
    summary = {name: {"mean": float(c.mean()), "first": float(c[0]), "last_10pct": float(c[-max(1, len(c) // 10):].mean())}
               for name, c in curves.items()}
    (out / "per_token_loss.json").write_text(json.dumps(
        {"num_sequences": len(seqs), "seq_len": seqs.shape[1], "models": summary,
         "per_token_loss": {k: v.tolist() for k, v in curves.items()}}, indent=1))
    plot(curves, out / "per_token_loss", train_len)
    return curves


def plot(curves: dict[str, np.ndarray], stem: Path, train_len: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in curves.items():
        T = len(c)
        k = max(1, T // 64)
        smooth = np.convolve(c, np.ones(k) / k, mode="valid")
        ax1.plot(np.arange(len(smooth)) + k // 2 + 1, smooth, label=name)
        ax2.plot(np.arange(1, T + 1), np.cumsum(c) / np.arange(1, T + 1), label=name)
    for ax, title in ((ax1, "L(i), moving average"), (ax2, "cumulative average of L(i)")):
        if train_len:
            ax.axvline(train_len, color="gray", linestyle="--", label="training length")
        ax.set_xscale("log")
        ax.set_xlabel("token position i")
        ax.set_ylabel("loss (nats)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(stem.with_suffix(f".{ext}"), dpi=130)
    plt.close(fig)
