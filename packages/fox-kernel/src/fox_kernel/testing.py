"""Helpers for testing kernels against the float64 reference (used by this and downstream packages)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def max_abs_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item()


def assert_close_to_reference(actual, exact, same_precision, *, name="output", factor=2.0, rtol_floor=2e-6):
    """Pass if ``actual`` is no further from ``exact`` (float64) than ``factor`` times a same-precision
    PyTorch computation is, plus a small floor relative to the size of the result (at least 1, as the
    inputs are O(1)): for float32 both errors sit at rounding level."""
    if actual.shape != exact.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(exact.shape)}")
    if not torch.isfinite(actual).all():
        raise AssertionError(f"{name}: non-finite values")
    err = max_abs_err(actual, exact)
    base = max_abs_err(same_precision, exact)
    bound = factor * base + rtol_floor * max(exact.abs().max().item(), 1.0)
    if err > bound:
        raise AssertionError(f"{name}: max error {err:.3e} > bound {bound:.3e} (same-precision torch error {base:.3e})")


def random_log_fgate(shape, *, speed="fast", device="cpu", generator=None) -> torch.Tensor:
    """Random float32 log forget gates. ``fast``: logsigmoid(N(0,1) + 1), mean log f about -0.35;
    ``slow``: logsigmoid(N(0,1) + 6), mean about -0.003 (long memory)."""
    shift = {"fast": 1.0, "slow": 6.0, "bench": 4.0}[speed]
    logits = torch.randn(shape, device=device, generator=generator) + shift
    return F.logsigmoid(logits).float()


def attention_inputs(B, Tq, Tk, H, Hkv, D, device, dtype, speed="fast", seed=0):
    """Seeded random q (B, Tq, H, D), k, v (B, Tk, Hkv, D) in ``dtype`` and float32 log gates (B, Tk, H) on
    ``device``, each a leaf that requires grad; drawn on the CPU, so a case gets the same values anywhere."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Tq, H, D, generator=g)
    k = torch.randn(B, Tk, Hkv, D, generator=g)
    v = torch.randn(B, Tk, Hkv, D, generator=g)
    log_fgate = random_log_fgate((B, Tk, H), speed=speed, generator=g)
    to = lambda x, dt: x.to(device=device, dtype=dt).requires_grad_()
    return to(q, dtype), to(k, dtype), to(v, dtype), to(log_fgate, torch.float32)


def head_major(c: torch.Tensor) -> torch.Tensor:
    """The same (..., T, H) values stored head-major, as ``fox_kernel.gate_cache`` stores prefix sums: a
    (..., T, H) view of (..., H, T) memory."""
    return c.transpose(-1, -2).contiguous().transpose(-1, -2)


def decode_inputs(B, T, H, Hkv, D, device="cuda", dtype=torch.bfloat16, seed=0):
    """A full cache for decoding benchmarks: q (B, 1, H, D), k, v (B, T, Hkv, D) in ``dtype``, prefix sums c
    (B, T, H) of gates with mean log f about -0.03 (``speed="bench"``), stored head-major as the caches of
    ``fox_kernel.decode`` store them, and cache_seqlens (B,) = T."""
    torch.manual_seed(seed)
    q = torch.randn(B, 1, H, D, device=device, dtype=dtype)
    k = torch.randn(B, T, Hkv, D, device=device, dtype=dtype)
    v = torch.randn_like(k)
    c = torch.cumsum(random_log_fgate((B, T, H), speed="bench", device=device), dim=1)
    c = head_major(c)
    lens = torch.full((B,), T, dtype=torch.int32, device=device)
    return q, k, v, c, lens


def run_interpreted(test_file: str, *, select: str = "not interpreted", timeout: int = 600) -> None:
    """Run the tests of ``test_file`` matching ``-k select`` in a fresh process with TRITON_INTERPRET=1
    (the interpreter must be on before Triton kernels are defined); fail with the run's output unless
    they pass. For a test that re-runs its own file on the CPU, which has no GPU to run the kernels."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", select],
                         env=env, capture_output=True, text=True, timeout=timeout, cwd=Path(test_file).parent)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]


def run_ranks(script: str, world_size: int, *args: str, timeout: int = 600) -> None:
    """Run ``script`` in ``world_size`` fresh processes, one per rank of a torch.distributed job (RANK,
    WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT in their environment, as torchrun sets them), each with
    ``args``; fail with a failing rank's output unless every rank exits with 0. For tests of distributed code
    with real processes (the gloo backend on the CPU)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, script, *args], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world_size)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    failed = [(r, out) for r, (p, out) in enumerate(zip(procs, outputs)) if p.returncode != 0]
    assert not failed, f"rank {failed[0][0]} of {world_size} failed:\n{failed[0][1][-6000:]}"
