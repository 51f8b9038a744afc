"""Runs the kernel tests again with TRITON_INTERPRET=1, so CI (no GPU) checks the Triton code path.

The interpreter must be switched on before Triton kernels are defined, hence a fresh process. The
workspace's conftest.py starts it right after collection, so it runs beside the other tests; this test
waits for it and reads its result.
"""

import importlib.util
import os

import pytest

TIMEOUT_S = 2400


# skip markers, not skips in the body: the fixture would otherwise start the subprocess before the skip
@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already inside the interpreted run")
@pytest.mark.skipif(importlib.util.find_spec("numpy") is None, reason="the interpreter needs numpy")
def test_triton_kernels_in_the_interpreter(interpreted_kernel_run):
    proc, log = interpreted_kernel_run
    try:
        proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    log.unlink(missing_ok=True)
    assert proc.returncode == 0, out[-8000:]
    assert " passed" in out and " failed" not in out
