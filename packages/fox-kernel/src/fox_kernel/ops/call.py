"""``AttentionCall``: one frozen description of a Forgetting Attention call, passed down as one object.

The public entry points (``forgetting_attention``, ``forgetting_attention_with_kvcache``,
``context_parallel_forgetting_attention``) check their arguments, then build one ``AttentionCall`` on the
paths they run eagerly (under ``torch.compile``, and on decode's Triton path, the custom ops take the fields
as primitives and build it inside, so the compiler traces no object): the
sequence starts, packed lengths, score scale, pruning threshold (or the "auto" bound's tolerance), sliding
window and kernel options. ``dispatch.forward`` / ``backward`` and the host functions of every backend
(``triton/fwd.py``, ``triton/bwd.py``, ``gluon/host.py``, ``chunked.py``) take it in place of those
arguments one by one; the tensors of the call (q, k, v, gates, outputs, prefix sums) stay separate
arguments.

Adding an attention option (a per-head window, an attention sink, ...): add its field here (and, where
several places test it, a property), fill it in at the entry points, and read it in the kernels' host
functions that implement it. A torch.library custom op cannot take this object: its schema lists the
fields as primitives (``op_args`` and ``from_op_args`` convert, so the new field goes there too, into
the custom ops' schemas in ``forgetting_attention.py`` and into ``forgetting_attention``'s compiled call of
its forward op). Autograd keeps the call's tensors with
``save_for_backward`` and the rest on ``ctx`` (``saved`` and ``from_saved``).
"""

from __future__ import annotations

import dataclasses

import torch

from fox_kernel.options import KernelOptions


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionCall:
    """What a call computes besides its tensors q, k, v and the gates. Built once per call, after the
    argument checks; tensors in the kernel layout and on the inputs' device."""

    sm_scale: float
    """The score scale (``D ** -0.5`` by default), a finite positive number."""
    seq_start: torch.Tensor | None = None
    """(B,) int32: the first real token of each row (left padding), or None."""
    cu_seqlens: torch.Tensor | None = None
    """(N + 1,) int32 cumulative lengths of the sequences packed into batch row 0, or None."""
    threshold: torch.Tensor | None = None
    """(rows, H) float32 pruning threshold in log space (``n_rows``), or None. The backward's call holds the
    forward's resolved "auto" bound here."""
    auto_log_eps: float | None = None
    """ln eps of the "auto" pruning bound, which the forward takes from the q/k norms itself; None
    otherwise (always None in a backward's call)."""
    window: int = 0
    """The sliding window W (query i sees keys i - W < j <= i), 0 for none."""
    options: KernelOptions | None = None
    """The GPU kernels' switches, resolved (never "the current ones" later); None only where no kernel
    reads them (the decoding calls)."""
    zero_gates: bool = True
    """Whether the gates may hold gates of exactly 0 (log -inf), which the GPU kernels then handle exactly
    with extra passes (``dispatch.py``); False is the caller's promise that none does, and those passes are
    not launched."""

    @property
    def pruned(self) -> bool:
        """Whether blocks may be skipped by their decay (a threshold, or the "auto" bound)."""
        return self.threshold is not None or self.auto_log_eps is not None

    @property
    def has_window(self) -> bool:
        return self.window > 0

    @property
    def varlen(self) -> bool:
        """Packed sequences (``cu_seqlens``)."""
        return self.cu_seqlens is not None

    def n_rows(self, batch: int) -> int:
        """Rows of a per-row tensor such as the threshold: the batch, or the number of packed sequences."""
        return batch if self.cu_seqlens is None else self.cu_seqlens.shape[0] - 1

    def op_args(self, backward: bool = False) -> tuple:
        """The fields in the custom ops' schema order (``forgetting_attention.py``), the options as their
        ``KernelOptions.key``; the backward op's lack ``auto_log_eps``."""
        if backward:
            return (self.seq_start, self.cu_seqlens, self.sm_scale, self.threshold, self.window, self.options.key,
                    self.zero_gates)
        return (self.seq_start, self.cu_seqlens, self.sm_scale, self.threshold, self.auto_log_eps, self.window,
                self.options.key, self.zero_gates)

    @staticmethod
    def from_op_args(seq_start, cu_seqlens, sm_scale, threshold, auto_log_eps, window=0, options: str = "",
                     zero_gates: bool = True) -> AttentionCall:
        """The inverse of ``op_args`` (the forward op's; the backward op's with ``auto_log_eps`` None), inside
        a custom op; ``options`` "" gives ``current_options()``."""
        return AttentionCall(sm_scale, seq_start, cu_seqlens, threshold, auto_log_eps, window,
                             KernelOptions.from_key(options), zero_gates)

    def saved(self, threshold: torch.Tensor | None) -> tuple[tuple, tuple]:
        """(tensors, the rest) of the backward's call: the tensors for ``ctx.save_for_backward``, the rest to
        keep on ``ctx``; ``threshold`` is the backward's (the forward's resolved "auto" bound, or the call's
        own). ``from_saved`` rebuilds the call."""
        return (self.seq_start, self.cu_seqlens, threshold), (self.sm_scale, self.window, self.options, self.zero_gates)

    @staticmethod
    def from_saved(tensors, rest) -> AttentionCall:
        """The backward's call from what ``saved`` returned (no "auto" tolerance: its bound is the threshold)."""
        seq_start, cu_seqlens, threshold = tensors
        sm_scale, window, options, zero_gates = rest
        return AttentionCall(sm_scale, seq_start, cu_seqlens, threshold, None, window, options, zero_gates)
