"""The cached launcher (``ops/triton/launch.run``): a launch that hits its cache runs the kernel Triton would
run, gives what Triton's own launch path gives, and a new specialisation (pointer alignment, an int of 1,
a dtype, a constexpr) goes through Triton again instead of reusing a kernel compiled for other arguments."""

import os
import subprocess
import sys

import pytest
import torch

from fox_kernel import forgetting_attention
from fox_kernel.ops.triton import launch, sums
from fox_kernel.testing import random_log_fgate


@pytest.fixture
def cached_launches(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if launch.INTERPRET:
        pytest.skip("the interpreter launches through Triton")
    monkeypatch.setattr(launch, "CACHED", True)


def _triton_launches(monkeypatch, kernel):
    """A list that grows by one each time ``kernel`` goes through Triton's own launch path."""
    seen = []
    run = kernel.run

    def counting(*args, **kwargs):
        seen.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counting)
    return seen


def _delta_inputs(T, H, D, dtype, offset, seed):
    g = torch.Generator().manual_seed(seed)
    # ``offset`` elements into a flat buffer: an offset of 1 leaves the rows 2 bytes off 16-byte alignment
    flat = torch.randn(2, offset + T * H * D, generator=g).to("cuda", dtype)
    out, do = (x[offset:].view(1, T, H, D) for x in flat)
    return out, do


@pytest.mark.gpu
def test_a_hit_skips_triton_and_a_new_specialisation_does_not(monkeypatch, cached_launches):
    monkeypatch.setattr(launch, "_COMPILED", {})  # as in a fresh process
    seen = _triton_launches(monkeypatch, sums._delta_kernel)
    cases = [  # (T, H, D, dtype, offset): each differs from the one before in what Triton specialises on
        (96, 3, 64, torch.bfloat16, 0),
        (96, 3, 64, torch.bfloat16, 0),  # the same again: a hit
        (96, 3, 64, torch.bfloat16, 1),  # pointers off 16-byte alignment
        (1, 3, 64, torch.bfloat16, 0),  # a length of 1 (Triton makes it a constant)
        (96, 3, 64, torch.float16, 0),  # another dtype
        (96, 3, 40, torch.bfloat16, 0),  # a head dim not divisible by 16
        (96, 3, 100, torch.bfloat16, 0),  # another BLOCK_D constexpr (128)
        (112, 5, 64, torch.bfloat16, 1),  # other sizes, the same specialisation as the third case
    ]
    expected_through_triton = [True, False, True, True, True, True, True, False]
    for i, ((T, H, D, dtype, offset), through_triton) in enumerate(zip(cases, expected_through_triton)):
        before = len(seen)
        out, do = _delta_inputs(T, H, D, dtype, offset, seed=i)
        got = sums.delta(out, do)
        want = (out.float() * do.float()).sum(-1).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (len(seen) > before) == through_triton, (i, cases[i])


@pytest.mark.gpu
def test_cached_and_triton_launches_give_identical_results(monkeypatch, cached_launches):
    """A pruned forward+backward (every pass of the kernel, Gluon or Triton as the GPU takes them), run
    three times with cached launches and once through Triton alone: bit-identical outputs and gradients."""
    g = torch.Generator().manual_seed(3)
    B, T, H, D = 2, 333, 4, 64
    q, k, v, do = (torch.randn(B, T, H, D, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    lf = random_log_fgate((B, T, H), speed="fast", generator=g).cuda()

    def step():
        leaves = [x.clone().requires_grad_() for x in (q, k, v, lf)]
        out = forgetting_attention(*leaves, adaptive_threshold="auto", zero_gates=False)
        return [out, *torch.autograd.grad(out, leaves, do)]

    cached = [step() for _ in range(3)]
    monkeypatch.setattr(launch, "CACHED", False)
    through_triton = step()
    for run in cached:
        for a, b in zip(run, through_triton):
            assert torch.equal(a, b)


@pytest.mark.parametrize("with_defaults", [False, True])
def test_binder_binds_as_python_and_keys_what_triton_specialises(with_defaults):
    """On the CPU (no launch): the generated binder puts a call's arguments in the kernel's parameter order
    as Python's own binding of its signature does, and its key changes where Triton's specialisation does
    (alignment, an int of 1 or a multiple of 16, a dtype, a constexpr) and nowhere else."""
    import inspect

    from triton.backends.compiler import BaseBackend

    kernel = sums._delta_kernel
    bind = launch.make_binder(kernel, BaseBackend)
    buffer = torch.randn(10_000)

    def call(T=37, D=40, offset=0, dtype=torch.float32, block_m=64):
        x = buffer[offset:offset + T * 3 * D].to(dtype).view(1, T, 3, D)
        args = (x, x, torch.empty(1, 3, T), (T * 3 * D, 3 * D, D), (T * 3 * D, 3 * D, D), 3, T, D)
        kwargs = dict(BLOCK_D=64, num_warps=4)
        if with_defaults:
            kwargs["BLOCK_M"] = block_m
        else:
            args = args + (block_m,)
        return args, kwargs

    args, kwargs = call()
    values, key, options = bind(*args, **kwargs)
    bound = inspect.signature(kernel.fn).bind(*args, **{k: v for k, v in kwargs.items() if k != "num_warps"})
    assert values == tuple(bound.arguments.values())
    assert options == (("num_warps", 4),)
    same = [call(T=41), call(T=53, D=56)]  # other lengths and dims with the same remainders mod 16
    for args2, kwargs2 in same:
        assert bind(*args2, **kwargs2)[1] == key
    different = [call(offset=1), call(T=1), call(T=48), call(D=48), call(dtype=torch.bfloat16), call(block_m=32)]
    for args2, kwargs2 in different:
        assert bind(*args2, **kwargs2)[1] != key


@pytest.mark.parametrize("value, cached", [("0", False), ("1", True), (None, True)])
def test_the_environment_switch(value, cached):
    env = {k: v for k, v in os.environ.items() if k != "FOX_KERNEL_CACHED_LAUNCH"}
    if value is not None:
        env["FOX_KERNEL_CACHED_LAUNCH"] = value
    code = "from fox_kernel.ops.triton import launch; print(launch.CACHED)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(cached)


@pytest.mark.parametrize("variable", ["FOX_KERNEL_CACHED_LAUNCH", "FOX_KERNEL_ZERO_REPORTS"])
def test_a_bad_environment_switch_is_refused_naming_it(variable):
    env = dict(os.environ, **{variable: "yes"})
    out = subprocess.run([sys.executable, "-c", "import fox_kernel"], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert f"{variable} must be 0 or 1, got 'yes'" in out.stderr


class _Recorder:
    """Stands in for a kernel without a JIT function's parameters (so ``run`` takes Triton's own path):
    records each launch's grid, arguments and options."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@pytest.mark.parametrize("cached", [True, False])
def test_every_launch_keeps_fused_multiply_adds_on(monkeypatch, cached):
    """Triton 3.10 turns fused multiply-adds off by default: every launch asks for them, unless a caller
    says otherwise."""
    monkeypatch.setattr(launch, "CACHED", cached)
    kernel = _Recorder()
    launch.run(kernel, (3, 1), 7, "x", BLOCK=16)
    launch.run(kernel, (2,), 8, enable_fp_fusion=False)
    assert kernel.launches == [((3, 1), (7, "x"), dict(enable_fp_fusion=True, BLOCK=16)),
                               ((2,), (8,), dict(enable_fp_fusion=False))]


def test_plain_cdiv_and_next_power_of_2_equal_tritons():
    """The launchers' ``cdiv`` and ``next_power_of_2`` give what Triton's give, small and large values."""
    import random

    import triton

    rng = random.Random(0)
    values = list(range(0, 4100)) + [rng.randrange(2**20, 2**40) for _ in range(500)] + [2**k for k in range(41)]
    for n in values:
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n), n
    for x in values:
        for y in (1, 3, 16, 64, 128, 1000, rng.randrange(1, 2**20)):
            assert launch.cdiv(x, y) == triton.cdiv(x, y), (x, y)
