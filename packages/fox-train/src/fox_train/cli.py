"""``fox-train``: train (default), ``tokenize`` text ahead of time, ``export`` a checkpoint.

    fox-train [key=value ...]              e.g. fox-train model=fox-pro-125m data=text data.path=corpus/
    fox-train experiment=longcrawl64/fox_pro_760m_48b data.path=... data.heldout_path=...
    fox-train tokenize INPUT OUTPUT.npy    text file/folder -> uint16 token file
    fox-train export CHECKPOINT_DIR OUT    any checkpoint -> Hugging Face directory
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np


def compose(overrides: list[str]):
    """The resolved TrainConfig for command-line overrides (unknown keys raise)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from fox_train.config import TrainConfig, register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_module("fox_train.conf", version_base=None):
        cfg = hydra_compose("config", overrides=overrides)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))


def _tokenize(args) -> None:
    import fox_models
    from fox_train.data import text_documents, tokenize_documents

    docs = text_documents(args.input)
    tokens = tokenize_documents(docs, fox_models.JSONGPT2Tokenizer())
    np.save(args.output, np.asarray(tokens))
    print(f"{len(docs)} documents, {len(tokens):,} tokens -> {args.output}")


def _export(args) -> None:
    from fox_train.train import export_checkpoint

    path = Path(args.checkpoint)
    if not (path / "state.pt").exists():
        raise SystemExit(f"fox-train export: {path} is not a checkpoint directory (no state.pt)")
    export_checkpoint(path, Path(args.output))
    print(f"exported {path} -> {args.output}")


def _keep_freed_memory() -> None:
    """Each step frees and re-allocates (tokens x vocab) logits; glibc would hand them back to the OS
    every time and page-fault them in again (a third of a CPU step). Keep them in the heap instead."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: 1 GiB
            libc.mallopt(-1, 1 << 31)  # M_TRIM_THRESHOLD: 2 GiB
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _keep_freed_memory()
    if argv and argv[0] in ("tokenize", "export"):
        ap = argparse.ArgumentParser(prog=f"fox-train {argv[0]}")
        if argv[0] == "tokenize":
            ap.add_argument("input", help="a .txt file or a folder of them")
            ap.add_argument("output", help="output .npy token file")
            _tokenize(ap.parse_args(argv[1:]))
        else:
            ap.add_argument("checkpoint", help="outputs/<run>/checkpoints/step-XXXXXXXX")
            ap.add_argument("output", help="directory for the Hugging Face model")
            _export(ap.parse_args(argv[1:]))
        return
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose(argv)
    except (ConfigCompositionException, OmegaConfBaseException) as e:
        cause = e.__cause__ or e
        raise SystemExit(f"fox-train: bad configuration: {cause}") from None
    from fox_train.train import train

    try:
        run_dir = train(cfg)
    except (FileNotFoundError, ValueError, ImportError) as e:
        raise SystemExit(f"fox-train: {e}") from None
    print(f"done: {run_dir}")


if __name__ == "__main__":
    main()
