"""The Gluon forward's and backward's recorded plans (``ops/gluon/host._Plan``, ``ops/triton/launch.recording``
and ``replay``).

On a GPU: a forward and a backward replayed from their plans give, bit for bit, what the same calls
launched through ``launch.run`` give (outputs, log-sum-exp, threshold, prefix sums, gradients), exact and
pruned, with and without gates of 0, at both head dims, both 16-bit types, with GQA and a threshold tensor;
a call that differs in what Triton specialises on (the gates' alignment) gets a plan of its own; no plan is
used while a launch hook is registered, nor made for the one-pass backward; a plan holds no tensor of its
call.

On the CPU: how recorded launches are kept (which arguments are the call's, which a plan refuses) and how
a replay puts a call's tensors in their places."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fox_kernel import forgetting_attention
from fox_kernel.ops.triton import launch
from fox_kernel.testing import random_log_fgate


@pytest.fixture
def host(gluon_host):
    return gluon_host


@pytest.fixture
def gpu_plans(host, monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels run on sm90 GPUs")
    monkeypatch.setattr(launch, "CACHED", True)
    replays = []
    run = host._Plan.run

    def counting(self, *args):
        replays.append(1)
        return run(self, *args)

    monkeypatch.setattr(host._Plan, "run", counting)
    return host, replays


def _inputs(B, T, H, Hkv, D, dtype, seed, zero_at=None, gate_offset=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to("cuda", dtype)
    k, v = (torch.randn(B, T, Hkv, D, generator=g).to("cuda", dtype) for _ in range(2))
    lf = random_log_fgate((B, T, H), speed="fast", generator=g)
    if zero_at is not None:
        lf[0, zero_at, :] = float("-inf")  # a gate of exactly 0 in every head of row 0
    # ``gate_offset`` elements into a buffer: an offset of 1 leaves the gates 4 bytes off 16-byte alignment
    flat = torch.zeros(gate_offset + lf.numel())
    flat[gate_offset:] = lf.flatten()
    return q, k, v, flat.cuda()[gate_offset:].view(B, T, H)


CASES = [  # (B, T, H, Hkv, D, dtype, adaptive_threshold, zero_gates, a gate of 0 at)
    (2, 333, 4, 4, 64, torch.bfloat16, "auto", True, None),
    (1, 700, 6, 2, 128, torch.bfloat16, "auto", False, None),
    (2, 257, 4, 4, 128, torch.float16, None, True, 100),
    (1, 400, 4, 2, 64, torch.float16, "auto", True, 250),
    (2, 300, 4, 4, 64, torch.bfloat16, "tensor", False, None),
    (1, 513, 4, 4, 128, torch.bfloat16, None, False, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-H{c[2]}/{c[3]}-D{c[4]}-{c[5]}-{c[6]}-zg{c[7]}"
                                                     f"-zero{c[8]}")
def test_a_replayed_forward_and_backward_are_the_launched_ones_bit_for_bit(gpu_plans, monkeypatch, case):
    host, replays = gpu_plans
    B, T, H, Hkv, D, dtype, threshold, zero_gates, zero_at = case
    if threshold == "tensor":
        threshold = -3.0 - torch.rand(B, H, generator=torch.Generator().manual_seed(1)).cuda()
    g = torch.Generator().manual_seed(7)
    do = torch.randn(B, T, H, D, generator=g).to("cuda", dtype)

    def step(seed):
        leaves = [x.requires_grad_() for x in _inputs(B, T, H, Hkv, D, dtype, seed, zero_at)]
        out = forgetting_attention(*leaves, adaptive_threshold=threshold, zero_gates=zero_gates)
        return [out, *torch.autograd.grad(out, leaves, do)]

    recorded = step(0)  # records the forward's and the backward's plans
    assert len(host._PLANS) == 2 and not replays
    replayed = [step(0), step(1)]
    assert len(replays) == 4 and len(host._PLANS) == 2
    monkeypatch.setattr(host, "PLANS", False)
    launched = [step(0), step(1)]
    for a, b in zip(recorded, launched[0]):
        assert torch.equal(a, b)
    for run_a, run_b in zip(replayed, launched):
        for a, b in zip(run_a, run_b):
            assert torch.equal(a, b)
    assert all(torch.isfinite(x).all() for x in replayed[1])


@pytest.mark.gpu
def test_the_forwards_other_outputs_are_the_launched_ones(gpu_plans, monkeypatch):
    """The threshold and prefix sums a replay returns (which the backward and the zero-gate pass read)."""
    from fox_kernel.ops import dispatch
    from fox_kernel.ops.call import AttentionCall
    from fox_kernel.options import current_options
    from fox_kernel.pruning import DEFAULT_LOG_TOLERANCE

    host, replays = gpu_plans
    q, k, v, lf = _inputs(2, 300, 4, 2, 128, torch.bfloat16, 3, zero_at=120)
    call = AttentionCall(128**-0.5, auto_log_eps=DEFAULT_LOG_TOLERANCE, options=current_options(), zero_gates=True)
    runs = []
    for plans in (True, True, False):
        monkeypatch.setattr(host, "PLANS", plans)
        out, lse, threshold, (c, z, seen) = dispatch.forward_keeping_sums(q, k, v, lf, call)
        torch.cuda.synchronize()
        assert seen is not None and not seen.clean()  # the kernel reported the gate of 0
        runs.append((out, lse, threshold, c, z))
    assert len(replays) == 1
    for a, b in zip(runs[1], runs[2]):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_another_gate_alignment_gets_its_own_plan(gpu_plans, monkeypatch):
    host, replays = gpu_plans
    outs = []
    for offset in (0, 1, 1, 0):
        q, k, v, lf = _inputs(1, 200, 4, 4, 64, torch.bfloat16, 5, gate_offset=offset)
        assert (lf.data_ptr() % 16 == 0) == (offset == 0)
        outs.append(forgetting_attention(q, k, v, lf, adaptive_threshold="auto"))
    assert len(host._PLANS) == 2 and len(replays) == 2  # forward plans (no backward ran)
    monkeypatch.setattr(host, "PLANS", False)
    want = forgetting_attention(q, k, v, lf, adaptive_threshold="auto")
    for out in outs:
        assert torch.equal(out, want)


@pytest.mark.gpu
def test_no_plan_while_a_launch_hook_is_registered(gpu_plans, monkeypatch):
    from triton import knobs

    host, replays = gpu_plans
    q, k, v, lf = _inputs(1, 200, 4, 4, 64, torch.bfloat16, 6)
    forgetting_attention(q, k, v, lf)
    assert len(host._PLANS) == 1
    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "calls"):  # a chain of hooks (what Triton's profiler adds to)
        monkeypatch.setattr(chain, "calls", [*chain.calls, hook])
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    forgetting_attention(q, k, v, lf)
    assert not replays and len(seen) >= 3  # every launch went through Triton, which called the hook


@pytest.mark.gpu
def test_the_one_pass_backward_is_not_planned(gpu_plans, monkeypatch):
    """It ends in PyTorch ops that a replay of its launches would leave out."""
    from fox_kernel.options import current_options

    host, replays = gpu_plans
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    options = current_options().replace(backward="fused")
    q, k, v, lf = (x.requires_grad_() for x in _inputs(1, 300, 4, 4, 64, torch.bfloat16, 9))
    grads = []
    for _ in range(2):
        out = forgetting_attention(q, k, v, lf, options=options)
        grads.append(torch.autograd.grad(out.float().sum(), (q, k, v, lf)))
    assert [key[0] for key in host._PLANS] == ["forward"] and len(replays) == 1
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # atomics: the order of additions varies


@pytest.mark.gpu
def test_a_plan_holds_no_tensor_of_its_call(gpu_plans):
    host, _ = gpu_plans
    q, k, v, lf = _inputs(1, 256, 4, 4, 128, torch.bfloat16, 8)
    out = forgetting_attention(q, k, v, lf, adaptive_threshold="auto")
    assert len(host._PLANS) == 1
    alive = [weakref.ref(x) for x in (out, q, k, v, lf)]
    del out, q, k, v, lf
    gc.collect()
    assert all(ref() is None for ref in alive)


# On the CPU: the recorded launches and their replay, without a GPU.


class _Compiled:
    """Stands in for a compiled kernel's launcher: keeps what each launch passed."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


def test_slots_name_the_calls_tensors_and_refuse_unnamed_buffers():
    a, b, other = torch.zeros(3), torch.zeros(2), torch.zeros(1)
    named = {id(a): "a", id(b): "b"}
    assert launch.slots_of((a, 3, None, b, (1, 2), 0.5, a), named) == ((0, "a"), (3, "b"), (6, "a"))
    assert launch.slots_of((a, other), named) is None

    assert launch.slots_of((_Descriptor(),), named) is None
    assert launch.slots_of((7, "x"), named) == ()


def test_a_replay_puts_each_calls_tensors_in_their_places():
    compiled = _Compiled()
    recorded = launch.Recorded(None, compiled, (4, 2, 1), (None, 16, None, 1.5, None))
    slots = ((0, "x"), (2, "y"), (4, "x"))
    x, y = torch.ones(2), torch.zeros(3)
    launch.replay(recorded, slots, {"x": x, "y": y}, "stream")
    (args,) = compiled.launches
    assert args[:9] == (4, 2, 1, "stream", "function", "metadata", None, None, None)
    assert args[9:] == (x, 16, y, 1.5, x)
    assert recorded.values == (None, 16, None, 1.5, None)  # the template is left as it was


def test_recording_marks_launches_through_tritons_own_path(monkeypatch):
    """A launch through Triton's path (here a kernel without a JIT function's parameters) is recorded as
    None, so that no plan is made of its call; nothing is recorded outside ``recording``."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(grid)

    monkeypatch.setattr(launch, "CACHED", True)
    with launch.recording() as launches:
        launch.run(Kernel(), (1,), 3)
        launch.run(Kernel(), (2,), 4)
    launch.run(Kernel(), (3,), 5)
    assert launches == [None, None] and calls == [(1,), (2,), (3,)]
    assert launch._RECORDING is None


class _Descriptor:
    """Stands in for a TMA descriptor (which has a base, not a data_ptr)."""

    base = None


def _recorded(*values_per_launch):
    return [launch.Recorded(None, _Compiled(), (1, 1, 1), values) for values in values_per_launch]


def test_a_plan_is_refused_where_a_replay_could_not_be_right(host):
    q, k, v, lf, c, out, lse = (torch.zeros(2) for _ in range(7))
    inputs = dict(q=q, k=k, v=v, log_fgate=lf, call_threshold=None)
    made = dict(c=c, out=out, lse=lse, z=None)
    q_desc, k_desc = _Descriptor(), _Descriptor()
    taken = [(q, 64, q_desc), (k, 128, k_desc), (q, 64, q_desc)]
    good = _recorded((lf, c, 3), (c, None, 2.0), (q_desc, k_desc, c, out, lse, 7))
    plan = host._Plan.build(good, 3, inputs, made, taken, None)
    assert plan is not None
    assert [slots for _, slots in plan.launches] == [((0, "log_fgate"), (1, "c")), ((0, "c"),),
                                                     ((0, "q@64"), (1, "k@128"), (2, "c"), (3, "out"), (4, "lse"))]
    kept = [x for recorded, _ in plan.launches for x in recorded.values]
    assert not any(isinstance(x, torch.Tensor) for x in kept)  # the plan keeps no tensor of the call
    assert [a[0] for a in plan.allocations] == ["c", "out", "lse"]
    assert plan.descriptors == (("q@64", "q", 64), ("k@128", "k", 128)) and not plan.ticket
    refused = [
        (good[:2], taken),  # a launch fewer (a call with nothing to launch in one pass)
        ([good[0], None, good[2]], taken),  # one went through Triton's path
        (_recorded((lf, c, 3), (c, torch.zeros(1)), (q_desc, out)), taken),  # a buffer that is not the call's
        (good, [*taken, (c, 64, _Descriptor())]),  # a descriptor of a buffer made here, not of an input
        (good, [*taken, (q, 64, _Descriptor())]),  # two descriptors of one tensor and tile (not kept ones)
    ]
    for launches, descriptors in refused:
        assert host._Plan.build(launches, 3, inputs, made, descriptors, None) is None
    aliased = dict(inputs, k=q)  # q and k one tensor: a replay could not tell them apart
    assert host._Plan.build(_recorded((lf, c), (c,), (q, out)), 3, aliased, made, [], None) is None
