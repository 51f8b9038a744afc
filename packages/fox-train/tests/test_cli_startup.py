"""fox-train's start: importing the command line, ``--help``, ``--cfg job`` and errors in the command line or
the composed config load neither torch, transformers nor fox_models (seconds of imports); the ``model``
group's values, read from fox-models' plain-data presets (``fox_models/preset_fields.py``) without importing
fox_models, are the fields of fox-models' configs."""

import functools
import subprocess
import sys

import pytest

from fox_train import config
from fox_train.cli import compose

HEAVY = ("torch", "transformers", "fox_models", "fox_kernel", "fox_layers", "lightning")

@pytest.fixture
def _run(run_cli):
    """``python -m fox_train.cli ARGS`` in a fresh interpreter: (exit code and the HEAVY modules it imported, output)."""
    return functools.partial(run_cli, "fox_train.cli", "fox-train", HEAVY)


def test_importing_the_cli_imports_no_torch(tmp_path):
    code = "import fox_train.cli, sys; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_console_script_help_prints_usage(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fox_train.cli", "--help"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fox-train [group=option ...] [key=value ...]" in r.stdout
    assert "== Configuration groups ==" in r.stdout and "fox-pro-760m" in r.stdout
    assert not list(tmp_path.iterdir())  # no outputs/ folder


def test_help_imports_no_torch(tmp_path, _run):
    got, out = _run(["--help"], tmp_path)
    assert got == {"exit": 0, "heavy": []}, out
    # the composed default config, with the default preset's fields
    assert "preset: fox-pro-tiny" in out and "hidden_size: 128" in out


def test_cfg_job_imports_no_torch(tmp_path, _run):
    got, out = _run(["model=mamba2-360m", "--cfg", "job"], tmp_path)
    assert got == {"exit": None, "heavy": []}, out
    assert "preset: mamba2-360m" in out and "state_size: 128" in out


@pytest.mark.parametrize("args, message", [
    (["foo=1"], "Key 'foo' not in 'TrainConfig'"),
    (["model=nope"], "Could not find 'model/nope'"),
    (["data.seq_len=abc"], "could not be converted to Integer"),
    (["model.hidden_size=1.5"], "model.hidden_size"),
    (["run_name=../x"], "run_name must be a plain folder name"),
    (["tokenize"], "required: input, output"),
    # found by the config's own check, before the trainer's imports
    (["global_batch_tokens=1"], "global_batch_tokens must be in [data.seq_len, schedule.total_tokens]"),
    (["data.order=nope"], "data.order must be one of"),
    (["strategy.fsdp_sharding=FOO"], "strategy.fsdp_sharding must be one of"),  # trained when FSDP was off
])
def test_argument_errors_import_no_torch(tmp_path, args, message, _run):
    got, out = _run(args, tmp_path)
    assert got["heavy"] == [] and got["exit"] not in (0, None), out
    assert message in out


def test_the_model_group_holds_the_fields_of_fox_models_configs():
    from fox_models.presets import PRESETS, TINY_PRESETS, get_preset

    assert config.preset_names() == PRESETS + TINY_PRESETS
    for name in PRESETS + TINY_PRESETS:
        model = get_preset(name)
        from_config = config.model_fields({k: getattr(model, k, None) for k in config.MODEL_FIELDS})
        assert config.preset_fields(name) == from_config, name
        assert compose([f"model={name}"]).model == config.ModelConfig(preset=name, **from_config)


def test_compositions_leave_the_stored_presets_as_they_were():
    """The ConfigStore is shared between Hydra's copies of it (config._SharedRepo): an override changes the
    composed config only."""
    assert compose(["model=fox-pro-tiny", "model.hidden_size=64", "model.num_heads=2"]).model.hidden_size == 64
    again = compose(["model=fox-pro-tiny"]).model
    assert (again.hidden_size, again.num_heads) == (128, 4)
    for name in ("mamba2-tiny", "samba-760m"):
        model = compose([f"model={name}"]).model
        assert {k: getattr(model, k) for k in config.preset_fields(name)} == config.preset_fields(name)
