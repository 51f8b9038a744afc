"""What every command shares: the device, bf16 autocast on GPU, loading a model folder with one-line errors,
a label for each model and an identity that changes whenever its config or weights do."""

from __future__ import annotations

import contextlib
import hashlib
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: the CLI imports this module to check its arguments, and
# `fox-eval --help` or an argument error must not wait for torch.

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
EXPORT_FOLDER = "hf"  # `fox-train` exports a run to RUN/hf: the run's name says more than "hf"


def resolve_device(name: str) -> torch.device:
    """``auto`` (a GPU when there is one), ``cpu``, ``cuda`` or ``cuda:i``."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA GPU is available here (use --device cpu or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def autocast(device: torch.device | str):
    """bf16 autocast on a GPU, as the paper evaluates (weights stay float32); nothing on the CPU."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def precision(device: torch.device | str) -> str:
    import torch

    return "bf16-autocast" if torch.device(device).type == "cuda" else "float32"


def check_model_dir(path: str) -> None:
    """A local model folder with a config.json: fox-eval reads no Hub repo id (for a missing folder the Hub
    client would answer "Repo id must be in the form ...")."""
    if not Path(path).exists():
        raise FileNotFoundError(f"--model {path!r} does not exist (expected a local model folder)")
    if not (Path(path) / "config.json").exists():
        raise FileNotFoundError(f"--model {path!r} is not a Hugging Face model directory (no config.json)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_model(path: str, device: torch.device):
    """The model in ``path`` (float32) on ``device``, in eval mode. A bad config, missing or corrupt
    weights raise one ValueError naming the folder; pickled weights are read with torch's weights-only
    loader (transformers' default), so a crafted file runs no code and is refused the same way."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    import fox_models  # noqa: F401  (registers the FoX model types)

    check_model_dir(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError, pickle.UnpicklingError) as e:
        raise ValueError(f"--model {path!r} cannot be loaded: {_first_line(e)}") from None
    # transformers initialises a parameter the weights lack and goes on: an evaluation of such a model would
    # measure random weights
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(f"--model {path!r} cannot be loaded: its weights lack {shown}")
    return model.to(device).eval()


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    import fox_models  # noqa: F401

    check_model_dir(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {path!r} holds no usable tokenizer: {_first_line(e)}") from None


def model_labels(paths: list[str], labels: list[str] | None = None) -> list[str]:
    """One unique, readable name per model folder: ``labels`` when given, else the folder's name (its
    parent's for an ``hf`` export folder), with more of the path in front where two names would clash
    and ``#2``, ``#3`` for a folder passed twice."""
    if labels is not None:
        if len(labels) != len(paths):
            raise ValueError(f"--labels: {len(paths)} models need {len(paths)} labels, got {len(labels)}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"--labels must be unique, got {labels}")
        return list(labels)
    unique = list(dict.fromkeys(Path(p).resolve() for p in paths))
    parts = []
    for p in unique:
        pp = p.parts[1:] or ("/",)
        parts.append(pp[:-1] if len(pp) > 1 and pp[-1] == EXPORT_FOLDER else pp)
    depth = [1] * len(unique)
    while True:
        names = ["/".join(pp[-d:]) for pp, d in zip(parts, depth)]
        clashing = [i for i, n in enumerate(names) if names.count(n) > 1 and depth[i] < len(parts[i])]
        if not clashing:
            break
        for i in clashing:
            depth[i] += 1
    name_of = dict(zip(unique, names))
    seen: dict[str, int] = {}
    out = []
    for p in paths:
        n = name_of[Path(p).resolve()]
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def model_fingerprint(path: str) -> str:
    """SHA-256 over config.json and every weights file (name and bytes): equal for the same model wherever
    it lies, different as soon as a weight or a config field changes."""
    folder = Path(path)
    h = hashlib.sha256()
    files = [folder / "config.json"] + sorted(f for f in folder.iterdir() if f.suffix in WEIGHT_SUFFIXES
                                              or f.name.endswith(".index.json"))
    for f in files:
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()
