"""Runs the kernel tests again with TRITON_INTERPRET=1, so CI (no GPU) checks the Triton code path.

The interpreter must be switched on before Triton kernels are defined, hence a fresh process.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.interpret
def test_triton_kernels_in_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already inside the interpreted run")
    pytest.importorskip("numpy")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = Path(__file__).parent
    tests = [str(here / name) for name in ("test_forgetting_attention.py", "test_decode.py", "test_zero_and_nan_gates.py",
                                               "test_window.py")]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
