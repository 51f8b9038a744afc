"""Warm start (``init_from``): the model weights of another run, a checkpoint or a Hugging Face directory,
copied into a new model before training begins at step 0."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fox_train import checkpoint as ckpt


def init_weights_path(path: str) -> Path:
    """The file holding the weights ``init_from`` names: a checkpoint directory's ``state.pt``, a run
    directory's newest complete checkpoint or a Hugging Face directory's ``model.safetensors``."""
    p = Path(path)
    if (p / "state.pt").exists():
        return p / "state.pt"
    newest = ckpt.complete_checkpoints(p / "checkpoints")
    if newest:
        return newest[0] / "state.pt"
    if (p / "model.safetensors").exists():
        return p / "model.safetensors"
    raise FileNotFoundError(f"init_from {path!r} is not a checkpoint directory (state.pt), a run directory with a "
                            f"complete checkpoint or a Hugging Face directory (model.safetensors)")


def _check_hf_config(path: str, config_file: Path, model_type: str) -> None:
    """A Hugging Face directory's config.json, when it has one, must be JSON naming this run's model type: a
    damaged folder or another kind of model is refused before its weights are read."""
    if not config_file.exists():
        return
    try:
        saved = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"init_from {path!r}: {config_file} cannot be read: {e}") from None
    saved_type = saved.get("model_type") if isinstance(saved, dict) else None
    if saved_type != model_type:
        raise ValueError(f"init_from {path!r}: {config_file} has model_type {saved_type!r}, this run's model is "
                         f"{model_type!r}")


def load_init_weights(model: torch.nn.Module, path: str) -> Path:
    """Warm start: copy the model weights of another run (see TrainConfig.init_from) into ``model``; the
    optimizer, step and data position are not taken. Returns the file read."""
    source = init_weights_path(path)
    if source.suffix == ".safetensors":
        from safetensors.torch import load_file

        _check_hf_config(path, source.parent / "config.json", model.config.model_type)
        try:
            weights = load_file(source)
        except Exception as e:  # safetensors reports a truncated or foreign file in its own error type
            raise ValueError(f"init_from {path!r}: {source} cannot be read: {e}") from None
    else:
        weights = ckpt.read_state(source)["model"]
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # a shape differs
        first = str(e).strip().splitlines()[-1].strip()
        raise ValueError(f"init_from {path!r} does not fit model {model.config.model_type}: {first}") from None
    # lm_head may be tied to the embeddings in a Hugging Face directory (saved once)
    missing = [k for k in missing if not (k == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False))]
    if missing or unexpected:
        raise ValueError(f"init_from {path!r} does not fit model {model.config.model_type}: missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}")
    return source
