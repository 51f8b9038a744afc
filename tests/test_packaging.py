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


def _locked_constraints(tmp_path, package: str) -> Path:
    """The lock's versions of ``package``'s third-party dependencies, as pip constraints: the install tests
    below resolve like pip does (no lock), but onto the versions CI has cached (no fresh torch download)."""
    path = tmp_path / "constraints.txt"
    _run([_uv(), "export", "--frozen", "--package", package, "--no-dev", "--no-hashes", "--no-emit-workspace",
          "--no-header", "--quiet", "-o", str(path)])
    return path


def _fresh_venv(tmp_path, name: str) -> Path:
    venv = tmp_path / name
    _run([_uv(), "venv", "--quiet", str(venv)])
    return venv / "bin" / "python"


LAYERS_SMOKE = PACKAGES["fox-layers"][1] + "\nimport fox_kernel; assert '/site-packages/' in fox_kernel.__file__"


@pytest.mark.slow
def test_install_from_built_wheels(tmp_path):
    """The README's "from built wheels": build fox-kernel and fox-layers, then install fox-layers by name with
    ``--find-links dist`` into a fresh environment (fox-kernel comes from dist/ too, the rest from the index)."""
    dist = tmp_path / "dist"
    for package in ("fox-kernel", "fox-layers"):
        _run([_uv(), "build", "--package", package, "--wheel", "--out-dir", str(dist), "--quiet"])
    python = _fresh_venv(tmp_path, "wheels")
    _run([_uv(), "pip", "install", "--quiet", "--python", str(python), "--find-links", str(dist),
          "-c", str(_locked_constraints(tmp_path, "fox-layers")), "fox-layers"])
    _run([str(python), "-c", LAYERS_SMOKE])


@pytest.mark.slow
def test_install_from_git_subdirectories(tmp_path):
    """The README's "from git, without a clone": one command naming fox-kernel and fox-layers as
    ``NAME @ git+REPO#subdirectory=packages/NAME`` (REPO: this repository's committed HEAD, as a file URL)."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: no commit to install from")
    repo = f"git+{ROOT.as_uri()}"
    python = _fresh_venv(tmp_path, "git")
    _run([_uv(), "pip", "install", "--quiet", "--python", str(python),
          "-c", str(_locked_constraints(tmp_path, "fox-layers")),
          f"fox-kernel @ {repo}#subdirectory=packages/fox-kernel", f"fox-layers @ {repo}#subdirectory=packages/fox-layers"])
    _run([str(python), "-c", LAYERS_SMOKE])
