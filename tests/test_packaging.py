"""Packaging: every package builds alone, and installs and imports with only what it declares.

Each case makes a fresh virtual environment from the lock holding one package and its declared
dependencies (``uv sync --package NAME --no-editable``), imports its public API there and checks that
packages from higher layers are absent, so a missing or upward dependency fails here.
"""

from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> (import name, code run in the isolated environment, modules that must NOT be installed)
PACKAGES = {
    "fox-kernel": (
        "fox_kernel",
        "import torch, fox_kernel; from fox_kernel.reference import forgetting_attention_ref\n"
        "q = torch.randn(1, 5, 2, 16); g = torch.nn.functional.logsigmoid(torch.randn(1, 5, 2))\n"
        "o = fox_kernel.forgetting_attention(q, q, q, g); r = forgetting_attention_ref(q, q, q, g)\n"
        "assert torch.allclose(o, r, atol=1e-5)",
        ["transformers", "fox_layers", "fox_models", "hydra", "lightning", "lm_eval"],
    ),
    "fox-layers": (
        "fox_layers",
        "import torch, fox_layers\n"
        "layer = fox_layers.ForgettingAttentionLayer(hidden_size=32, num_heads=2)\n"
        "assert layer(torch.randn(1, 6, 32))[0].shape == (1, 6, 32)",
        ["transformers", "fox_models", "hydra", "lightning", "lm_eval"],
    ),
    "fox-models": (
        "fox_models",
        "import fox_models, transformers\n"
        "cfg = fox_models.ForgettingTransformerConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2)\n"
        "model = transformers.AutoModelForCausalLM.from_config(cfg)\n"
        "assert type(model).__name__ == 'ForgettingTransformerForCausalLM'",
        ["fox_train", "fox_eval", "hydra", "lightning", "lm_eval"],
    ),
    "fox-train": (
        "fox_train",
        "import fox_train, fox_train.cli, hydra, lightning",
        ["fox_eval", "lm_eval"],
    ),
    "fox-eval": (
        "fox_eval",
        "import fox_eval, fox_eval.cli, lm_eval",
        ["fox_train", "hydra"],
    ),
}


def _uv() -> str:
    from uv import find_uv_bin

    return find_uv_bin()


def _run(cmd, **kw):
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, **kw)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
@pytest.mark.parametrize("package", list(PACKAGES))
def test_package_installs_and_imports_alone(package, tmp_path):
    import_name, smoke, absent = PACKAGES[package]
    venv = tmp_path / "venv"
    env = dict(os.environ, UV_PROJECT_ENVIRONMENT=str(venv))
    env.pop("VIRTUAL_ENV", None)
    _run([_uv(), "sync", "--frozen", "--package", package, "--no-dev", "--no-editable", "--quiet"], env=env)
    check = (
        f"{smoke}\n"
        "import importlib.util, sys\n"
        f"present = [m for m in {absent!r} if importlib.util.find_spec(m) is not None]\n"
        "assert not present, f'installed but not declared below this layer: {present}'\n"
        f"import {import_name}; assert '/site-packages/' in {import_name}.__file__, {import_name}.__file__\n"
    )
    _run([str(venv / "bin" / "python"), "-c", check], env=env)


@pytest.mark.slow
def test_every_package_builds_a_wheel_and_sdist(tmp_path):
    for package, (import_name, _, _) in PACKAGES.items():
        out = tmp_path / package
        _run([_uv(), "build", "--package", package, "--out-dir", str(out), "--quiet"])
        wheels = list(out.glob("*.whl"))
        sdists = list(out.glob("*.tar.gz"))
        assert len(wheels) == 1 and len(sdists) == 1, (package, list(out.iterdir()))
        names = zipfile.ZipFile(wheels[0]).namelist()
        assert f"{import_name}/__init__.py" in names, names[:20]
