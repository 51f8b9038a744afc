"""Adaptive computation pruning (ACP): the bound every pruned call uses.

If every logit satisfies ``|s q_i.k_j| <= U``, the keys with ``c_i - c_j < delta`` receive at most ``eps`` of
a query's attention weight when

    delta = -(2U + ln Tk) + ln eps        (``bound``)

``ln eps`` is the ``log_pruning_tolerance`` (the paper's, and ``adaptive_threshold="auto"``'s: -10). ``U``
comes from

* the q/k norms, ``U = max|q| max|k| |s|`` per (row or packed sequence, head): ``pruning_threshold``,
  ``auto_threshold`` (one Triton read of q and k), and per query tile inside the Triton forward
  (``tile_threshold``, the tile's own query norms: at least as tight);
* the QK-norm weights, ``U = sqrt(D) max|w_q| max|w_k|`` per head (RMS-normalised q and k, ``s = D^-0.5``):
  ``threshold_from_qk_norm``.

Pass ``adaptive_threshold=AutoThreshold(log_pruning_tolerance)`` (or ``"auto"``) to bound by the q/k norms
with any ``eps``, or a threshold tensor built here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch
import triton
import triton.language as tl

from fox_kernel.ops.triton import launch
from fox_kernel.ops.triton.norms import max_sq_row_norms

DEFAULT_LOG_TOLERANCE = -10.0
"""ln eps of the paper and of ``adaptive_threshold="auto"``."""


def check_log_tolerance(value) -> None:
    """ln eps must be a finite negative number (eps < 1); 0 or more would let pruning drop all the weight."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value >= 0:
        raise ValueError(f"log_pruning_tolerance must be a finite negative number (ln eps), got {value!r}")


@dataclasses.dataclass(frozen=True)
class AutoThreshold:
    """``adaptive_threshold`` bounding the logits by the q/k norms, with ``eps = e^log_pruning_tolerance``
    (``"auto"`` is ``AutoThreshold()``)."""

    log_pruning_tolerance: float = DEFAULT_LOG_TOLERANCE

    def __post_init__(self):
        check_log_tolerance(self.log_pruning_tolerance)


def bound(u, t_k: int, log_pruning_tolerance: float = DEFAULT_LOG_TOLERANCE):
    """delta = -(2U + ln Tk) + ln eps, for a logit bound ``u`` (a number or a tensor)."""
    return -(2 * u + math.log(max(t_k, 1))) + log_pruning_tolerance


def threshold_from_norms(q_max, k_max, sm_scale, t_k, log_pruning_tolerance=DEFAULT_LOG_TOLERANCE):
    """The bound from the largest q and k norms (float32 for float32 or lower inputs, U = q_max k_max |s|)."""
    u = q_max.float() * k_max.float() * abs(sm_scale)  # bounds |score|: the sign of the scale does not matter
    return bound(u, t_k, log_pruning_tolerance)


def threshold_from_qk_norm(q_weight_max, k_weight_max, head_dim, t_k, log_pruning_tolerance=DEFAULT_LOG_TOLERANCE):
    """(1, H): the bound of a layer with QK-norm and the default scale, from ``max|w|`` of the q and k norm
    weights per query head (H,): ``|s q.k| <= s ||q|| ||k|| <= sqrt(D) max|w_q| max|w_k|``."""
    u = math.sqrt(head_dim) * q_weight_max * k_weight_max
    return bound(u, t_k, log_pruning_tolerance)[None]


def pruning_threshold(q, k, sm_scale, t_k, log_pruning_tolerance=DEFAULT_LOG_TOLERANCE, rows=None):
    """The bound from the q/k norms, per (row, head): (B or N, H) float32 (the norms of float64 inputs are
    taken in float64).

    q (B, Tq, H, D), k (B, Tk, Hkv, D); ``t_k`` the key length the bound counts (an int >= 1);
    rows: (N+1,) int32 cu_seqlens over q's packed length (B = 1) to bound each packed sequence alone.
    Bad arguments raise in one line naming them.
    """
    from fox_kernel.ops import checks  # here: fox_kernel.ops imports this module (through its dispatch)

    for name, x in (("q", q), ("k", k)):
        checks.require_tensor(name, x)
        checks.require_rank(name, x, 4, "(B, T, H, D)" if name == "q" else "(B, T, Hkv, D)")
        checks.require_float_dtype(name, x)
    checks.require_dim("k", k.shape[0], q.shape[0], "batch size (q's)")
    checks.require_dim("k", k.shape[3], q.shape[3], "head dim (q's)")
    checks.check_heads(q.shape[2], k.shape[2], q.shape[3], "k")
    checks.check_sm_scale(sm_scale)
    if isinstance(t_k, bool) or not isinstance(t_k, int) or t_k < 1:
        raise ValueError(f"t_k must be an int >= 1 (the key length), got {t_k!r}")
    check_log_tolerance(log_pruning_tolerance)
    if rows is not None:
        checks.check_cu_seqlens(rows, q.shape[0], q.shape[1], True)
    return _pruning_threshold(q, k, sm_scale, t_k, log_pruning_tolerance, rows)


def _pruning_threshold(q, k, sm_scale, t_k, log_pruning_tolerance, rows):
    """``pruning_threshold`` on arguments already checked (the kernels' calls)."""
    group = q.shape[2] // k.shape[2]
    if rows is None and q.is_cuda and k.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:
        # one read of q and k by a Triton reduction (torch's norm over a 64-128 wide axis is ~5x slower),
        # and the bound in a second launch: with torch ops in between it took ~200 us at T=16k on an H200
        return auto_threshold(q, k, sm_scale, t_k, log_pruning_tolerance)
    # Norms in float32 without materialising float32 copies of q and k.
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 inputs
    qn = torch.linalg.vector_norm(q, dim=-1, dtype=acc)  # (B, Tq, H)
    kn = torch.linalg.vector_norm(k, dim=-1, dtype=acc).repeat_interleave(group, dim=-1)
    if rows is None:
        return threshold_from_norms(qn.amax(dim=1), kn.amax(dim=1), sm_scale, t_k, log_pruning_tolerance).contiguous()
    bounds = rows.tolist()
    per_seq = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        per_seq.append(threshold_from_norms(qn[0, s:e].amax(dim=0), kn[0, s:e].amax(dim=0), sm_scale, e - s,
                                            log_pruning_tolerance))
    return torch.stack(per_seq).contiguous()


@triton.jit
def tile_threshold(u, t_k, LOG_TOLERANCE: tl.constexpr):
    """``bound`` inside a kernel, ``u`` a logit bound in natural units (a query tile's)."""
    return LOG_TOLERANCE - tl.log(tl.maximum(t_k, 1).to(tl.float32)) - 2.0 * u


@triton.jit
def head_bound(qn2, kn2, sm_scale, offset):
    """``bound`` inside a kernel from a query head's and its key head's largest squared norms: -2U + offset,
    U = |q|max |k|max |s| (``offset`` = ln eps - ln Tk)."""
    return -2.0 * tl.sqrt(qn2 * kn2) * tl.abs(sm_scale) + offset


@triton.jit
def _head_threshold_kernel(QN2, KN2, OUT, H, HKV, GROUP, sm_scale, offset, BLOCK_H: tl.constexpr):
    """OUT[b, h] = ``head_bound`` of the squared maxima QN2 (B, H) and KN2 (B, HKV) of max_sq_row_norms(q, k)."""
    b = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    mask = h < H
    qn2 = tl.load(QN2 + b * H + h, mask=mask, other=0.0)
    kn2 = tl.load(KN2 + b * HKV + h // GROUP, mask=mask, other=0.0)
    tl.store(OUT + b * H + h, head_bound(qn2, kn2, sm_scale, offset), mask=mask)


def auto_threshold(q, k, sm_scale, t_k, log_pruning_tolerance=DEFAULT_LOG_TOLERANCE):
    """``pruning_threshold`` of CUDA (or interpreted) tensors without packed sequences: (B, H) float32 from
    one Triton read of q and k and one small launch."""
    return auto_threshold_and_key_norms(q, k, sm_scale, t_k, log_pruning_tolerance)[0]


def auto_threshold_and_key_norms(q, k, sm_scale, t_k, log_pruning_tolerance=DEFAULT_LOG_TOLERANCE):
    """(``auto_threshold``, the largest squared key norm per (row, key head) (B, Hkv) float32): the key
    norms come from the same read of k, and equal ``norms.key_sq_norms(k, None)`` bit for bit (what the
    forward's fixed softmax bound takes)."""
    B, _, H, _ = q.shape
    qn2, kn2 = max_sq_row_norms(q, k)
    out = torch.empty(B, H, dtype=torch.float32, device=q.device)
    if B > 0:
        launch.run(_head_threshold_kernel, (B,), qn2, kn2, out, H, k.shape[2], H // k.shape[2], float(sm_scale),
                   float(bound(0.0, t_k, log_pruning_tolerance)), BLOCK_H=launch.next_power_of_2(H),
                   num_warps=1)
    return out, kn2
