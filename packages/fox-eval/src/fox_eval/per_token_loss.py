"""Per-token loss L(i): the mean loss at position i over held-out sequences (docs/evaluation.md)."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from fox_eval.loading import autocast, check_model_dir, load_model, model_fingerprint, model_labels, precision

EOT = 50256


@torch.no_grad()
def sequence_losses(model, seqs: np.ndarray, batch_size: int, device: torch.device, bos: int = EOT, desc: str = "",
                    context=None):
    """Yields (start, per-token loss (b, T) float64) batch by batch; inputs are [BOS] + seq[:-1]. ``context``:
    a ``fox_kernel.context_parallel.ContextParallel`` that ``model`` runs under (``context_parallel``): each
    rank scores its zigzag shard of every sequence, and every rank gets the whole sequences' losses."""
    from fox_kernel.context_parallel import shard_sequence, unshard_sequence

    quiet = context is not None and context.rank != 0
    for s in tqdm(range(0, len(seqs), batch_size), desc=desc, unit="batch", disable=quiet):
        labels = torch.from_numpy(seqs[s : s + batch_size]).to(device)
        inputs = torch.roll(labels, 1, dims=1)
        inputs[:, 0] = bos
        if context is not None:
            inputs, labels = (shard_sequence(x, context.world_size, context.rank) for x in (inputs, labels))
        with autocast(device):
            loss = model(input_ids=inputs, labels=labels, per_token_loss=True, use_cache=False).loss
        if context is not None:
            loss = unshard_sequence(loss.float().contiguous(), context.group, dim=1)
        yield s, loss.double().cpu().numpy()


def context_parallel(model, seq_len: int):
    """Run ``model``'s attention layers context-parallel over the default process group (every rank holds a
    zigzag shard of each sequence); returns the ``ContextParallel``. Refuses models that cannot (recurrent
    layers) and lengths that do not split, in one line."""
    from fox_kernel.context_parallel import ContextParallel
    from fox_layers import set_attention_kernel
    from fox_models.registry import model_entry

    entry = model_entry(model)
    if not entry.context_parallel:
        raise ValueError(f"--context-parallel: {entry.config_class.model_type} models do not run context-parallel "
                         "(recurrent layers carry a state along the sequence)")
    context = ContextParallel()
    if seq_len % (2 * context.world_size):
        raise ValueError(f"--seq-len must be a multiple of 2 x the number of processes = {2 * context.world_size} "
                         f"with --context-parallel, got {seq_len}")
    set_attention_kernel(model, context)
    return context


def _feed(h, seqs: np.ndarray):
    """Hash the sequences as int64, in order (without a copy when they already are): equal prefixes give
    equal digests however they were fed."""
    h.update(np.ascontiguousarray(seqs, dtype=np.int64).data)
    return h


def _digest(seqs: np.ndarray):
    return _feed(hashlib.blake2b(digest_size=16), seqs)


def _resume(part: Path, key: str, seqs: np.ndarray) -> tuple[np.ndarray, int]:
    """(sum of losses, sequences done) from a partial file written for the same model, precision, sequence
    length and first sequences; else zeros."""
    total = np.zeros(seqs.shape[1])
    try:
        with np.load(part) as z:
            key_, seen, done, digest = str(z["key"]), z["total"], int(z["done"]), str(z["seqs_digest"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # none yet, or not one of ours
        return total, 0
    if key_ != key or seen.shape != total.shape or done > len(seqs) or digest != _digest(seqs[:done]).hexdigest():
        return total, 0
    return seen, done


def _save_partial(part: Path, **arrays) -> None:
    """Write beside the file, then rename: a run killed mid-write leaves the previous partial sums whole."""
    tmp = part.with_name(part.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, part)


def run(models: list[str], seqs: np.ndarray, out: Path, batch_size: int, device: torch.device, train_len: int | None,
        labels: list[str] | None = None, split: bool = False) -> dict[str, np.ndarray]:
    """L(i) of each model folder over ``seqs`` (N, T), keyed by label (see ``loading.model_labels``).

    ``split``: every process of the initialised default process group scores its shard of each sequence
    (context parallelism, for sequences longer than one device holds); all return the curves, rank 0
    writes the files.

    Resumable: each model's running sums go to ``out/partial/<fingerprint>-<precision>.npz`` after every batch,
    with the model's fingerprint (config and weights), the precision and a hash of the sequences done, so
    another model, other data or a shorter ``--limit`` never reuses them."""
    if len(seqs) < 1:
        raise ValueError("per-token loss needs at least one sequence, got 0")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    names = model_labels(models, labels)
    writer = not split or torch.distributed.get_rank() == 0
    if writer:
        (out / "partial").mkdir(parents=True, exist_ok=True)
    curves = {}
    for path, name in zip(models, names):
        check_model_dir(path)
        fingerprint = model_fingerprint(path)
        key = f"{fingerprint}|{precision(device)}"
        part = out / "partial" / f"{fingerprint[:32]}-{precision(device)}.npz"
        part.with_name(part.name + ".tmp.npz").unlink(missing_ok=True)  # left by a run killed mid-write
        total, done = _resume(part, key, seqs)
        if split:  # every rank starts where rank 0's partial sums end
            agreed = [(total, done)]
            torch.distributed.broadcast_object_list(agreed, src=0)
            total, done = agreed[0]
        if done < len(seqs):
            model = load_model(path, device)
            context = context_parallel(model, seqs.shape[1]) if split else None
            vocab = model.config.vocab_size
            if seqs.min() < 0 or seqs.max() >= vocab:
                bad = int(seqs.min()) if seqs.min() < 0 else int(seqs.max())
                raise ValueError(f"--data holds token id {bad}, outside the vocabulary of --model {path!r} "
                                 f"(ids 0..{vocab - 1})")
            digest = _digest(seqs[:done])
            for s, loss in sequence_losses(model, seqs[done:], batch_size, device, desc=name, context=context):
                total += loss.sum(0)
                _feed(digest, seqs[done + s : done + s + len(loss)])
                if writer:
                    _save_partial(part, total=total, done=done + s + len(loss), key=key,
                                  seqs_digest=digest.hexdigest())
            del model
        curves[name] = total / len(seqs)
    if not writer:
        return curves
    np.savez(out / "per_token_loss.npz", **curves)
    summary = {name: {"model": str(Path(path).resolve()), "mean": float(c.mean()), "first": float(c[0]),
                      "last_10pct": float(c[-max(1, len(c) // 10):].mean()), "prefix_mean": prefix_means(c)}
               for (name, c), path in zip(curves.items(), models)}
    (out / "per_token_loss.json").write_text(json.dumps(
        {"num_sequences": len(seqs), "seq_len": seqs.shape[1], "precision": precision(device), "models": summary,
         "per_token_loss": {k: v.tolist() for k, v in curves.items()}}, indent=1))
    plot(curves, out / "per_token_loss", train_len)
    return curves


def prefix_means(curve: np.ndarray, shortest: int = 512) -> dict[str, float]:
    """Mean of L(i) over the first T, T/2, T/4, ... positions down to ``shortest`` (the official summary)."""
    out, length = {}, len(curve)
    while length >= min(shortest, len(curve)) and length > 0:
        out[str(length)] = float(curve[:length].mean())
        length //= 2
    return out


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
