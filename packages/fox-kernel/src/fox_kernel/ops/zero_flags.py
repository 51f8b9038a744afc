"""Whether a call's gates held a gate of exactly 0, learned from the GPU without waiting for it.

After every forward and backward whose caller allows gates of 0 (``AttentionCall.zero_gates``), passes
re-run what such gates change (``dispatch``). On gates without a 0 their programs read one number and return,
yet each launch costs the host what an attention launch does (the three of a forward+backward 50-190 us on an
H200 host, ``benchmarks/host_overhead.py --reports-ab``), and where a call's GPU work is short the host's time
is what the call takes. So the prefix-sums kernel, which finds the
zeros, also reports them, and a pass whose report has come back clean is not launched:

* Before the launch the host takes a ticket: a fresh number, written into a slot of a small buffer in pinned
  (page-locked, GPU-visible) host memory. Every program of the kernel that finds a gate of 0 in its row
  writes -1 over it (``sums.prefix_sums_row``), and a CUDA event recorded after the launch marks its end.
* When a pass is due, the host reads the event and the slot without synchronising. The event done and the
  slot still holding the ticket's number: no gate of 0, the pass is skipped. Anything else (the kernel not
  yet run, a 0 found, the slot since taken by a later call, which writes its own number first) launches the
  pass, which is always correct. Numbers are never reused, so a slot holds a ticket's number only if nothing
  overwrote it since that ticket wrote it.

So the passes are skipped when the GPU has caught up with the host, which is when a call waits on its host,
and launched as before when the host runs ahead of the GPU. While a CUDA graph is being captured no ticket
is taken (the capture runs no kernel, so every pass is captured); the kernel then writes into a slot no
ticket reads. On the CPU (the Triton interpreter) a kernel has run when its launch returns, and no event is
needed.
"""

from __future__ import annotations

import itertools
import os

import torch

from fox_kernel.options import parse_bool, read_env

USED = read_env(os.environ, "FOX_KERNEL_ZERO_REPORTS", parse_bool, "0 or 1", default=True)
"""Whether the host reads the reports (``FOX_KERNEL_ZERO_REPORTS``, read at import; set for benchmarks). Off,
every ticket stays unclean and every zero-gate pass launches; the kernel still writes its report."""
SLOTS = 1024
"""Slots per device: a call's slot is taken again 1024 calls later (its passes then simply launch)."""
_WORDS = 2  # int64 words per slot: 16-byte aligned slots, so every slot's pointer specialises alike
_NUMBERS = itertools.count(1)  # ticket numbers; the kernel writes -1, which no ticket holds


class _Ring:
    """A device's slots (one more than SLOTS: the last is written while a graph is captured, never read) and
    the events that mark their kernels' ends."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.words = torch.zeros((SLOTS + 1) * _WORDS, dtype=torch.int64, pin_memory=self.cuda)
        self.host = self.words.numpy()  # reads and writes of one word without torch's dispatch
        self.events: list[torch.cuda.Event | None] = [None] * SLOTS
        self.views: list[torch.Tensor | None] = [None] * (SLOTS + 1)  # each slot's one-word tensor, made once

    def view(self, slot: int) -> torch.Tensor:
        view = self.views[slot]
        if view is None:
            view = self.views[slot] = self.words[slot * _WORDS:][:1]
        return view


_RINGS: dict[tuple[str, int | None], _Ring] = {}


class ZeroGateTicket:
    """One call's report from the prefix-sums kernel (see the module's docstring). ``flag``: what the kernel
    takes, the slot's word, which its programs that find a gate of 0 set to -1."""

    __slots__ = ("_ring", "_slot", "_number", "_event", "flag")

    def __init__(self, ring: _Ring, number: int | None):
        self._ring, self._event = ring, None
        if number is None:  # taken while a graph is captured, or with the reports off: never clean
            self._slot = self._number = None
            self.flag = ring.view(SLOTS)
            return
        self._slot, self._number = number % SLOTS, number
        ring.host[self._slot * _WORDS] = number
        self.flag = ring.view(self._slot)

    def launched(self) -> None:
        """Marks the end of the kernel just launched on the current stream (call it after the launch)."""
        ring = self._ring
        if self._slot is not None and ring.cuda:
            event = ring.events[self._slot]
            if event is None:
                event = ring.events[self._slot] = torch.cuda.Event()
            event.record()
            self._event = event

    def clean(self) -> bool:
        """Whether the kernel has run and found no gate of 0 (False whenever that is not known yet)."""
        if self._slot is None or (self._event is not None and not self._event.query()):
            return False
        return int(self._ring.host[self._slot * _WORDS]) == self._number


def ticket(device: torch.device) -> ZeroGateTicket:
    """A fresh ticket for a prefix-sums launch on ``device`` (CUDA, or the CPU in the interpreter)."""
    cuda = device.type == "cuda"
    key = (device.type, (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None)
    ring = _RINGS.get(key)
    if ring is None:
        ring = _RINGS[key] = _Ring(device)
    if not USED or (cuda and torch.cuda.is_current_stream_capturing()):
        return ZeroGateTicket(ring, None)
    return ZeroGateTicket(ring, next(_NUMBERS))
