"""The prefix-sums kernel's report of gates of exactly 0 (``ops/zero_flags.py``), and the zero-gate passes
it lets the host skip: a pass is skipped only on a report that has come back clean, and a skipped pass
changes nothing. test_interpreted.py runs this file again with TRITON_INTERPRET=1 (the kernel cases)."""

import os

import pytest
import torch
import torch.nn.functional as F

from fox_kernel import KernelOptions, forgetting_attention
from fox_kernel.ops import zero_flags
from fox_kernel.reference import forgetting_attention_ref

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def test_a_ticket_is_clean_until_a_kernel_writes_or_a_later_call_takes_its_slot():
    """On the CPU (no event to wait for): a fresh ticket holds its own number; -1 from the kernel, or the
    number of the call that takes the slot next, makes it unclean for good, while the later ticket is
    clean. Numbers are never reused (so never -1 either)."""
    cpu = torch.device("cpu")
    first = zero_flags.ticket(cpu)
    assert first.clean() and first.flag.numel() == 1 and first.flag.data_ptr() % 16 == 0
    later = [zero_flags.ticket(cpu) for _ in range(zero_flags.SLOTS)]
    assert not first.clean()  # the last of these took its slot
    assert later[-1].flag.data_ptr() == first.flag.data_ptr() and later[-1].clean()
    later[-1].flag.fill_(-1)
    assert not later[-1].clean() and later[-2].clean()
    numbers = {int(t.flag.item()) for t in later[:-1]}
    assert len(numbers) == zero_flags.SLOTS - 1 and min(numbers) > 0


def _expected_flag(lf, seq_start):
    """Whether some row has a gate of 0 past its first position and not before its ``seq_start``."""
    T = lf.shape[1]
    start = torch.zeros(lf.shape[0], dtype=torch.long) if seq_start is None else seq_start.long().cpu()
    pos = torch.arange(T)[None, :, None]
    counted = (pos >= start[:, None, None]) & (pos > 0)
    return bool((torch.isneginf(lf.cpu()) & counted).any())


def _triton_device():
    if torch.cuda.is_available():
        return torch.device("cuda")
    if INTERPRET:
        return torch.device("cpu")
    pytest.skip("Triton kernels: CUDA or the interpreter")


@pytest.mark.parametrize("B, T, H", [(1, 1, 1), (2, 37, 3), (3, 130, 2)])
@pytest.mark.parametrize("where", ["none", "first position", "one row", "padding", "seq_start"])
def test_the_prefix_sums_report_exactly_the_gates_of_0_that_hide_keys(B, T, H, where):
    """Random gates with a 0 placed per case: none; at position 0 only (it hides no key: not reported); in
    one (row, head) only; before ``seq_start`` only (padding: not reported); on a row's ``seq_start``
    (reported: the passes then run and mask padding). Both kernels that sum the gates (``sums.prefix_sums``,
    the Gluon forward's ``prologue.forward_sums``) report what the gates hold."""
    from fox_kernel.ops.triton import prologue, sums

    device = _triton_device()
    g = torch.Generator().manual_seed(B * 1000 + T * 10 + H)
    lf = F.logsigmoid(torch.randn(B, T, H, generator=g) + 2.0)
    seq_start = None
    if where == "first position":
        lf[:, 0] = float("-inf")
    elif where == "one row" and T > 1:
        lf[B - 1, int(torch.randint(1, T, (1,), generator=g)), H - 1] = float("-inf")
    elif where in ("padding", "seq_start"):
        seq_start = torch.tensor([min(T - 1, 5 + 3 * b) for b in range(B)])
        for b in range(B):
            s = int(seq_start[b])
            lf[b, : s + (1 if where == "seq_start" else 0), b % H] = float("-inf")
    lf = lf.to(device)
    c, z, seen = sums.prefix_sums(lf, None if seq_start is None else seq_start.to(device), zeros=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    want = _expected_flag(lf, seq_start)
    assert seen.clean() == (not want), (where, seen.flag.item())
    if want:
        assert seen.flag.item() == -1
    else:  # no row has a gate of 0 that counts: z is 0 throughout (the passes would only read it and return)
        assert int(z.max()) == 0
    if seq_start is None:
        c2, z2, seen2, *_ = prologue.forward_sums(lf, True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(c2, c) and torch.equal(z2, z) and seen2.clean() == seen.clean()


def _reports_waited_for(monkeypatch):
    """From now on every ticket's report is in when the host asks: the GPU is waited for after each launch."""
    launch = zero_flags.ZeroGateTicket.launched

    def waited(self):
        launch(self)
        torch.cuda.synchronize()

    monkeypatch.setattr(zero_flags.ZeroGateTicket, "launched", waited)


def _upstream(q):
    return torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(q.device, q.dtype)


def _run(q, k, v, lf, do=None, **kw):
    """Output and gradients for the upstream gradient ``do`` (made beforehand where the GPU is held busy: a
    copy from the host waits for the GPU)."""
    do = _upstream(q) if do is None else do
    ins = [x.clone().requires_grad_() for x in (q, k, v, lf)]
    out = forgetting_attention(*ins, **kw)
    return (out.detach(), *torch.autograd.grad(out, ins, do))


def _inputs(B, T, H, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g).to("cuda", dtype) for _ in range(3))
    lf = F.logsigmoid(torch.randn(B, T, H, generator=g) + 3.0).cuda()
    return q, k, v, lf


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("D, kw", [(64, {}), (128, {}), (64, {"adaptive_threshold": "auto"}),
                                   (128, {"adaptive_threshold": "auto"}),
                                   (64, {"options": KernelOptions(gluon=False)})],
                         ids=["d64", "d128", "d64-auto", "d128-auto", "d64-triton"])
def test_cuda_passes_are_skipped_only_on_a_clean_report_and_skipping_changes_nothing(monkeypatch, zero_gate_passes,
                                                                                      D, kw):
    """bf16, gates without a 0, the Gluon kernels and the Triton ones. With the GPU held busy
    (``torch.cuda._sleep``) the report cannot be in when the passes are due: both launch. (A call whose
    checks read a tensor on the host, ``seq_start`` say, waits for the GPU there, and then its report is
    in.) With the report waited for (the ticket synchronises after its launch): neither launches. Both
    give the output and gradients of ``zero_gates=False`` bit for bit. A gate of 0 placed later is
    reported, both passes launch, and the result is the reference's."""
    q, k, v, lf = _inputs(2, 300, 4, D, torch.bfloat16, seed=D)
    promised = _run(q, k, v, lf, zero_gates=False, **kw)
    with_zero = lf.clone()
    with_zero[1, 200, 2] = float("-inf")
    _run(q, k, v, with_zero, **kw)  # every kernel compiled before the GPU is held busy
    launched = zero_gate_passes
    launched.clear()  # the call above launched both passes; count from here
    do = _upstream(q)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # ~0.25 s of GPU time queued ahead of the call
    busy = _run(q, k, v, lf, do, **kw)
    assert launched == ["forward_zero_gates", "backward_zero_gates"]
    launched.clear()
    _reports_waited_for(monkeypatch)
    idle = _run(q, k, v, lf, **kw)
    assert launched == []
    for name, a, b, c in zip(("out", "dq", "dk", "dv", "dlog_fgate"), promised, busy, idle):
        assert torch.equal(a, b) and torch.equal(a, c), name
    zero = _run(q, k, v, with_zero, **kw)
    assert launched == ["forward_zero_gates", "backward_zero_gates"]
    want = forgetting_attention_ref(q.double(), k.double(), v.double(), with_zero.double())
    err = (zero[0].double() - want).abs()
    assert err[1, 200:, 2].max() < 0.05 and err.max() < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_a_captured_graph_keeps_the_passes_for_gates_it_has_not_seen():
    """A forward captured in a CUDA graph on gates without a 0 still holds the zero-gate pass (no report
    can come back during a capture), so a replay on gates with a 0 gives the eager call's output."""
    q, k, v, lf = _inputs(1, 256, 2, 64, torch.bfloat16, seed=5)
    with_zero = lf.clone()
    with_zero[0, 100, 1] = float("-inf")
    with torch.no_grad():
        forgetting_attention(q, k, v, with_zero)  # every kernel compiled outside the capture
        forgetting_attention(q, k, v, lf)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forgetting_attention(q, k, v, lf)
        lf.copy_(with_zero)
        graph.replay()
        torch.cuda.synchronize()
        eager = forgetting_attention(q, k, v, lf)
    assert torch.equal(out, eager)
    want = forgetting_attention_ref(q.double(), k.double(), v.double(), lf.double())
    assert (out.double() - want).abs().max() < 0.05


def test_with_the_reports_off_no_ticket_is_clean(monkeypatch):
    """``FOX_KERNEL_ZERO_REPORTS=0`` (``zero_flags.USED`` False): every pass launches."""
    monkeypatch.setattr(zero_flags, "USED", False)
    ticket = zero_flags.ticket(torch.device("cpu"))
    assert not ticket.clean() and ticket.flag.numel() == 1


def test_a_forward_reported_clean_keeps_neither_z_nor_its_ticket(monkeypatch):
    """The forward's prefix sums for the backward: on gates reported free of 0 only ``c`` (the backward then
    launches no zero-gate pass and the saved tensors lose z); with a gate of 0, z and its ticket too."""
    from fox_kernel.ops import dispatch
    from fox_kernel.ops.call import AttentionCall
    from fox_kernel.options import KernelOptions

    device = _triton_device()
    if device.type == "cuda":
        _reports_waited_for(monkeypatch)
    g = torch.Generator().manual_seed(11)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(2, 45, 3, 16, generator=g).to(device, dtype) for _ in range(3))
    lf = F.logsigmoid(torch.randn(2, 45, 3, generator=g) + 2.0).to(device)
    call = AttentionCall(0.25, options=KernelOptions(), zero_gates=True)
    c, z, seen = dispatch.forward_keeping_sums(q, k, v, lf, call)[3]
    assert c is not None and z is None and seen is None
    lf[1, 30, 2] = float("-inf")
    c, z, seen = dispatch.forward_keeping_sums(q, k, v, lf, call)[3]
    assert int(z.max()) == 30 and not seen.clean()
