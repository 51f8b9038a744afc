"""Export: a model, or any checkpoint of a run, as a Hugging Face directory (safetensors, config and
tokenizer) that ``from_pretrained`` and fox-eval load."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

import fox_models
from fox_train import checkpoint as ckpt
from fox_train.config import TrainConfig, load_config, model_config


def full_state_dict(fabric, model, strategy: str) -> dict | None:
    """The whole model's state dict on rank 0's CPU ({} on the other ranks) when FSDP or FSDP2 shard its
    parameters; None otherwise (every rank holds them). A collective: every rank must call it."""
    if fabric.world_size == 1 or strategy not in ("fsdp", "fsdp2"):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    wrapped = getattr(model, "_forward_module", model)  # Fabric's wrapper holds the FSDP one
    return get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_model(model, tokenizer, out: Path, state_dict: dict | None = None) -> None:
    """Hugging Face directory (safetensors + config + tokenizer) that from_pretrained and fox-eval load;
    ``state_dict``: the full weights of a sharded model (see full_state_dict)."""
    from safetensors import SafetensorError

    module = getattr(model, "module", model)
    module = getattr(module, "_orig_mod", module)
    try:
        module.save_pretrained(out, state_dict=state_dict)
        tokenizer.save_pretrained(out)
    except (OSError, SafetensorError) as e:  # a read-only or full folder (safetensors has its own error type)
        raise OSError(f"cannot write {out}: {e}") from None


def config_from_run(run_dir: Path) -> TrainConfig:
    """The TrainConfig a run saved in its ``config.yaml``."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no config.yaml (a checkpoint is read inside its run directory: "
                                f"<run>/checkpoints/step-XXXXXXXX)")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), load_config(path)))


def export_checkpoint(checkpoint: Path, out: Path) -> None:
    """Write the HF directory of any checkpoint (``fox-train export``). The checkpoint is read with
    ``weights_only`` (tensors and plain values); ValueError or OSError in one line for a file that is not
    such a checkpoint, a run without its config and an output folder that cannot be written."""
    state_path = checkpoint / "state.pt"
    if not state_path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint directory (no state.pt)")
    run_dir = checkpoint.parent.parent
    cfg = config_from_run(run_dir)
    state = ckpt.read_state(state_path)
    model = AutoModelForCausalLM.from_config(model_config(cfg.model))
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, TypeError, AttributeError) as e:  # other shapes or keys; not a state dict
        first = str(e).strip().splitlines()[-1].strip()
        raise ValueError(f"{state_path} does not fit the model of {run_dir / 'config.yaml'}: {first}") from None
    export_model(model, fox_models.JSONGPT2Tokenizer(), out)
