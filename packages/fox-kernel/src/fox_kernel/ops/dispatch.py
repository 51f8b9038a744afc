"""Which code runs a call: the PyTorch path, the Triton kernels or the Gluon kernels, and which backward.

* The device path (``runs_triton``): CUDA tensors run the GPU kernels; CPU tensors the chunked PyTorch
  twin (``chunked.py``), or the Triton kernels through the interpreter when ``TRITON_INTERPRET=1``
  (float32; float64 always takes the PyTorch path). ``KernelOptions.torch_path`` sends any call to the
  PyTorch twin.
* The backend of a GPU call (``forward_backend``, ``backward_plan``): the Gluon kernels where they apply
  (``KernelOptions.gluon``, sm90, 16-bit, head dim 64 or 128, fixed-length batches without ``seq_start``,
  with or without a sliding window, Triton 3.6 or newer with Gluon), else the Triton kernels. A Gluon
  kernel that fails to compile (a Triton whose Gluon has moved on) hands the process over to the Triton
  kernels (``_run_gluon``).
* The backward mode: two passes (dK/dV, then dQ; bit-reproducible) or one pass adding dQ in with atomics
  (``KernelOptions.backward="fused"``, never under ``torch.use_deterministic_algorithms``).
* Gates of exactly 0 (log -inf). Such a gate at z hides the keys before z from the queries from z on. The
  prefix sums count it as 0, so every backend runs on finite ``c`` whose differences are exact wherever
  no such gate lies between query and key, and record per position the last such gate at or before it
  (``z``, ``sums.prefix_sums(..., zeros=True)``). After the backend's forward and backward, Triton passes
  re-run, exactly, what a gate of 0 changes: the query tiles with one at or before a row, and the key
  blocks some later query hides keys of (``fwd.forward_zero_gates``, ``bwd.backward_zero_gates``), each
  query masking the keys before its last gate of 0 as a window masks those before its edge. Reading the
  gates on the host would wait for the GPU; instead such a pass is launched unless the prefix-sums kernel
  has already reported, without a synchronisation, that there was no gate of 0 (``zero_flags``: so the
  passes are skipped where the GPU keeps up with the host), and on gates without a 0 each program of a
  launched pass reads one number of ``z`` and returns (``benchmarks/bench_zero_gates.py``). A call whose
  caller promises no gate of 0 (``AttentionCall.zero_gates`` False) sums the gates without ``z`` and
  launches none of these passes (three launches fewer a forward and backward).

Every function here takes the call's description (``call.AttentionCall``) as one object and passes it on.

The backend modules are imported on first use, so ``import fox_kernel`` loads no kernel (and no Gluon).
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from fox_kernel.ops import zero_flags
from fox_kernel.ops.call import AttentionCall
from fox_kernel.ops.chunked import chunked_backward, chunked_forward
from fox_kernel.ops.gluon.tiles import GLUON_FWD_MAX_KEYS, GLUON_ONE_PASS_DIMS, GLUON_TILES
from fox_kernel.ops.triton.launch import sm_major
from fox_kernel.options import INTERPRET, KernelOptions
from fox_kernel.pruning import _pruning_threshold, bound


class Backend(enum.Enum):
    TORCH = "torch"
    """The chunked PyTorch twin (CPU)."""
    TRITON = "triton"
    GLUON = "gluon"
    """Hopper only, warp-specialised."""


def runs_triton(x: torch.Tensor) -> bool:
    """Whether ``x``'s call runs Triton kernels: on CUDA, or in the interpreter (not for float64)."""
    return x.is_cuda or (INTERPRET and x.dtype != torch.float64)


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The forward's log-sum-exp: float32, float64 for float64 q (the PyTorch path, whose backward then keeps
    float64 accuracy)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _gluon_applies(q, call: AttentionCall) -> bool:
    if not call.options.gluon or INTERPRET or not q.is_cuda or sm_major(q.device) != 9:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] not in GLUON_TILES:
        return False
    if call.seq_start is not None or call.varlen:
        return False
    from fox_kernel.ops import gluon

    return gluon.available()


def fixed_bound_softmax(dtype: torch.dtype, options: KernelOptions) -> bool:
    """Whether the forward may run a query tile's softmax against a fixed bound (``triton/fwd.py``). Not for
    float16: its probabilities, as small as 2^-FIXED_BOUND_GAP, would leave float16's range (bfloat16 and
    float32 share float32's exponent)."""
    return dtype != torch.float16 and options.fixed_bound


def forward_backend(q, k, call: AttentionCall) -> Backend:
    """The forward's backend. The Gluon forward runs at every length with the fixed softmax bound, pruned
    or not; with the online softmax (float16, or the bound off) only up to GLUON_FWD_MAX_KEYS keys (the
    Triton forward's fixed bound is faster on long sequences at D=64). A pruned Gluon forward takes the
    per-head "auto" bound where the Triton forward takes each query tile's own. On an H100 at D=64 (CUDA
    graphs, benchmarks/forward_route_ab.py, forward-route-d64-h100-2026-11-28.txt) the Gluon route was
    faster in every cell at T=16k (forward 3-16%, 9-13% with nothing to prune), level or faster at 2 x 8k and
    within 1.2% at 4 x 4k, fast gates included; one forward for pruned and exact calls keeps pruning's cost
    small where nothing is pruned."""
    if not runs_triton(q) or call.options.torch_path:
        return Backend.TORCH
    if not _gluon_applies(q, call):
        return Backend.TRITON
    limit = GLUON_FWD_MAX_KEYS[q.shape[-1]]
    any_length = fixed_bound_softmax(q.dtype, call.options)
    return Backend.GLUON if any_length or limit is None or k.shape[1] <= limit else Backend.TRITON


def one_pass_backward(options: KernelOptions) -> bool:
    """Whether the backward may run as one pass (see ``KernelOptions.backward``). Two passes are the default:
    on an H200 (Triton 3.6, T=16k, H*D=2048, bf16) the Triton one pass, best of seven tiles, took 12.35 ms
    vs 11.78 ms at D=64 (10.65 ms since the dQ pass's 64x64 tiles) and 11.9 ms vs 7.9 ms at D=128
    (fused-backward-tiles-h200-s9.json); the Gluon one pass (the dK/dV kernel adding dQ in with TMA
    reductions) on an H100 (results-h100-s15-quick.json, T=16k, D=64): 3.08 vs 2.88-2.91 ms at H=12,
    5.94-5.99 vs 5.81-5.86 ms at H=24, 2.53-2.56 vs 2.31 ms at T=8k with GQA 32/8."""
    return options.backward == "fused" and not torch.are_deterministic_algorithms_enabled()


def backward_plan(q, call: AttentionCall) -> tuple[Backend, bool]:
    """(backend, one pass) of the backward."""
    if not runs_triton(q) or call.options.torch_path:
        return Backend.TORCH, False
    if _gluon_applies(q, call):
        # the Gluon one pass holds float32 dQ tiles in shared memory: GLUON_ONE_PASS_DIMS only
        return Backend.GLUON, one_pass_backward(call.options) and q.shape[-1] in GLUON_ONE_PASS_DIMS
    return Backend.TRITON, one_pass_backward(call.options)


def _prefix_sums(log_fgate, call: AttentionCall):
    """(c, z, ticket) of the GPU kernels (``sums.prefix_sums``): z and the ticket None where the call promises
    no gate of 0."""
    from fox_kernel.ops.triton import sums

    if call.zero_gates:
        return sums.prefix_sums(log_fgate, call.seq_start, zeros=True)
    return sums.prefix_sums(log_fgate, call.seq_start), None, None


def _zero_passes_due(z, seen: zero_flags.ZeroGateTicket | None) -> bool:
    """Whether the passes for gates of exactly 0 must run: the call allows such gates and the prefix-sums
    kernel has not reported that there was none (``zero_flags``)."""
    return z is not None and not seen.clean()


def forward(q, k, v, log_fgate, call: AttentionCall):
    """(out, lse, threshold): ``call.threshold`` as given, or with ``call.auto_log_eps`` the (rows, H) "auto"
    bound the backward uses. Tensors in the kernel layout (see ``chunked.py``)."""
    return forward_keeping_sums(q, k, v, log_fgate, call)[:3]


def forward_keeping_sums(q, k, v, log_fgate, call: AttentionCall):
    """``forward``'s (out, lse, threshold) and the GPU kernels' prefix sums ``(c, z, ticket)`` (None on the
    PyTorch path), which ``backward`` takes instead of summing the gates again (one launch fewer; 12 bytes
    per row, head and position kept, 8 where the gates were reported free of 0: z and the ticket None)."""
    threshold = call.threshold
    if q.numel() == 0:  # no query row: nothing to launch (a grid of 0 programs is no valid launch)
        B, Tq, H, _ = q.shape
        if call.auto_log_eps is not None:
            threshold = torch.full((call.n_rows(B), H), bound(0.0, k.shape[1], call.auto_log_eps),
                                   dtype=torch.float32, device=q.device)
        return (q.new_zeros(q.shape), torch.full((B, H, Tq), float("inf"), dtype=lse_dtype(q), device=q.device),
                threshold, None)
    backend = forward_backend(q, k, call)
    if backend is Backend.TORCH:
        if call.auto_log_eps is not None:  # the chunked twin prunes by the resolved per-head bound
            threshold = _pruning_threshold(q, k, call.sm_scale, k.shape[1], call.auto_log_eps, call.cu_seqlens)
            call = dataclasses.replace(call, threshold=threshold, auto_log_eps=None)
        out, lse = chunked_forward(q, k, v, log_fgate, call)
        return out.contiguous(), lse, threshold, None
    from fox_kernel.ops.triton import fwd

    fixed = fixed_bound_softmax(q.dtype, call.options)
    # the Gluon forward's prefix sums come from one launch with the norms it reads
    gluon_out = _run_gluon("forward", q, k, v, log_fgate, call, fixed) if backend is Backend.GLUON else None
    if gluon_out is not None:
        out, lse, threshold, (c, z, seen) = gluon_out
    else:  # the Triton kernels (also where a Gluon kernel failed to compile)
        c, z, seen = _prefix_sums(log_fgate, call)
        out, lse, threshold = fwd.forward(q, k, v, c, call, fixed)
    if _zero_passes_due(z, seen):
        fwd.forward_zero_gates(q, k, v, c, z, call, out, lse)
    elif z is not None:  # reported clean: the backward needs neither z nor its passes (nor to keep z)
        z = seen = None
    return out, lse, threshold, (c, z, seen)


def _run_gluon(name: str, *args):
    """``gluon.host.<name>(*args)``, or None where a Gluon kernel fails to compile with this Triton: the
    Gluon kernels are then given up for the process (one warning, ``gluon.give_up``) and the caller takes
    the Triton kernels. Only compile errors are caught; whatever a kernel launch raises otherwise is
    raised."""
    from triton.compiler.errors import CompilationError

    from fox_kernel.ops import gluon
    from fox_kernel.ops.gluon import host

    try:
        return getattr(host, name)(*args)
    except CompilationError as error:
        gluon.give_up(error)
        return None


def backward(do, q, k, v, log_fgate, out, lse, call: AttentionCall, prefix=None):
    """(dq, dk, dv, dlog_fgate). ``call``: the backward's (``call.threshold`` the forward's returned
    threshold, no "auto" tolerance). ``prefix``: the forward's prefix sums ``(c, z, ticket)``
    (``forward_keeping_sums``), else the gates are summed again."""
    if q.numel() == 0:  # no query row: no gradient flows to anything
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape), log_fgate.new_zeros(log_fgate.shape)
    backend, one_pass = backward_plan(q, call)
    if backend is Backend.TORCH:
        return chunked_backward(do, q, k, v, log_fgate, out, lse, call)
    from fox_kernel.ops.triton import bwd, sums

    if do.stride(-1) != 1:
        do = do.contiguous()
    c, z, seen = prefix if prefix is not None else _prefix_sums(log_fgate, call)
    # the Gluon backward's row dots come from one launch with its other small inputs
    gluon_out = _run_gluon("backward", do, q, k, v, c, lse, out, call, one_pass) if backend is Backend.GLUON else None
    if gluon_out is not None:
        grads, delta = gluon_out
    else:  # the Triton kernels (also where a Gluon kernel failed to compile)
        delta = sums.delta(out, do)
        grads = bwd.backward(do, q, k, v, c, lse, delta, call, one_pass)
    if _zero_passes_due(z, seen):
        bwd.backward_zero_gates(do, q, k, v, c, z, lse, delta, call, grads)
    dq, dk, dv, dc, dc_row = grads
    return dq, dk, dv, sums.gate_grad(dc, dc_row, call.seq_start, call.cu_seqlens)
