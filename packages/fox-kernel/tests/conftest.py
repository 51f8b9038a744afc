import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_DEVICE_DTYPES = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32"),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=pytest.mark.gpu),
    pytest.param(("cuda", torch.float16), id="cuda-fp16", marks=pytest.mark.gpu),
    pytest.param(("cuda", torch.float32), id="cuda-fp32", marks=pytest.mark.gpu),
]


@pytest.fixture(params=_DEVICE_DTYPES)
def device_dtype(request):
    device, dtype = request.param
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device(device), dtype


@pytest.fixture
def zero_gate_passes(monkeypatch) -> list[str]:
    """The zero-gate passes launched during the test, by name (``triton/fwd.py``, ``triton/bwd.py``)."""
    from fox_kernel.ops.triton import bwd, fwd

    launched = []

    def spy(name, original):
        def counting(*args):
            launched.append(name)
            return original(*args)
        return counting

    for module, name in ((fwd, "forward_zero_gates"), (bwd, "backward_zero_gates")):
        monkeypatch.setattr(module, name, spy(name, getattr(module, name)))
    return launched


@pytest.fixture
def gluon_host(monkeypatch):
    """``ops/gluon/host`` with empty tables of kept descriptors and recorded plans, both switched on (as in a
    fresh process); skips where this Triton has no Gluon."""
    from fox_kernel.ops import gluon

    if not gluon.available():
        pytest.skip("this Triton has no Gluon")
    from fox_kernel.ops.gluon import host

    for name, value in (("_DESCRIPTORS", {}), ("CACHED_DESCRIPTORS", True), ("_PLANS", {}), ("PLANS", True)):
        monkeypatch.setattr(host, name, value)
    return host


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def benchmark_script():
    """``load(name)``: the script ``benchmarks/NAME.py`` as a module (its neighbours, such as bench_pruning,
    importable while it loads)."""
    def load(name):
        sys.path.insert(0, str(BENCHMARKS))
        try:
            spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        finally:
            sys.path.remove(str(BENCHMARKS))
    return load
