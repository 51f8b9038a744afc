"""``fox-train``: a Hydra application that trains (default), plus ``tokenize`` and ``export`` subcommands.

    fox-train [key=value ...]              e.g. fox-train model=fox-pro-125m data=text data.path=corpus/
    fox-train experiment=longcrawl64/forgetting_transformer/pro_760m_48b data.path=... data.heldout_path=...
    fox-train -m optimizer.lr=5e-4,1e-3,2e-3   a sweep (Hydra multirun: one run directory per job)
    fox-train ... --cfg job                the composed config as YAML, without training
    fox-train --help                       config groups, options and every field
    fox-train tokenize INPUT OUTPUT.npy    text file/folder -> uint16 token file
    fox-train export CHECKPOINT_DIR OUT    any checkpoint -> Hugging Face directory

Errors in the command line or the configuration end the program with one line ``fox-train: ...``; so do
Ctrl-C and SIGTERM, after saving a checkpoint (exit status 128 + the signal's number).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import sys
from datetime import datetime
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from fox_train.config import (
    DataConfig,
    ModelConfig,
    TrainConfig,
    check,
    check_run_name,
    leaves,
    load_config,
    register,
    resumed_config,
)
from fox_train.errors import first_line

# numpy, torch, transformers and fox_models are imported inside the functions that use them (the model
# group's values come from fox-models' plain-data presets, read by fox_train.config.preset_fields without
# importing fox_models): `fox-train --help`, `--cfg job` and an error in the command line or the composed
# config answer without those imports.


class RunError(Exception):
    """A run stopped by its input (a missing file, a bad value); the message is one line for the user."""


def compose(overrides: list[str]) -> TrainConfig:
    """The resolved TrainConfig for command-line overrides (unknown keys raise), without running anything."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_module("fox_train.conf", version_base=None):
        cfg = hydra_compose("config", overrides=overrides)
    return _train_config(cfg)


def _train_config(cfg: DictConfig) -> TrainConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))


# Folders that Hydra is about to make for this main() call (absolute path -> the folders of it that do not
# exist yet, deepest first), noted when hydra.run.dir / hydra.sweep.dir are resolved, before Hydra makes them;
# for a sweep directory that exists already, the names of its entries then.
_NEW_DIRS: dict[str, list[Path]] = {}
_SWEEP_ENTRIES: dict[str, set[str]] = {}


def _note_new_dirs(path: str) -> None:
    target = p = Path(os.path.abspath(path))
    new = []
    while not p.exists() and p != p.parent:
        new.append(p)
        p = p.parent
    _NEW_DIRS[str(target)] = new
    if not new and target.is_dir():
        _SWEEP_ENTRIES[str(target)] = {e.name for e in target.iterdir()}


def _note_dir_overrides(argv: list[str]) -> None:
    """The folders of an explicit ``hydra.run.dir=`` / ``hydra.sweep.dir=`` argument (which Hydra takes
    without calling the resolvers that note them otherwise) that do not exist yet. A value Hydra still
    interpolates (``${...}``) is left to the resolvers it names."""
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if sep and key in ("hydra.run.dir", "hydra.sweep.dir") and value and "${" not in value:
            _note_new_dirs(value.strip("'\""))


def _remove_new_empty_dirs(run_dir: Path) -> None:
    """After a refused job: remove its run folder and the folders above it that this call made, while empty
    (a refused call leaves out_dir as it was). A sweep job's folder counts as made by this call when its
    sweep directory was, or held no entry of that name."""
    path = os.path.abspath(run_dir)
    parent = os.path.dirname(path)
    if path in _NEW_DIRS:
        new = _NEW_DIRS[path]
    elif parent in _NEW_DIRS and (_NEW_DIRS[parent] or os.path.basename(path) not in _SWEEP_ENTRIES.get(parent, set())):
        new = [Path(path), *_NEW_DIRS[parent]]
    else:
        return
    for d in new:
        try:
            d.rmdir()
        except OSError:  # not empty (or gone): what is above it stays too
            return


def _remove_refused_sweep() -> None:
    """After a sweep stopped by a refused job: a sweep directory that this call made and that holds nothing
    but Hydra's ``multirun.yaml`` (the refused jobs' folders are gone) is removed, with the folders above
    it that this call made, so a refused sweep leaves out_dir as it was."""
    for path, new in _NEW_DIRS.items():
        sweep = Path(path)
        if not new or not sweep.is_dir() or [e.name for e in sweep.iterdir()] != ["multirun.yaml"]:
            continue
        (sweep / "multirun.yaml").unlink()
        for d in new:
            try:
                d.rmdir()
            except OSError:  # not empty: what is above it stays too
                break


@functools.cache  # one answer per main(): Fabric reads hydra.run.dir again to start other processes
def _run_dir(out_dir: str, run_name: str | None, preset: str, source: str, resume: bool) -> str:
    """hydra.run.dir: ``out_dir/run_name``, else ``out_dir/<preset>-<source>-<time>`` (with ``resume``, the
    newest such run), as fox_train.run_dir.resolve_run_dir decides. A run_name that would leave out_dir is
    refused before Hydra makes the folder."""
    from fox_train.run_dir import resolve_run_dir

    run_name = None if run_name is None else str(run_name)
    check_run_name(run_name or None)
    cfg = TrainConfig(out_dir=out_dir, run_name=run_name, resume=resume, model=ModelConfig(preset=preset),
                      data=DataConfig(source=source))
    path = str(resolve_run_dir(cfg))
    _note_new_dirs(path)
    return path


@functools.cache
def _sweep_dir(out_dir: str, run_name: str | None) -> str:
    """hydra.sweep.dir: ``out_dir/run_name``, else ``out_dir/multirun-<time>``; each job runs in a numbered
    directory below it."""
    run_name = None if run_name is None else str(run_name)
    check_run_name(run_name or None)
    path = str(Path(out_dir) / (run_name or f"multirun-{datetime.now().strftime('%Y%m%d-%H%M%S')}"))
    _note_new_dirs(path)
    return path


def _check_run_name_arguments(argv: list[str]) -> None:
    """``run_name=NAME`` arguments, checked before Hydra's parser reads them: a newline or a non-ASCII letter
    stops its lexer with a message that names neither the key nor what it accepts. Quoted values are read
    without their quotes, a sweep's comma-separated values one by one; interpolations are left to the
    resolvers above."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key.lstrip("+") != "run_name" or value in ("", "null") or "${" in value:
            continue
        quoted = len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""
        for name in [value[1:-1]] if quoted else value.split(","):
            check_run_name(name)


def _register_resolvers() -> None:
    for name, fn in (("fox_run_dir", _run_dir), ("fox_sweep_dir", _sweep_dir)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=True)


def _command_line_keys(cfg: TrainConfig) -> set[str]:
    """The config keys this job's command line sets: those its overrides name, and those whose value
    differs from the default composition's (a group option or an experiment sets many)."""
    from hydra import compose as hydra_compose
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra_cfg = HydraConfig.get()
    named = {o.key_or_group for o in OverridesParser.create().parse_overrides(list(hydra_cfg.overrides.task))}
    given = leaves(OmegaConf.to_container(OmegaConf.structured(cfg)))
    default = _train_config(hydra_compose(config_name=hydra_cfg.job.config_name))
    default = leaves(OmegaConf.to_container(OmegaConf.structured(default)))
    return named | {k for k in given.keys() | default.keys() if given.get(k) != default.get(k)}


def _resumed(cfg: TrainConfig, run_dir: Path) -> TrainConfig:
    """With resume=true in a run directory that has a config.yaml: the saved config, with the RESUMABLE
    values this command line sets; ValueError naming the keys it sets to other values."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return cfg
    return resumed_config(load_config(saved), OmegaConf.to_container(OmegaConf.structured(cfg)), saved,
                          _command_line_keys(cfg))


def _save_hydra_record(task_cfg: DictConfig, run_dir: Path) -> None:
    """``run_dir/.hydra/{config,hydra,overrides}.yaml``, the files Hydra writes with its default
    ``hydra.output_subdir``. conf/config.yaml sets that to null and a job writes them once its call is
    accepted, so a refused call (a conflicting override with resume=true, a run that holds checkpoints)
    leaves the run folder as it was. Processes that Fabric starts for other local ranks write nothing."""
    from hydra.core.hydra_config import HydraConfig

    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    record = run_dir / ".hydra"
    record.mkdir(exist_ok=True)
    hydra_cfg = HydraConfig.instance().cfg
    for name, node in (("config.yaml", task_cfg), ("hydra.yaml", hydra_cfg),
                       ("overrides.yaml", hydra_cfg.hydra.overrides.task)):
        (record / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")


@hydra.main(version_base=None, config_path="conf", config_name="config")
def _app(dict_cfg: DictConfig) -> str:
    """One job: train in the run directory Hydra made for it (hydra.run.dir, or a sweep job's directory). A
    refused job removes that folder again when this call made it and it is empty."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        return _job(dict_cfg, run_dir)
    except BaseException:
        _remove_new_empty_dirs(run_dir)
        raise


def _job(dict_cfg: DictConfig, run_dir: Path) -> str:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from fox_train.run_dir import Interrupted, claim_run_dir

    cfg = _train_config(dict_cfg)
    out = Path(cfg.out_dir).resolve()
    if run_dir.is_relative_to(out):
        cfg.run_name = str(run_dir.relative_to(out))
    else:  # hydra.run.dir / hydra.sweep.dir set outside out_dir
        cfg.out_dir, cfg.run_name = str(run_dir.parent), run_dir.name
    try:
        if cfg.resume:
            cfg = _resumed(cfg, run_dir)
        check(cfg)  # before the trainer's imports (torch, Lightning): a refused config answers in seconds
        claim_run_dir(cfg, run_dir)
        from fox_train.train import train

        done = train(cfg, record=lambda d: _save_hydra_record(dict_cfg, d))
    # OSError: a missing file, a full or read-only disk; FloatingPointError: gradients not finite
    except (OSError, ValueError, ImportError, FloatingPointError) as e:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise RunError(str(e)) from None  # Hydra records the failed job, the sweep goes on, main() reports it
        raise SystemExit(f"fox-train: {e}") from None
    except Interrupted as e:  # a sweep stops too
        if e.is_global_zero:
            print(f"fox-train: {e}", file=sys.stderr)
        raise SystemExit(128 + e.signum) from None
    return str(done)


def _one_line(e: BaseException) -> str:
    """The first line of a Hydra or OmegaConf error, and of the error that caused it."""
    parts = [first_line(e).rstrip(".")]
    cause = e.__cause__
    if cause is not None and str(cause).strip():
        parts.append(first_line(cause))
    return ": ".join(parts)


def _tokenize(args) -> None:
    import numpy as np

    import fox_models
    from fox_train.data import text_documents, tokenize_documents
    from fox_train.disk import save_npy

    try:
        if Path(args.output).suffix != ".npy":  # the file is .npy whatever its name; a .bin would be read raw
            raise ValueError(f"output must end in .npy (a NumPy array of token ids), got {args.output!r}")
        docs = text_documents(args.input, "input")  # errors name the argument, not a training setting
        tokens = tokenize_documents(docs, fox_models.JSONGPT2Tokenizer())
        save_npy(Path(args.output), np.asarray(tokens))
    except (OSError, ValueError) as e:
        raise SystemExit(f"fox-train tokenize: {e}") from None
    print(f"{len(docs)} documents, {len(tokens):,} tokens -> {args.output}")


def _export(args) -> None:
    from fox_train.export import export_checkpoint

    path = Path(args.checkpoint)
    try:
        export_checkpoint(path, Path(args.output))
    except (OSError, ValueError) as e:
        raise SystemExit(f"fox-train export: {e}") from None
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
    argv = sys.argv[1:] if argv is None else list(argv)
    _keep_freed_memory()
    if argv and argv[0] in ("tokenize", "export"):
        ap = argparse.ArgumentParser(prog=f"fox-train {argv[0]}")
        try:
            if argv[0] == "tokenize":
                ap.add_argument("input", help="a .txt file or a folder of them")
                ap.add_argument("output", help="output .npy token file")
                _tokenize(ap.parse_args(argv[1:]))
            else:
                ap.add_argument("checkpoint", help="outputs/<run>/checkpoints/step-XXXXXXXX")
                ap.add_argument("output", help="directory for the Hugging Face model")
                _export(ap.parse_args(argv[1:]))
        except KeyboardInterrupt:
            print(f"fox-train {argv[0]}: interrupted", file=sys.stderr)
            raise SystemExit(130) from None
        return
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        _check_run_name_arguments(argv)
    except ValueError as e:
        raise SystemExit(f"fox-train: {e}") from None
    register()
    _register_resolvers()
    GlobalHydra.instance().clear()
    saved_argv, saved_full_error = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    # Hydra's own parser reads sys.argv; Fabric starts the other processes of a run with it
    sys.argv = [saved_argv[0] if saved_argv else "fox-train", *argv]
    _run_dir.cache_clear()
    _sweep_dir.cache_clear()
    _NEW_DIRS.clear()
    _SWEEP_ENTRIES.clear()
    _note_dir_overrides(argv)
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises errors (instead of printing them) for the lines below
    try:
        _app()
    except RunError as e:
        _remove_refused_sweep()
        raise SystemExit(f"fox-train: {e}") from None
    except (HydraException, OmegaConfBaseException) as e:
        raise SystemExit(f"fox-train: bad configuration: {_one_line(e)}") from None
    except OSError as e:  # Hydra cannot make the run directory or write its log
        raise SystemExit(f"fox-train: {e}") from None
    except ValueError as e:  # Hydra's own checks of its flags (-m with --cfg, say); a job's are RunErrors
        raise SystemExit(f"fox-train: {_one_line(e)}") from None
    except KeyboardInterrupt:  # outside the training steps (which save a checkpoint first), or a second Ctrl-C
        print("fox-train: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        sys.argv = saved_argv
        if saved_full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_full_error
        GlobalHydra.instance().clear()


if __name__ == "__main__":
    # run the importable module's main, so that launchers (submitit) can pickle its functions
    from fox_train import cli

    cli.main()
