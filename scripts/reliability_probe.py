"""Reliability probe (issue #49): feed bad inputs and faults to every package and classify what comes back.

    uv run --locked python scripts/reliability_probe.py [--quick] [--out probe.json] [--only GROUP ...]

Each case runs in a process of its own, forked from a server process that has imported the packages once
(so a crash or a hang of one case is recorded as such and the next case runs): a server for the PyTorch
paths and the command lines, and one started with ``TRITON_INTERPRET=1`` (set before Triton is imported)
that runs the Triton kernels through the interpreter on the CPU, float32 only. The command-line cases run
``fox_train.cli.main`` / ``fox_eval.cli.main`` in a further forked process, as the console scripts do, with
their own timeout; a few run the installed console scripts themselves.

Every case ends in one class:

* ``correct``: a result equal to an independent plain-PyTorch reference written here (float64, materialised
  attention), or a command that did what it was asked;
* ``one-line error``: an exception, or a command's error, whose message is one line naming the argument;
* ``traceback``: an error that is several lines or names no argument (or a valid input refused);
* ``silent-wrong``: a wrong result, a bad input accepted, or a refused run that left files behind;
* ``crash``: the process died of a signal;
* ``hang``: the case ran past its timeout and was killed.

An error counts as one line only if its message names the argument at fault (a word of its own: ``k`` in
"k must ...", not in "key"). It prints a table and the counts, and writes every result to ``--out`` as
JSON. About 6 minutes on two busy CPU cores (``--quick``: about 4, without the signal and resume runs, the
interpreted backward and lm-eval). docs/reliability.md has the counts of a run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

CLASSES = ("correct", "one-line error", "traceback", "silent-wrong", "crash", "hang")
# group -> the server that runs it ("torch": PyTorch paths and command lines; "interp": TRITON_INTERPRET=1)
GROUPS = {"kernel": "torch", "kernel-interp": "interp", "decode": "torch", "decode-interp": "interp",
          "layers": "torch", "models": "torch", "train": "torch", "eval": "torch"}
BIN = Path(sys.executable).parent


# ----------------------------------------------------------------------------------------------- registry


@dataclass
class Case:
    group: str
    name: str
    fn: object
    names: tuple[str, ...] = ()
    """An error counts as one line only if its message names one of these (the argument at fault)."""
    expect: str = "error"
    """error: a bad input (a returned value is silent-wrong unless it matches a reference); value: a valid
    input (an error is a refusal of it); either: an error or a value equal to the reference."""
    timeout: float = 60.0
    quick: bool = True

    @property
    def key(self) -> str:
        return f"{self.group}: {self.name}"


CASES: list[Case] = []


def case(groups, name, names=(), expect="error", timeout=60.0, quick=True):
    """Register ``fn`` as a case of each of ``groups`` (a kernel case runs on both paths)."""
    def register(fn):
        for g in (groups,) if isinstance(groups, str) else groups:
            CASES.append(Case(g, name, fn, tuple(names), expect, timeout, quick))
        return fn
    return register


# Results a case returns (computed in the case's process).

def result(cls: str, note: str = "") -> dict:
    return {"class": cls, "note": note}


def accepted(note: str = "accepted without an error") -> dict:
    return result("silent-wrong", note)


def close(actual, expected, atol: float = 1e-4, rtol: float = 1e-4, what: str = "") -> dict:
    """correct if ``actual`` matches ``expected`` (NaN where it is NaN), else silent-wrong with the error."""
    import torch

    actual = actual.detach().double().cpu()
    expected = expected.detach().double().cpu()
    if actual.shape != expected.shape:
        return result("silent-wrong", f"{what}shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    nan_a, nan_e = actual.isnan(), expected.isnan()
    if not torch.equal(nan_a, nan_e):
        return result("silent-wrong", f"{what}{int(nan_a.sum())} NaN where the reference has {int(nan_e.sum())}")
    a, e = actual[~nan_e], expected[~nan_e]
    err = (a - e).abs()
    bad = err > atol + rtol * e.abs()
    if bad.any():
        return result("silent-wrong", f"{what}max abs error {float(err.max()):.3g} ({int(bad.sum())} of {e.numel()} "
                                      f"values out of tolerance)")
    worst = float(err.max()) if err.numel() else 0.0
    return result("correct", f"{what}max abs error {worst:.2g}" + (f", {int(nan_e.sum())} NaN as the reference"
                                                                  if nan_e.any() else ""))


def names_one(text: str, names) -> bool:
    """Whether ``text`` names one of ``names`` as a word of its own (``k`` in "k must ...", not in "key")."""
    import re

    return not names or any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", text) for n in names)


def combine(*results: dict) -> dict:
    """The worst of several results (silent-wrong before correct)."""
    rank = {c: i for i, c in enumerate(("correct", "one-line error", "traceback", "silent-wrong"))}
    worst = max(results, key=lambda r: rank[r["class"]])
    return result(worst["class"], "; ".join(r["note"] for r in results if r["note"]))


# ------------------------------------------------------------------------------------ plain references


def ref_attention(q, k, v, g, *, sm_scale=None, seq_start=None, window=None, cu_seqlens=None):
    """Forgetting Attention in float64 from the definition, o_i = sum_j softmax_j(s q_i.k_j + sum_{j<t<=i} g_t) v_j,
    the decay summed gate by gate (no prefix sums, so a gate of -inf hides the keys before it exactly).
    (B, Tq, H, D) queries end-aligned with (B, Tk, Hkv, D) keys; padded query rows give 0."""
    import torch

    if cu_seqlens is not None:
        b = [int(x) for x in cu_seqlens]
        return torch.cat([ref_attention(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], sm_scale=sm_scale,
                                        window=window) for s, e in zip(b[:-1], b[1:])], dim=1)
    q, k, v, g = (x.detach().double().cpu() for x in (q, k, v, g))
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    k, v = (x.repeat_interleave(H // Hkv, dim=2) for x in (k, v))
    scale = D**-0.5 if sm_scale is None else sm_scale
    pos_k = torch.arange(Tk)
    pos_q = torch.arange(Tq) + (Tk - Tq)
    if seq_start is not None:
        g = torch.where((pos_k[None, :] >= seq_start.cpu()[:, None])[..., None], g, torch.zeros_like(g))
    between = (pos_k[None, None, :] > pos_k[None, :, None]) & (pos_k[None, None, :] <= pos_q[:, None, None])
    gt = g.permute(0, 2, 1)[:, :, None, None, :]  # (B, H, 1, 1, Tk)
    decay = torch.where(between, gt, torch.zeros((), dtype=torch.float64)).sum(-1)  # (B, H, Tq, Tk)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale + decay
    allowed = (pos_k[None, :] <= pos_q[:, None])[None].expand(B, Tq, Tk)
    if window is not None:
        allowed = allowed & (pos_k[None, :] > pos_q[:, None] - window)[None]
    if seq_start is not None:
        allowed = allowed & (pos_k[None, None, :] >= seq_start.cpu()[:, None, None])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).masked_fill(~allowed.any(-1)[:, None, :, None], 0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def attention_inputs(B=2, Tq=40, Tk=40, H=4, Hkv=2, D=16, seed=0, dtype=None):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    q = torch.randn(B, Tq, H, D, generator=gen).to(dtype)
    k = torch.randn(B, Tk, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, Tk, Hkv, D, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, Tk, H, generator=gen) + 2.0)
    return q, k, v, g


def _fa(*args, **kwargs):
    from fox_kernel import forgetting_attention

    return forgetting_attention(*args, **kwargs)


# -------------------------------------------------------------------------------- kernel: forgetting_attention

KERNEL = ("kernel", "kernel-interp")


@case(KERNEL, "valid call (B=2, T=40, GQA 4/2, D=16)", expect="value")
def _():
    q, k, v, g = attention_inputs()
    return close(_fa(q, k, v, g), ref_attention(q, k, v, g))


@case(KERNEL, "valid: fewer queries than keys (Tq=7, Tk=40)", expect="value")
def _():
    q, k, v, g = attention_inputs(Tq=7)
    return close(_fa(q, k, v, g), ref_attention(q, k, v, g))


@case(KERNEL, "valid: gates of exactly 0 (log -inf) inside the rows", expect="value")
def _():
    q, k, v, g = attention_inputs()
    g[0, 5, 1] = g[1, 23, :] = g[0, 39, 0] = float("-inf")
    return close(_fa(q, k, v, g), ref_attention(q, k, v, g))


@case(KERNEL, "valid: left padding (seq_start 0 and 13)", expect="value")
def _():
    import torch

    q, k, v, g = attention_inputs()
    s = torch.tensor([0, 13])
    return close(_fa(q, k, v, g, seq_start=s), ref_attention(q, k, v, g, seq_start=s))


@case(KERNEL, "valid: packed sequences (cu_seqlens 0, 9, 31, 40)", expect="value")
def _():
    import torch

    q, k, v, g = attention_inputs(B=1)
    cu = torch.tensor([0, 9, 31, 40], dtype=torch.int32)
    return close(_fa(q, k, v, g, cu_seqlens=cu), ref_attention(q, k, v, g, cu_seqlens=cu))


@case(KERNEL, "valid: sliding window 5", expect="value")
def _():
    q, k, v, g = attention_inputs()
    return close(_fa(q, k, v, g, window_size=5), ref_attention(q, k, v, g, window=5))


@case(KERNEL, "valid: window 1000 (longer than T)", expect="value")
def _():
    q, k, v, g = attention_inputs()
    return close(_fa(q, k, v, g, window_size=1000), ref_attention(q, k, v, g))


@case(KERNEL, "valid: non-contiguous q (a transposed view)", expect="value")
def _():
    q, k, v, g = attention_inputs()
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    return close(_fa(qt, k, v, g), ref_attention(q, k, v, g))


@case(KERNEL, "valid: head_first layout", expect="value")
def _():
    q, k, v, g = attention_inputs()
    out = _fa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2), head_first=True)
    return close(out.transpose(1, 2), ref_attention(q, k, v, g))


@case(KERNEL, "valid: MQA (H=4, Hkv=1)", expect="value")
def _():
    q, k, v, g = attention_inputs(Hkv=1)
    return close(_fa(q, k, v, g), ref_attention(q, k, v, g))


@case(KERNEL, "valid: 'auto' pruning (eps = e^-10)", expect="value")
def _():
    q, k, v, g = attention_inputs(Tq=64, Tk=64)
    g = g * 8  # fast decay, so pruning has tiles to skip
    return close(_fa(q, k, v, g, adaptive_threshold="auto"), ref_attention(q, k, v, g), atol=1e-3)


@case(KERNEL, "T=0 without pruning", names=("T", "length", "q"), expect="either")
def _():
    q, k, v, g = attention_inputs(Tq=0, Tk=0)
    out = _fa(q, k, v, g)
    return close(out, q.new_zeros(q.shape).double())


@case(KERNEL, "T=0 with 'auto' pruning", names=("T", "length", "q", "adaptive_threshold"), expect="either")
def _():
    q, k, v, g = attention_inputs(Tq=0, Tk=0)
    return close(_fa(q, k, v, g, adaptive_threshold="auto"), q.new_zeros(q.shape).double())


@case(KERNEL, "batch of 0 rows", names=("batch", "q"), expect="either")
def _():
    q, k, v, g = attention_inputs(B=0)
    return close(_fa(q, k, v, g), q.new_zeros(q.shape).double())


@case(KERNEL, "float64 q/k/v", names=("q",), expect="either")
def _():
    import torch

    q, k, v, g = attention_inputs(dtype=torch.float64)
    return close(_fa(q, k, v, g), ref_attention(q, k, v, g), atol=1e-10, rtol=1e-10)


@case(KERNEL, "float16 q/k/v on the CPU", names=("q",), expect="either")
def _():
    import torch

    q, k, v, g = attention_inputs(dtype=torch.float16)
    return close(_fa(q, k, v, g), ref_attention(q, k, v, g), atol=2e-2, rtol=2e-2)


@case(KERNEL, "backward: gradients of q, k, v and the gates", expect="value", quick=False, timeout=180)
def _():

    q, k, v, g = attention_inputs(B=1, Tq=24, Tk=24)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    _fa(*leaves).pow(2).sum().backward()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v, g)]
    ref_attention_grad(*ref).pow(2).sum().backward()
    return combine(*(close(a.grad, b.grad, atol=1e-3, what=f"d{n}: ") for a, b, n in zip(leaves, ref, "qkvg")))


def ref_attention_grad(q, k, v, g):
    """``ref_attention`` differentiable (same formula, no detach)."""
    import torch

    B, T, H, D = q.shape
    k, v = (x.repeat_interleave(H // k.shape[2], dim=2) for x in (k, v))
    pos = torch.arange(T)
    between = (pos[None, None, :] > pos[None, :, None]) & (pos[None, None, :] <= pos[:, None, None])
    decay = torch.where(between, g.permute(0, 2, 1)[:, :, None, None, :], torch.zeros((), dtype=g.dtype)).sum(-1)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * D**-0.5 + decay
    scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, -1), v)


@case(KERNEL, "NaN in one gate: NaN rows from there, never zeros", names=("log_fgate",), expect="either")
def _():
    q, k, v, g = attention_inputs()
    g[1, 17, 2] = float("nan")
    return close(_fa(q, k, v, g), ref_attention(q, k, v, g))


@case(KERNEL, "log gates of -1e4 (documented precision limit, checked to 1e-2)", names=("log_fgate",),
      expect="either")
def _():
    q, k, v, g = attention_inputs()
    g[:, 20] = -1e4
    return close(_fa(q, k, v, g), ref_attention(q, k, v, g), atol=1e-2)


@case(KERNEL, "sm_scale=1e-30 (tiny, positive)", names=("sm_scale",), expect="either")
def _():
    q, k, v, g = attention_inputs()
    return close(_fa(q, k, v, g, sm_scale=1e-30), ref_attention(q, k, v, g, sm_scale=1e-30))


@case(KERNEL, "sm_scale=1e4 (large, finite)", names=("sm_scale",), expect="either")
def _():
    q, k, v, g = attention_inputs()
    return close(_fa(q, k, v, g, sm_scale=1e4), ref_attention(q, k, v, g, sm_scale=1e4), atol=1e-3)


for _gate, _label in ((2.0, "+2 everywhere"), (1e-3, "+1e-3 at one position")):
    @case(KERNEL, f"positive log gate {_label}", names=("log_fgate",), expect="either")
    def _(gate=_gate):
        q, k, v, g = attention_inputs()
        if gate == 2.0:
            g.fill_(2.0)
        else:
            g[0, 11, 3] = gate
        return close(_fa(q, k, v, g), ref_attention(q, k, v, g), atol=1e-3)

for _kw, _label in ((dict(adaptive_threshold="auto"), "with 'auto' pruning"), (dict(window_size=6), "with a window"),
                    (dict(seq_start="pad"), "with left padding"), (dict(cu_seqlens="packed"), "with cu_seqlens")):
    @case(KERNEL, f"positive log gate +0.5 {_label}", names=("log_fgate",), expect="either")
    def _(kw=_kw):
        import torch

        q, k, v, g = attention_inputs(B=1 if "cu_seqlens" in kw else 2)
        g.fill_(0.5)
        kw = dict(kw)
        ref_kw = {}
        if "seq_start" in kw:
            kw["seq_start"] = ref_kw["seq_start"] = torch.tensor([0, 9])
        if "cu_seqlens" in kw:
            kw["cu_seqlens"] = ref_kw["cu_seqlens"] = torch.tensor([0, 15, 40], dtype=torch.int32)
        if "window_size" in kw:
            ref_kw["window"] = kw["window_size"]
        return close(_fa(q, k, v, g, **kw), ref_attention(q, k, v, g, **ref_kw), atol=1e-3)

for _scale in (float("inf"), -float("inf"), float("nan"), 0.0, -0.25, True, "0.25"):
    @case(KERNEL, f"sm_scale={_scale!r}", names=("sm_scale",))
    def _(scale=_scale):
        q, k, v, g = attention_inputs()
        out = _fa(q, k, v, g, sm_scale=scale)
        return accepted(f"returned {'NaN' if out.isnan().any() else 'finite'} values")


def _kernel_bad(name, names, mutate=None, kwargs=None, B=2):
    """A case: forgetting_attention on valid inputs of ``B`` rows, changed by ``mutate(torch, args)`` and called
    with ``kwargs(torch)``; a return is an accepted bad input."""
    def run():
        import torch

        q, k, v, g = attention_inputs(B=B)
        args = dict(q=q, k=k, v=v, log_fgate=g)
        if mutate is not None:
            mutate(torch, args)
        out = _fa(args["q"], args["k"], args["v"], args["log_fgate"], **(kwargs(torch) if kwargs else {}))
        return accepted(f"returned shape {tuple(out.shape)}")
    case(KERNEL, name, names=names)(run)


def _set(key, make):
    return lambda torch, a: a.__setitem__(key, make(torch, a))


_kernel_bad("q of int64", ("q",), _set("q", lambda t, a: a["q"].long()))
_kernel_bad("k of another dtype (float16)", ("k",), _set("k", lambda t, a: a["k"].half()))
_kernel_bad("log_fgate float64", ("log_fgate",), _set("log_fgate", lambda t, a: a["log_fgate"].double()))
_kernel_bad("log_fgate of the wrong shape (T-1)", ("log_fgate",),
            _set("log_fgate", lambda t, a: a["log_fgate"][:, 1:]))
_kernel_bad("q of rank 3", ("q",), _set("q", lambda t, a: a["q"][0]))
_kernel_bad("q a Python list", ("q",), _set("q", lambda t, a: a["q"].tolist()))
_kernel_bad("head dim 0", ("head dim", "q"), lambda t, a: a.update({x: a[x][..., :0] for x in ("q", "k", "v")}))
_kernel_bad("head dim 300", ("head dim",),
            lambda t, a: a.update({x: a[x].repeat(1, 1, 1, 19)[..., :300] for x in ("q", "k", "v")}))
_kernel_bad("3 query heads over 2 key heads", ("heads", "Hkv"), _set("q", lambda t, a: a["q"][:, :, :3]))
_kernel_bad("more queries than keys", ("Tq", "q"),
            lambda t, a: a.update(k=a["k"][:, :20], v=a["v"][:, :20], log_fgate=a["log_fgate"][:, :20]))
_kernel_bad("k on the meta device", ("k",), _set("k", lambda t, a: a["k"].to("meta")))
_kernel_bad("v shorter than k", ("v",), _set("v", lambda t, a: a["v"][:, :30]))
_kernel_bad("cu_seqlens a Python list", ("cu_seqlens",), None, lambda t: dict(cu_seqlens=[0, 20, 40]), B=1)
for _cu, _dtype, _label in (([0, 20, 40], "int64", "int64"), ([0, 25, 20, 40], "int32", "not increasing"),
                            ([0, 20, 39], "int32", "ending before T"), ([5, 20, 40], "int32", "not starting at 0"),
                            ([0], "int32", "of one entry")):
    _kernel_bad(f"cu_seqlens {_label} {_cu}", ("cu_seqlens",), None,
                lambda t, c=_cu, d=_dtype: dict(cu_seqlens=t.tensor(c, dtype=getattr(t, d))), B=1)
_kernel_bad("cu_seqlens with a batch of 2", ("cu_seqlens", "batch"), None,
            lambda t: dict(cu_seqlens=t.tensor([0, 20, 40], dtype=t.int32)))
for _start, _label in (([-1, 0], "-1"), ([0, 41], "past T"), ([0.5, 1.0], "float"), ([0, 1, 2], "of 3 rows")):
    _kernel_bad(f"seq_start {_label}", ("seq_start",), None, lambda t, s=_start: dict(seq_start=t.tensor(s)))
for _w in (0, -1, 2.5, True):
    _kernel_bad(f"window_size={_w!r}", ("window_size",), None, lambda t, w=_w: dict(window_size=w))
for _th, _label in ((1.0, "+1"), (float("nan"), "nan"), ("bad", "'bad'"), (float("-inf"), "-inf")):
    _kernel_bad(f"adaptive_threshold {_label}", ("adaptive_threshold",), None,
                lambda t, th=_th: dict(adaptive_threshold=th))
_kernel_bad("adaptive_threshold tensor of shape (5,)", ("adaptive_threshold",), None,
            lambda t: dict(adaptive_threshold=t.full((5,), -20.0)))
_kernel_bad("adaptive_threshold tensor holding +3", ("adaptive_threshold",), None,
            lambda t: dict(adaptive_threshold=t.tensor([[-20.0], [3.0]])))
_kernel_bad("options a string", ("options",), None, lambda t: dict(options="fast"))


def _cp(*args, **kwargs):
    """context_parallel_forgetting_attention in a process group of one rank (gloo, made on first use)."""
    import torch.distributed as dist

    from fox_kernel import context_parallel_forgetting_attention

    if not dist.is_initialized():
        store = tempfile.mkstemp(dir=os.environ.get("FOX_PROBE_WORK"), prefix="gloo-")[1]
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return context_parallel_forgetting_attention(*args, **kwargs)


@case(KERNEL, "context parallel (one rank): valid call", expect="value")
def _():
    q, k, v, g = attention_inputs()
    return close(_cp(q, k, v, g), ref_attention(q, k, v, g))


@case(KERNEL, "context parallel (one rank): positive log gate +0.5", names=("log_fgate",), expect="either")
def _():
    q, k, v, g = attention_inputs()
    g[:, 7:] = 0.5
    return close(_cp(q, k, v, g), ref_attention(q, k, v, g), atol=1e-3)


for _label, _names, _call in (
        ("sm_scale=inf", "sm_scale", lambda t, q, k, v, g: _cp(q, k, v, g, sm_scale=float("inf"))),
        ("q a Python list", "q", lambda t, q, k, v, g: _cp(q.tolist(), k, v, g)),
        ("k on the meta device", "k", lambda t, q, k, v, g: _cp(q, k.to("meta"), v, g)),
        ("options a string", "options", lambda t, q, k, v, g: _cp(q, k, v, g, options="fast")),
        ("int64 q", "q", lambda t, q, k, v, g: _cp(q.long(), k, v, g)),
        ("a shard of 0 tokens", "T", lambda t, q, k, v, g: _cp(q[:, :0], k[:, :0], v[:, :0], g[:, :0]))):
    @case(KERNEL, f"context parallel (one rank): {_label}", names=(_names,), expect="either" if "0 tokens" in _label
          else "error")
    def _(call=_call):
        import torch

        out = call(torch, *attention_inputs())
        if tuple(out.shape) == (2, 0, 4, 16):  # the empty shard's empty output
            return result("correct", "an empty output")
        return accepted(f"returned shape {tuple(out.shape)}")


# ------------------------------------------------------------------------------------ decode and paged caches

DECODE = ("decode", "decode-interp")
PAGE, POOL = 4, 12  # page size and pages in the pool of the paged cases (3 rows of up to 4 pages)


def decode_inputs(B=3, T=12, H=4, Hkv=2, D=16, Tq=1, seed=0, dtype=None):
    """(q, k, v, g) of a contiguous cache of T tokens per row; q holds the last Tq tokens' queries."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    k = torch.randn(B, T, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, T, Hkv, D, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0)
    q = torch.randn(B, Tq, H, D, generator=gen).to(dtype)
    return q, k, v, g


def ref_decode(q, k, v, g, lens=None, **kw):
    """Each row's Tq queries at the end of its first ``lens[b]`` tokens, through ``ref_attention``."""
    import torch

    lens = [k.shape[1]] * k.shape[0] if lens is None else [int(x) for x in lens]
    rows = []
    for b, L in enumerate(lens):
        start = None if kw.get("seq_start") is None else kw["seq_start"][b : b + 1]
        rows.append(ref_attention(q[b : b + 1], k[b : b + 1, :L], v[b : b + 1, :L], g[b : b + 1, :L],
                                  **{**kw, "seq_start": start}))
    return torch.cat(rows)


def _cache(k, v, g, seq_start=None):
    from fox_kernel import append_to_cache

    return append_to_cache(None, None, None, k, v, g, seq_start=seq_start)


def _decode(*args, **kwargs):
    from fox_kernel import forgetting_attention_with_kvcache

    return forgetting_attention_with_kvcache(*args, **kwargs)


def paged_inputs(lens=(12, 7, 3), seed=1):
    """A paged cache filled by hand (not by the append under test): (q, k, v, g, kc, vc, cc, table, lens)
    with rows of ``lens`` tokens on shuffled pages of a pool of POOL, 4 pages per row; the prefix sums are
    summed here in float64."""
    import torch

    q, k, v, g = decode_inputs(T=max(lens), seed=seed)
    B, T, Hkv, D = k.shape
    H = g.shape[2]
    table = torch.randperm(POOL, generator=torch.Generator().manual_seed(seed)).to(torch.int32).view(B, POOL // B)
    kc, vc = torch.zeros(POOL, PAGE, Hkv, D), torch.zeros(POOL, PAGE, Hkv, D)
    cc = torch.zeros(POOL, PAGE, H)
    c = torch.cumsum(g.double(), dim=1).float()
    for b in range(B):
        for p in range(lens[b]):
            page, slot = int(table[b, p // PAGE]), p % PAGE
            kc[page, slot], vc[page, slot], cc[page, slot] = k[b, p], v[b, p], c[b, p]
    return q, k, v, g, kc, vc, cc, table, torch.tensor(lens, dtype=torch.int32)


@case(DECODE, "valid: one new token over a contiguous cache", expect="value")
def _():
    q, k, v, g = decode_inputs()
    kc, vc, cc = _cache(k, v, g)
    return close(_decode(q, kc, vc, cc), ref_decode(q, k, v, g))


@case(DECODE, "valid: 3 new tokens, rows of 12, 7 and 3 (cache_seqlens)", expect="value")
def _():
    import torch

    q, k, v, g = decode_inputs(Tq=3)
    kc, vc, cc = _cache(k, v, g)
    lens = torch.tensor([12, 7, 3], dtype=torch.int32)
    return close(_decode(q, kc, vc, cc, lens), ref_decode(q, k, v, g, lens))


@case(DECODE, "valid: cache grown token by token equals one prefill", expect="value")
def _():
    from fox_kernel import append_to_cache

    q, k, v, g = decode_inputs()
    kc, vc, cc = _cache(k[:, :8], v[:, :8], g[:, :8])
    for t in range(8, 12):
        kc, vc, cc = append_to_cache(kc, vc, cc, k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1])
    return close(_decode(q, kc, vc, cc), ref_decode(q, k, v, g))


@case(DECODE, "valid: left padding (seq_start 0, 4, 0)", expect="value")
def _():
    import torch

    q, k, v, g = decode_inputs()
    s = torch.tensor([0, 4, 0])
    kc, vc, cc = _cache(k, v, g, seq_start=s)
    return close(_decode(q, kc, vc, cc, seq_start=s), ref_decode(q, k, v, g, seq_start=s))


@case(DECODE, "valid: sliding window 4", expect="value")
def _():
    q, k, v, g = decode_inputs(Tq=2)
    kc, vc, cc = _cache(k, v, g)
    return close(_decode(q, kc, vc, cc, window_size=4), ref_decode(q, k, v, g, window=4))


@case(DECODE, "valid: pruning threshold -30", expect="value")
def _():
    q, k, v, g = decode_inputs()
    kc, vc, cc = _cache(k, v, g)
    return close(_decode(q, kc, vc, cc, adaptive_threshold=-30.0), ref_decode(q, k, v, g), atol=1e-3)


@case(DECODE, "float64 q and caches (prefix sums at float32 accuracy, documented)", names=("q",), expect="either")
def _():
    import torch

    q, k, v, g = decode_inputs(dtype=torch.float64)
    kc, vc, cc = _cache(k, v, g)
    return close(_decode(q, kc, vc, cc), ref_decode(q, k, v, g), atol=1e-6, rtol=1e-6)


@case(DECODE, "valid: paged cache (pages shuffled in the pool)", expect="value")
def _():
    q, k, v, g, kc, vc, cc, table, lens = paged_inputs()
    return close(_decode(q, kc, vc, cc, lens, block_table=table), ref_decode(q, k, v, g, lens))


@case(DECODE, "valid: paged, table entries past a row's length hold 99 and -1 (never read)", expect="value")
def _():
    q, k, v, g, kc, vc, cc, table, lens = paged_inputs()
    table[1, 2], table[2, 1], table[2, 3] = 99, -1, 2**30
    return close(_decode(q, kc, vc, cc, lens, block_table=table), ref_decode(q, k, v, g, lens))


@case(DECODE, "valid: append_to_paged_cache token by token, then decode", expect="value")
def _():
    import torch

    from fox_kernel import append_to_paged_cache

    q, k, v, g, _, _, _, table, lens = paged_inputs()
    H, Hkv, D = g.shape[2], k.shape[2], k.shape[3]
    kc, vc, cc = torch.zeros(POOL, PAGE, Hkv, D), torch.zeros(POOL, PAGE, Hkv, D), torch.zeros(POOL, PAGE, H)
    seqlens = torch.zeros(3, dtype=torch.int32)
    for t in range(4):  # each row's first 4 tokens, one at a time
        seqlens = append_to_paged_cache(kc, vc, cc, table, seqlens, k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1])
    full = torch.full((3,), 4, dtype=torch.int32)
    return close(_decode(q, kc, vc, cc, full, block_table=table), ref_decode(q, k, v, g, full))


@case(DECODE, "valid: fill_empty_cache into a preallocated cache", expect="value")
def _():
    import torch

    from fox_kernel import fill_empty_cache

    q, k, v, g = decode_inputs()
    kc, vc, cc = torch.zeros(3, 16, *k.shape[2:]), torch.zeros(3, 16, *v.shape[2:]), torch.zeros(3, 16, g.shape[2])
    lens = fill_empty_cache(kc, vc, cc, k, v, g)
    return close(_decode(q, kc, vc, cc, lens), ref_decode(q, k, v, g))


def _decode_bad(name, names, call):
    """A case: ``call(torch, q, k, v, g, kc, vc, cc)`` on a valid contiguous cache; a return is accepted."""
    def run():
        import torch

        q, k, v, g = decode_inputs()
        kc, vc, cc = _cache(k, v, g)
        out = call(torch, q, k, v, g, kc, vc, cc)
        return accepted(f"returned {type(out).__name__}" + (f" of dtype {out.dtype}" if hasattr(out, "dtype") else ""))
    case(DECODE, name, names=names)(run)


def _append(*args, **kwargs):
    from fox_kernel import append_to_cache

    return append_to_cache(*args, **kwargs)


_decode_bad("append_to_cache: 2 new keys, 1 new gate", ("log_fgate_new",),
            lambda t, q, k, v, g, kc, vc, cc: _append(kc, vc, cc, k[:, :2], v[:, :2], g[:, :1]))
_decode_bad("append_to_cache: 2 new keys, 1 new value", ("v_new",),
            lambda t, q, k, v, g, kc, vc, cc: _append(kc, vc, cc, k[:, :2], v[:, :1], g[:, :2]))
_decode_bad("append_to_cache: a positive new log gate", ("log_fgate_new",),
            lambda t, q, k, v, g, kc, vc, cc: _append(kc, vc, cc, k[:, :1], v[:, :1], g[:, :1].abs() + 0.1))
_decode_bad("append_to_cache: a new gate of exactly 0 (-inf)", ("log_fgate_new",),
            lambda t, q, k, v, g, kc, vc, cc: _append(kc, vc, cc, k[:, :1], v[:, :1], g[:, :1] - float("inf")))
_decode_bad("append_to_cache: int32 k_cache", ("k_cache",),
            lambda t, q, k, v, g, kc, vc, cc: _append(kc.int(), vc, cc, k[:, :1], v[:, :1], g[:, :1]))
_decode_bad("append_to_cache: cache of another batch", ("k_cache", "batch"),
            lambda t, q, k, v, g, kc, vc, cc: _append(kc[:2], vc[:2], cc[:2], k[:, :1], v[:, :1], g[:, :1]))
_decode_bad("append_to_cache: float64 gates", ("log_fgate_new",),
            lambda t, q, k, v, g, kc, vc, cc: _append(kc, vc, cc, k[:, :1], v[:, :1], g[:, :1].double()))
_decode_bad("decode: int64 q", ("q",), lambda t, q, k, v, g, kc, vc, cc: _decode(q.long(), kc, vc, cc))
_decode_bad("decode: int32 K/V caches", ("k_cache",), lambda t, q, k, v, g, kc, vc, cc: _decode(q, kc.int(), vc.int(), cc))
_decode_bad("decode: float64 c_cache", ("c_cache",), lambda t, q, k, v, g, kc, vc, cc: _decode(q, kc, vc, cc.double()))
_decode_bad("decode: c_cache with 3 heads for 4", ("c_cache",),
            lambda t, q, k, v, g, kc, vc, cc: _decode(q, kc, vc, cc[..., :3]))
_decode_bad("decode: q of another batch than the cache", ("k_cache", "batch"),
            lambda t, q, k, v, g, kc, vc, cc: _decode(q[:2], kc, vc, cc))
_decode_bad("decode: 13 queries over a cache of 12", ("q",),
            lambda t, q, k, v, g, kc, vc, cc: _decode(t.randn(3, 13, 4, 16), kc, vc, cc))
for _scale in (float("inf"), float("nan"), 0.0, -1.0):
    _decode_bad(f"decode: sm_scale={_scale!r}", ("sm_scale",),
                lambda t, q, k, v, g, kc, vc, cc, s=_scale: _decode(q, kc, vc, cc, sm_scale=s))
for _lens, _dtype, _label in (([12, 0, 3], "int32", "a row of 0"), ([12, 13, 3], "int32", "past the cache"),
                              ([12, -1, 3], "int32", "negative"), ([12, 7, 3], "int64", "int64"),
                              ([12, 7], "int32", "of 2 rows for 3")):
    _decode_bad(f"decode: cache_seqlens {_label}", ("cache_seqlens",),
                lambda t, q, k, v, g, kc, vc, cc, ls=_lens, d=_dtype: _decode(q, kc, vc, cc,
                                                                             t.tensor(ls, dtype=getattr(t, d))))
_decode_bad("decode: seq_start -1", ("seq_start",),
            lambda t, q, k, v, g, kc, vc, cc: _decode(q, kc, vc, cc, seq_start=t.tensor([0, -1, 0])))
for _th in (1.0, float("nan"), "auto"):
    _decode_bad(f"decode: adaptive_threshold {_th!r}", ("adaptive_threshold",),
                lambda t, q, k, v, g, kc, vc, cc, th=_th: _decode(q, kc, vc, cc, adaptive_threshold=th))
_decode_bad("decode: window_size 0", ("window_size",),
            lambda t, q, k, v, g, kc, vc, cc: _decode(q, kc, vc, cc, window_size=0))
_decode_bad("decode: a gate of exactly 0 inside c_cache", ("c_cache",),
            lambda t, q, k, v, g, kc, vc, cc: _decode(q, kc, vc, cc.index_fill(1, t.tensor([5]), float("-inf"))))


def _paged_bad(name, names, call):
    """A case: ``call(torch, q, kc, vc, cc, table, lens)`` on a valid paged cache; a return is accepted."""
    def run():
        import torch

        q, k, v, g, kc, vc, cc, table, lens = paged_inputs()
        out = call(torch, q, kc, vc, cc, table, lens)
        return accepted(f"returned {type(out).__name__}")
    case(DECODE, name, names=names)(run)


def _paged_append(kc, vc, cc, table, lens, n=1, gate=None, seed=3):
    import torch

    from fox_kernel import append_to_paged_cache

    gen = torch.Generator().manual_seed(seed)
    B, Hkv, D, H = table.shape[0], kc.shape[2], kc.shape[3], cc.shape[2]
    g = -torch.rand(B, n, H, generator=gen) if gate is None else torch.full((B, n, H), gate)
    return append_to_paged_cache(kc, vc, cc, table, lens, torch.randn(B, n, Hkv, D, generator=gen),
                                 torch.randn(B, n, Hkv, D, generator=gen), g)


for _page in (99, -1, 10**8, POOL):
    _paged_bad(f"paged decode: a used block_table entry of {_page}", ("block_table",),
               lambda t, q, kc, vc, cc, table, lens, p=_page: _decode(q, kc, vc, cc, lens,
                                                                      block_table=table.index_fill(1, t.tensor([1]), p)))
    _paged_bad(f"append_to_paged_cache: the written page is {_page}", ("block_table",),
               lambda t, q, kc, vc, cc, table, lens, p=_page: _paged_append(
                   kc, vc, cc, table.index_put_((t.tensor([2]), t.tensor([0])), t.tensor(p, dtype=t.int32)), lens))
_paged_bad("paged decode: int64 block_table", ("block_table",),
           lambda t, q, kc, vc, cc, table, lens: _decode(q, kc, vc, cc, lens, block_table=table.long()))
_paged_bad("paged decode: block_table of 2 rows for 3", ("block_table",),
           lambda t, q, kc, vc, cc, table, lens: _decode(q, kc, vc, cc, lens, block_table=table[:2]))
_paged_bad("paged decode: no cache_seqlens", ("cache_seqlens",),
           lambda t, q, kc, vc, cc, table, lens: _decode(q, kc, vc, cc, block_table=table))
_paged_bad("paged decode: cache_seqlens past the row's pages (17 > 16)", ("cache_seqlens",),
           lambda t, q, kc, vc, cc, table, lens: _decode(q, kc, vc, cc, t.tensor([17, 7, 3], dtype=t.int32),
                                                         block_table=table))
_paged_bad("append_to_paged_cache: past the row's capacity", ("block_table", "cache_seqlens"),
           lambda t, q, kc, vc, cc, table, lens: _paged_append(kc, vc, cc, table, lens, n=5))
_paged_bad("append_to_paged_cache: negative cache_seqlens", ("cache_seqlens",),
           lambda t, q, kc, vc, cc, table, lens: _paged_append(kc, vc, cc, table,
                                                               t.tensor([3, -2, 0], dtype=t.int32)))
_paged_bad("append_to_paged_cache: a positive log gate", ("log_fgate_new",),
           lambda t, q, kc, vc, cc, table, lens: _paged_append(kc, vc, cc, table, lens, gate=0.25))
_paged_bad("append_to_paged_cache: int32 k_cache", ("k_cache",),
           lambda t, q, kc, vc, cc, table, lens: _paged_append(kc.int(), vc, cc, table, lens))


def _fill_bad(name, names, call):
    def run():
        import torch

        q, k, v, g = decode_inputs()
        caches = torch.zeros(3, 16, *k.shape[2:]), torch.zeros(3, 16, *v.shape[2:]), torch.zeros(3, 16, g.shape[2])
        out = call(torch, k, v, g, *caches)
        return accepted(f"returned {type(out).__name__}")
    case(DECODE, name, names=names)(run)


def _fill(*args, **kwargs):
    from fox_kernel import fill_empty_cache

    return fill_empty_cache(*args, **kwargs)


_fill_bad("fill_empty_cache: int32 K cache", ("k_cache",), lambda t, k, v, g, kc, vc, cc: _fill(kc.int(), vc, cc, k, v, g))
_fill_bad("fill_empty_cache: float64 c_cache", ("c_cache",),
          lambda t, k, v, g, kc, vc, cc: _fill(kc, vc, cc.double(), k, v, g))
_fill_bad("fill_empty_cache: 20 tokens into 16", ("k_new", "cache"),
          lambda t, k, v, g, kc, vc, cc: _fill(kc, vc, cc, k.repeat(1, 2, 1, 1)[:, :20], v.repeat(1, 2, 1, 1)[:, :20],
                                               g.repeat(1, 2, 1)[:, :20]))
_fill_bad("fill_empty_cache: a positive log gate", ("log_fgate_new",),
          lambda t, k, v, g, kc, vc, cc: _fill(kc, vc, cc, k, v, g.abs()))
_fill_bad("fill_empty_cache: caches on the meta device", ("k_cache",),
          lambda t, k, v, g, kc, vc, cc: _fill(kc.to("meta"), vc.to("meta"), cc.to("meta"), k, v, g))
_fill_bad("fill_empty_cache: k_new a list", ("k_new",),
          lambda t, k, v, g, kc, vc, cc: _fill(kc, vc, cc, k.tolist(), v, g))


def _off_host():
    """Make the value checks see every tensor as a device tensor (not readable without a wait), as on CUDA:
    what runs then is what a GPU runs with values nobody checked."""
    from fox_kernel.ops import checks

    checks.values_checkable = lambda x: False


for _page in (99, -1, 10**8):
    @case(DECODE, f"off the host: a used page {_page} gives a NaN row, the other rows exact", expect="value")
    def _(page=_page):
        q, k, v, g, kc, vc, cc, table, lens = paged_inputs()
        _off_host()
        table[0, 1] = page
        out = _decode(q, kc, vc, cc, lens, block_table=table)
        ref = ref_decode(q, k, v, g, lens)
        ref[0] = float("nan")
        return close(out, ref)


@case(DECODE, "off the host: append to page -1 writes nothing, other rows exact", expect="value")
def _():
    import torch

    q, k, v, g, kc, vc, cc, table, lens = paged_inputs()
    _off_host()
    before = [x.clone() for x in (kc, vc, cc)]
    bad = table.clone()
    bad[2, 0] = -1  # row 2's first page (it holds 3 tokens: the append writes there)
    new = _paged_append(kc, vc, cc, bad, lens)
    written = set(int(table[b, int(lens[b]) // PAGE]) for b in (0, 1))  # the pages rows 0 and 1 wrote
    untouched = [p for p in range(POOL) if p not in written]
    same = all(torch.equal(a[untouched], b[untouched]) for a, b in zip((kc, vc, cc), before))
    if not same:
        return result("silent-wrong", "pages of no valid write changed")
    return result("correct", f"new lengths {new.tolist()}; only rows 0 and 1 written")


@case(DECODE, "off the host: cache_seqlens past the cache gives NaN for that row", expect="value")
def _():
    import torch

    q, k, v, g = decode_inputs()
    kc, vc, cc = _cache(k, v, g)
    _off_host()
    out = _decode(q, kc, vc, cc, torch.tensor([12, 30, 12], dtype=torch.int32))
    ref = ref_decode(q, k, v, g)
    ref[1] = float("nan")
    return close(out, ref)


# ------------------------------------------------------------------------------------------------- fox-layers


def _layer(**kwargs):
    import torch

    from fox_layers import ForgettingAttentionLayer

    torch.manual_seed(0)
    return ForgettingAttentionLayer(**{"hidden_size": 64, "num_heads": 4, **kwargs})


@case("layers", "valid: layer output equals projections + reference attention", expect="value")
def _():
    import torch
    import torch.nn.functional as F

    layer = _layer(num_kv_heads=2).eval()
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, _ = layer(x)
        q = F.linear(x, layer.q_proj.weight).view(2, 20, 4, 16)
        k = F.linear(x, layer.k_proj.weight).view(2, 20, 2, 16)
        v = F.linear(x, layer.v_proj.weight).view(2, 20, 2, 16)
        g = F.logsigmoid(F.linear(x, layer.fgate_proj.weight, layer.fgate_proj.bias))
        ref = F.linear(ref_attention(q, k, v, g).reshape(2, 20, 64).float(), layer.o_proj.weight)
    return close(out, ref)


for _kw, _names in ((dict(num_heads=0), ("num_heads",)), (dict(num_heads=3), ("num_heads",)),
                    (dict(num_kv_heads=3), ("num_kv_heads",)), (dict(hidden_size=0), ("hidden_size",)),
                    (dict(hidden_size=-8), ("hidden_size",)), (dict(fgate_type="bogus"), ("fgate_type",)),
                    (dict(fgate_bias_init=True, decay_time_min=10.0, decay_time_max=2.0), ("decay_time_min",)),
                    (dict(fgate_bias_init=True, decay_time_min=-1.0, decay_time_max=2.0), ("decay_time_min",)),
                    (dict(window_size=0), ("window_size",)), (dict(log_pruning_tolerance=1.0), ("log_pruning_tolerance",)),
                    (dict(ogate_act="relu", use_output_gate=True), ("ogate_act",)),
                    (dict(use_rope=True, rope_base=-1.0), ("rope_base",)), (dict(norm_eps=-1.0, use_output_norm=True),
                                                                            ("norm_eps",))):
    @case("layers", "ForgettingAttentionLayer(" + ", ".join(f"{k}={v!r}" for k, v in _kw.items()) + ")",
          names=_names)
    def _(kw=_kw):
        layer = _layer(**kw)
        return accepted(f"built a layer of {sum(p.numel() for p in layer.parameters())} parameters")


@case("layers", "forward: hidden states of width 32 for a width-64 layer", names=("hidden_states", "hidden_size"))
def _():
    import torch

    out, _ = _layer()(torch.randn(1, 5, 32))
    return accepted(f"returned shape {tuple(out.shape)}")


@case("layers", "forward: seq_start -1", names=("seq_start",))
def _():
    import torch

    out, _ = _layer()(torch.randn(2, 5, 64), seq_start=torch.tensor([-1, 0]))
    return accepted(f"returned shape {tuple(out.shape)}")


@case("layers", "forward: cu_seqlens with a batch of 2", names=("cu_seqlens",))
def _():
    import torch

    out, _ = _layer()(torch.randn(2, 6, 64), cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))
    return accepted(f"returned shape {tuple(out.shape)}")


# ------------------------------------------------------------------------------------------------- fox-models


FAMILY_PRESETS = {"fox": "fox-pro-tiny", "transformer": "transformer-llama-tiny", "mamba2": "mamba2-tiny",
                  "samba": "samba-tiny", "hgrn2": "hgrn2-tiny", "delta_net": "delta_net-tiny"}


def _config(family="fox", **kwargs):
    """The family's tiny preset with ``kwargs`` replacing its fields."""
    from fox_models.presets import get_preset

    return get_preset(FAMILY_PRESETS[family], **kwargs)


for _family, _kw, _names in (
        ("fox", dict(num_hidden_layers=-1), ("num_hidden_layers",)), ("fox", dict(num_hidden_layers=0), ("num_hidden_layers",)),
        ("fox", dict(vocab_size=0), ("vocab_size",)), ("fox", dict(norm_eps=-1.0), ("norm_eps",)),
        ("fox", dict(hidden_ratio=0), ("hidden_ratio",)),
        ("fox", dict(decay_time_min=100.0, decay_time_max=10.0), ("decay_time_min",)),
        ("fox", dict(hidden_size=-1), ("hidden_size",)), ("fox", dict(hidden_size=64, num_heads=3), ("num_heads",)),
        ("fox", dict(num_heads=8, num_kv_heads=3), ("num_kv_heads",)), ("fox", dict(window_size=0), ("window_size",)),
        ("fox", dict(fgate_type="bogus"), ("fgate_type",)), ("fox", dict(max_position_embeddings=0),
                                                             ("max_position_embeddings",)),
        ("fox", dict(initializer_range=float("nan")), ("initializer_range",)),
        ("fox", dict(log_pruning_tolerance=3.0), ("log_pruning_tolerance",)),
        ("fox", dict(hidden_act="relu"), ("hidden_act",)), ("fox", dict(ogate_act="relu"), ("ogate_act",)),
        ("transformer", dict(num_heads=0), ("num_heads",)), ("transformer", dict(rope_base=-1.0), ("rope_base",)),
        ("mamba2", dict(head_dim=0), ("head_dim",)), ("mamba2", dict(expand=0), ("expand",)),
        ("mamba2", dict(state_size=0), ("state_size",)), ("samba", dict(window_size=0), ("window_size",)),
        ("hgrn2", dict(expand_ratio=0), ("expand_ratio",)), ("delta_net", dict(conv_size=0), ("conv_size",)),
        ("delta_net", dict(num_heads=0), ("num_heads",))):
    @case("models", f"{_family} config " + ", ".join(f"{k}={v!r}" for k, v in _kw.items()), names=_names)
    def _(family=_family, kw=_kw):
        config = _config(family, **kw)
        return accepted(f"built a {type(config).__name__}")


def _model(preset="fox-pro-tiny", seed=0):
    """A tiny preset (two layers of width 128) with a vocabulary of 64, in eval mode."""
    import torch

    from fox_models.presets import get_preset
    from fox_models.registry import MODELS

    config = get_preset(preset, vocab_size=64, bos_token_id=0, eos_token_id=0)
    entry = next(e for e in MODELS if e.config_class is type(config))
    torch.manual_seed(seed)
    return entry.lm_class(config).eval()


def _ids(n=6, batch=1, seed=0):
    import torch

    return torch.randint(0, 64, (batch, n), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, **kwargs):
    import torch

    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


@case("models", "valid: left-padded row equals the row alone", expect="value")
def _():
    import torch

    model, ids = _model(), _ids(6)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    return close(_logits(model, padded, attention_mask=mask)[:, 3:], _logits(model, ids), atol=1e-5)


@case("models", "valid: a mask with a hole gives the logits of the row without the masked token", expect="value")
def _():
    import torch

    model, ids = _model(), _ids(6)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    kept = mask[0].bool()
    return close(_logits(model, ids, attention_mask=mask)[:, kept], _logits(model, ids[:, kept]), atol=1e-5)


@case("models", "valid: greedy generate equals an argmax loop over full forwards", expect="value")
def _():
    import torch

    model, ids = _model(), _ids(5)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    ref = ids
    for _ in range(6):
        ref = torch.cat([ref, _logits(model, ref)[:, -1:].argmax(-1)], 1)
    return result("correct" if torch.equal(out, ref) else "silent-wrong", f"tokens {out[0, 5:].tolist()} vs "
                                                                           f"{ref[0, 5:].tolist()}")


@case("models", "valid: decoding with the cache equals the full forward", expect="value")
def _():
    import torch

    model, ids = _model(), _ids(8)
    with torch.no_grad():
        first = model(input_ids=ids[:, :5], use_cache=True)
        cache, steps = first.past_key_values, [first.logits]
        for t in range(5, 8):
            o = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            steps.append(o.logits)
    return close(torch.cat(steps, 1), _logits(model, ids), atol=1e-5)


for _n in (9, 5, 3):
    @case("models", f"attention_mask (1, {_n}) for 6 tokens, no cache", names=("attention_mask",))
    def _(n=_n):
        import torch

        _logits(_model(), _ids(6), attention_mask=torch.ones(1, n, dtype=torch.long))
        return accepted()


@case("models", "attention_mask (1, 4) for 1 new token after 4 cached (needs 5)", names=("attention_mask",))
def _():
    import torch

    model, ids = _model(), _ids(5)
    with torch.no_grad():
        cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
        model(input_ids=ids[:, 4:], past_key_values=cache, attention_mask=torch.ones(1, 4, dtype=torch.long))
    return accepted()


@case("models", "generate with a (1, 4) mask for 6 prompt tokens", names=("attention_mask",))
def _():
    import torch

    model = _model()
    with torch.no_grad():
        model.generate(_ids(6), attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
    return accepted()


@case("models", "attention_mask of 3 dimensions", names=("attention_mask",))
def _():
    import torch

    _logits(_model(), _ids(6), attention_mask=torch.ones(1, 1, 6, dtype=torch.long))
    return accepted()


@case("models", "attention_mask with a row of only zeros", names=("attention_mask",), expect="either")
def _():
    import torch

    out = _logits(_model(), _ids(6, batch=2), attention_mask=torch.tensor([[1] * 6, [0] * 6]))
    return result("correct" if torch.isfinite(out).all() else "silent-wrong", "a row of padding only")


for _preset in ("fox-pro-tiny", "transformer-llama-tiny", "mamba2-tiny", "hgrn2-tiny", "delta_net-tiny", "samba-tiny"):
    for _bad in (64, -1):
        @case("models", f"{_preset}: input id {_bad} with vocab_size 64", names=("input_ids", "vocab"))
        def _(preset=_preset, bad=_bad):
            ids = _ids(6)
            ids[0, 3] = bad
            _logits(_model(preset), ids)
            return accepted()


@case("models", "float input_ids", names=("input_ids",))
def _():
    _logits(_model(), _ids(6).float())
    return accepted()


@case("models", "labels of the wrong shape", names=("labels",))
def _():
    import torch

    with torch.no_grad():
        _model()(input_ids=_ids(6), labels=_ids(5))
    return accepted()


@case("models", "both input_ids and inputs_embeds", names=("input_ids", "inputs_embeds"))
def _():
    import torch

    _model()(input_ids=_ids(6), inputs_embeds=torch.randn(1, 6, 128))
    return accepted()


@case("models", "past_key_values a tuple of tensors", names=("past_key_values", "cache"))
def _():
    import torch

    _model()(input_ids=_ids(2), past_key_values=((torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16)),),
             use_cache=True)
    return accepted()


for _preset in ("fox-pro-tiny", "transformer-llama-tiny", "mamba2-tiny", "hgrn2-tiny", "delta_net-tiny", "samba-tiny"):
    @case("models", f"{_preset}: an empty prompt (1, 0)", names=("input_ids", "token", "empty"), expect="either")
    def _(preset=_preset):
        import torch

        out = _logits(_model(preset), torch.zeros(1, 0, dtype=torch.long))
        return result("correct" if out.shape == (1, 0, 64) else "silent-wrong", f"logits of shape {tuple(out.shape)}")


# ------------------------------------------------------------------------------------------- command lines


def work() -> Path:
    """The probe's scratch folder (fixtures, run folders), shared by every case."""
    return Path(os.environ["FOX_PROBE_WORK"])


@dataclass
class CliRun:
    rc: int | None
    signal: int | None
    timed_out: bool
    out: str
    err: str
    seconds: float
    timeout: float


def run_cli(prog: str, argv: list[str], *, timeout: float = 120, real: bool = False, cwd: Path | None = None,
            poll=None) -> CliRun:
    """``prog``'s main(argv) in a forked process, as its console script runs it (a SystemExit message is
    printed to stderr with status 1, an uncaught exception as a traceback); ``real``: the installed console
    script itself in a subprocess. Killed after ``timeout`` seconds; ``poll(pid, seconds)`` is called every
    0.1 s while it runs (to send it a signal)."""
    cwd = cwd or work()
    logs = Path(tempfile.mkdtemp(dir=work(), prefix="cli-"))
    out_path, err_path = logs / "out", logs / "err"
    start = time.monotonic()
    if real:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([str(BIN / prog), *argv], cwd=cwd, stdout=out, stderr=err)
            pid = proc.pid
    else:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _cli_child(prog, argv, cwd, out_path, err_path)
    status, timed_out = None, False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            timed_out = True
            break
        if poll is not None:
            poll(pid, elapsed)
        time.sleep(0.1)
    rc = sig = None
    if not timed_out:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
        else:
            rc = os.WEXITSTATUS(status)
    return CliRun(rc, sig, timed_out, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"),
                  time.monotonic() - start, timeout)


def _cli_child(prog, argv, cwd, out_path, err_path):
    code = 1
    try:
        os.chdir(cwd)
        for fd, path in ((1, out_path), (2, err_path)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = [prog, *argv]
        module = {"fox-train": "fox_train.cli", "fox-eval": "fox_eval.cli"}[prog]
        main = __import__(module, fromlist=["main"]).main
        try:
            main(argv)
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def message_lines(err: str) -> list[str]:
    """stderr without progress bars (the text after each carriage return, tqdm's lines dropped) and blanks."""
    lines = []
    for line in err.split("\n"):
        line = line.split("\r")[-1].strip()
        if line and not ("%|" in line and ("it/s" in line or "step/s" in line or "?" in line or "s]" in line)):
            lines.append(line)
    return lines


def classify_run(run: CliRun, names, expect: str) -> dict:
    """The class of a command's outcome (see the module's docstring)."""
    if run.timed_out:
        return result("hang", f"still running after {run.timeout:.0f} s")
    if run.signal is not None:
        return result("crash", f"killed by {signal.Signals(run.signal).name}")
    lines = message_lines(run.err)
    last = lines[-1] if lines else ""
    if run.rc == 0:
        return accepted(f"exit 0 after {run.seconds:.0f} s") if expect == "error" else result("correct", "exit 0")
    if expect == "value":
        return result("traceback", f"a valid call refused (exit {run.rc}): {last[:300]}")
    if "Traceback (most recent call last)" in run.err:
        return result("traceback", f"exit {run.rc}, a traceback of {len(lines)} lines ending: {last[:300]}")
    if not last:
        return result("traceback", f"exit {run.rc} without a message")
    named = names_one(last, names)
    note = last[:400] + (f" (after {len(lines) - 1} other stderr lines)" if len(lines) > 1 else "")
    return result("one-line error" if named else "traceback", note if named else f"names none of {names}: {note}")


def leftovers(root: Path, keep=()) -> list[str]:
    """Files and folders under ``root`` (other than ``keep``): what a refused call left behind."""
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.relative_to(root).parts[0] not in keep)


# ------------------------------------------------------------------------------------------------ fox-train

TINY = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_heads=2", "data.seq_len=64",
        "micro_batch_size=4", "global_batch_tokens=256", "schedule.warmup_tokens=256", "schedule.total_tokens=1024",
        "eval_sequences=4", "eval_every=2", "log_every=1", "checkpoint_every=2", "export=false"]


def tokens_args() -> list[str]:
    return ["data=tokens", f"data.path={work() / 'tokens.npy'}"]


def fresh(slug: str) -> Path:
    """An empty folder for a case; its ``out`` subfolder is the runs' out_dir (not made)."""
    root = work() / "train" / slug
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return root


def train_case(name, overrides, names, expect="error", timeout=120, quick=True, data=True, real=False,
               keep=(), slug=None):
    """A fox-train call on the tiny model and token data with ``overrides`` added last (replacing the same
    keys); a refused call must leave its fresh out_dir as it was (absent)."""
    slug = slug or f"t{len(CASES)}"

    def run():
        root = fresh(slug)
        given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
        base = [a for a in (f"out_dir={root / 'out'}", "run_name=r", *TINY, *(tokens_args() if data else []))
                if a.split("=", 1)[0] not in given]
        argv = [*base, *overrides]
        res = classify_run(run_cli("fox-train", argv, timeout=timeout, real=real), names, expect)
        left = leftovers(root, keep)
        if res["class"] == "one-line error" and left:
            return result("silent-wrong", f"refused, but left behind {left[:6]}: {res['note']}")
        return res
    case("train", name, names=names, expect=expect, timeout=timeout + 30, quick=quick)(run)


HUGE = 4611686018427387904  # 2^62
train_case("global_batch_tokens=2^62 (step 0 never ended)", [f"global_batch_tokens={HUGE}"], ("global_batch_tokens",))
train_case("global_batch_tokens=2^62, installed console script", [f"global_batch_tokens={HUGE}"],
           ("global_batch_tokens",), real=True)
train_case("global_batch_tokens=2^62 with schedule.total_tokens=2^62 (more than the data)",
           [f"global_batch_tokens={HUGE}", f"schedule.total_tokens={HUGE}"], ("global_batch_tokens",))
for _o, _n in (("model.hidden_size=-1", "model.hidden_size"), ("model.num_hidden_layers=-1", "model.num_hidden_layers"),
               ("model.num_heads=3", "num_heads"), ("model.hidden_ratio=0", "hidden_ratio"),
               ("model.window_size=0", "window_size"), ("model.fgate_type=bogus", "fgate_type"),
               ("model.log_pruning_tolerance=5", "log_pruning_tolerance"),
               ("+model.overrides.norm_eps=-1", "norm_eps"), ("model.state_size=4", "model.state_size"),
               ("model=no-such-preset", "model"), ("foo=1", "foo"), ("optimizer.lr=-1", "optimizer.lr"),
               ("optimizer.lr=nan", "optimizer.lr"), ("optimizer.lr=inf", "optimizer.lr"),
               ("optimizer.betas=[0.9]", "optimizer.betas"), ("optimizer.betas=[1.5,0.9]", "optimizer.betas"),
               ("optimizer.eps=0", "optimizer.eps"), ("optimizer.eps=-1", "optimizer.eps"),
               ("optimizer.weight_decay=-1", "optimizer.weight_decay"), ("optimizer.grad_clip=-1", "optimizer.grad_clip"),
               ("schedule=bogus", "schedule"), ("schedule.name=bogus", "schedule.name"),
               ("schedule.warmup_tokens=-1", "schedule.warmup_tokens"), ("schedule.min_lr_ratio=2", "min_lr_ratio"),
               ("schedule=warmup_one_minus_sqrt", "anneal_tokens"), ("schedule.total_tokens=0", "schedule.total_tokens"),
               ("data.seq_len=0", "data.seq_len"), ("micro_batch_size=0", "micro_batch_size"),
               ("global_batch_tokens=100", "global_batch_tokens"), ("log_every=0", "log_every"),
               ("eval_every=0", "eval_every"), ("checkpoint_every=0", "checkpoint_every"), ("keep_last=0", "keep_last"),
               ("keep_every=-1", "keep_every"), ("eval_sequences=0", "eval_sequences"), ("seed=-1", "seed"),
               ("seed=4294967296", "seed"), ("data.order=bogus", "data.order"), ("strategy=bogus", "strategy"),
               ("strategy.devices=0", "strategy.devices"), ("strategy.precision=bogus", "precision"),
               ("strategy.accelerator=cuda", "accelerator"), ("strategy.context_parallel=3", "context_parallel"),
               ("strategy.num_nodes=0", "strategy.num_nodes"), ("compile_mode=bogus", "compile_mode"),
               ("activation_memory_budget=2", "activation_memory_budget"),
               ("run_name=../../x", "run_name"), ("run_name=/abs/x", "run_name"), ("run_name=é", "run_name"),
               ("run_name=a\nb", "run_name"), ("data=bogus", "data"),
               ("data.path=/no/such/file.npy", "data.path"), ("data.heldout_path=/no/such/held.npy", "data.heldout_path"),
               ("init_from=/no/such/run", "init_from")):
    train_case(_o.replace("\n", "\\n"), [_o], (_n,))


def _train_data_case(name, make, names, extra=(), **kw):
    """A case on a token or text file that ``make(np, folder)`` writes; its path is given as data.path."""
    slug = f"t{len(CASES)}"

    def run():
        import numpy as np

        root = fresh(slug)
        data_dir = root.parent / (slug + "-data")
        shutil.rmtree(data_dir, ignore_errors=True)
        data_dir.mkdir()
        kind, path = make(np, data_dir)
        argv = [f"out_dir={root / 'out'}", "run_name=r", *TINY, f"data={kind}", f"data.path={path}", *extra]
        res = classify_run(run_cli("fox-train", argv, timeout=120), names, "error")
        left = leftovers(root)
        if res["class"] == "one-line error" and left:
            return result("silent-wrong", f"refused, but left behind {left[:6]}: {res['note']}")
        return res
    case("train", name, names=names, timeout=150, **kw)(run)


def _save(np, path, array):
    np.save(path, array)
    return path


_train_data_case("data.path: float32 values", lambda np, d: ("tokens", _save(np, d / "f.npy", np.zeros(5000, np.float32))),
                 ("data.path",))
_train_data_case("data.path: token id 60000 >= vocab_size 50257", lambda np, d: (
    "tokens", _save(np, d / "ids.npy", np.full(20000, 60000, np.uint16))), ("data.path", "vocab"))
_train_data_case("data.path: an empty token file", lambda np, d: ("tokens", _save(np, d / "e.npy", np.zeros(0, np.uint16))),
                 ("data.path",))
_train_data_case("data.path: a 2-D token array", lambda np, d: ("tokens", _save(np, d / "2d.npy",
                                                                              np.zeros((100, 100), np.uint16))),
                 ("data.path",))
_train_data_case("data.path: a .bin file of 7 bytes", lambda np, d: (
    "tokens", (d / "odd.bin", (d / "odd.bin").write_bytes(b"1234567"))[0]), ("data.path",))
_train_data_case("data=text: a folder without .txt files", lambda np, d: (
    "text", (d / "notes.md", (d / "notes.md").write_text("no text here"))[0].parent), ("data.path",))
_train_data_case("data=text: more tokens per step than the text holds (token cache left?)", lambda np, d: (
    "text", (d / "a.txt", (d / "a.txt").write_text("In the beginning God created the heaven and the earth. " * 300))[0]),
    ("global_batch_tokens",), extra=("global_batch_tokens=1048576", "schedule.total_tokens=1048576"))


@case("train", "valid: a 4-step run (exit 0, 4 finite losses, checkpoints)", expect="value", timeout=240)
def _():
    root = base_run()
    run = _BASE_RUNS.get("last")
    res = classify_run(run, (), "value") if run is not None else result("correct", "")
    if res["class"] != "correct":
        return res
    records = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines() if x.strip()]
    losses = [r["loss"] for r in records if "loss" in r]
    ckpts = sorted(p.name for p in (root / "checkpoints").iterdir())
    ok = len(losses) == 4 and all(math.isfinite(x) for x in losses) and ckpts[-1] == "step-00000004"
    return result("correct" if ok else "silent-wrong", f"losses {[round(x, 3) for x in losses]}, {ckpts}")


_BASE_RUNS: dict = {}


def base_run() -> Path:
    """The run folder of a finished 4-step run (made by the first case that needs it)."""
    root = work() / "train" / "base" / "out" / "r"
    if not (root / "checkpoints" / "step-00000004" / "COMPLETE").exists():
        shutil.rmtree(root.parent.parent, ignore_errors=True)
        _BASE_RUNS["last"] = run_cli("fox-train", [f"out_dir={root.parent}", "run_name=r", *TINY, *tokens_args()],
                                     timeout=200)
    return root


@case("train", "a run folder that holds checkpoints, without resume=true", names=("resume",), timeout=240)
def _():
    root = base_run()
    before = sorted(p.name for p in (root / "checkpoints").iterdir())
    res = classify_run(run_cli("fox-train", [f"out_dir={root.parent}", "run_name=r", *TINY, *tokens_args()]),
                       ("resume",), "error")
    after = sorted(p.name for p in (root / "checkpoints").iterdir())
    return res if before == after else result("silent-wrong", f"checkpoints changed: {before} -> {after}")


@case("train", "resume=true with a conflicting model.hidden_size", names=("model.hidden_size",), timeout=240)
def _():
    root = base_run()
    args = [f"out_dir={root.parent}", "run_name=r", *TINY, *tokens_args(), "resume=true", "model.hidden_size=128"]
    return classify_run(run_cli("fox-train", args), ("model.hidden_size",), "error")


@case("train", "init_from a folder that is no checkpoint or model", names=("init_from",))
def _():
    root = fresh("init-from-junk")
    junk = root / "junk"
    junk.mkdir()
    (junk / "readme.txt").write_text("not a model")
    args = [f"out_dir={root / 'out'}", "run_name=r", *TINY, *tokens_args(), f"init_from={junk}"]
    res = classify_run(run_cli("fox-train", args), ("init_from",), "error")
    left = leftovers(root, keep=("junk",))
    return result("silent-wrong", f"left behind {left}") if res["class"] == "one-line error" and left else res


@case("train", "resume=true over a crafted state.pt (a pickle that runs code)", names=("state.pt",), timeout=240)
def _():
    root = fresh("crafted")
    run = root / "out" / "r"
    shutil.copytree(base_run(), run)
    marker = root / "code-ran"
    payload = (b"cposix\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    for step in (run / "checkpoints").iterdir():
        (step / "state.pt").write_bytes(payload)
    res = classify_run(run_cli("fox-train", [f"out_dir={root / 'out'}", "run_name=r", *TINY, *tokens_args(),
                                             "resume=true"]), ("state.pt",), "error")
    return result("silent-wrong", "the crafted pickle ran its code") if marker.exists() else res


@case("train", "a sweep whose every job is refused (-m log_every=0,-1)", names=("log_every",))
def _():
    root = fresh("sweep")
    res = classify_run(run_cli("fox-train", ["-m", f"out_dir={root / 'out'}", "run_name=sweep", *TINY[:-1],
                                             *tokens_args(), "log_every=0,-1"]), ("log_every",), "error")
    left = leftovers(root)
    return result("silent-wrong", f"refused, but left behind {left}: {res['note']}") if left and \
        res["class"] == "one-line error" else res


def _interrupt_mid_run(folder: str, sig: signal.Signals, after_losses: int, exit_code: int) -> dict:
    """fox-train on the tiny model, sent ``sig`` once ``after_losses`` steps are logged: correct when it exits
    with ``exit_code`` within 60 s of the signal, with a checkpoint and one last ``fox-train:`` line and no
    traceback."""
    root = fresh(folder)
    metrics = root / "out" / "r" / "metrics.jsonl"
    sent = {}

    def poll(pid, elapsed):
        if "at" not in sent and metrics.exists() and metrics.read_text().count('"loss"') >= after_losses:
            os.kill(pid, sig)
            sent["at"] = elapsed

    args = [f"out_dir={root / 'out'}", "run_name=r", *TINY, *tokens_args(), "schedule.total_tokens=10240",
            "checkpoint_every=100"]
    run = run_cli("fox-train", args, timeout=240, poll=poll)
    if "at" not in sent or run.timed_out or run.signal is not None:
        return classify_run(run, (), "value") if run.rc != 0 else result("silent-wrong", "finished before the signal")
    waited = run.seconds - sent["at"]
    lines = message_lines(run.err)
    ckpts = sorted(p.name for p in (root / "out" / "r" / "checkpoints").glob("step-*"))
    ok = run.rc == exit_code and waited < 60 and ckpts and lines and lines[-1].startswith("fox-train:") and \
        "Traceback" not in run.err
    return result("correct" if ok else "silent-wrong", f"exit {run.rc} {waited:.1f} s after {sig.name}, {ckpts}, "
                                                       f"last line {lines[-1] if lines else ''!r}")


@case("train", "SIGTERM mid-run: a checkpoint, one line, exit 143 within 60 s", names=("SIGTERM", "signal"),
      expect="value", timeout=300, quick=False)
def _():
    return _interrupt_mid_run("sigterm", signal.SIGTERM, 3, 143)


@case("train", "Ctrl-C (SIGINT) mid-run: a checkpoint, one line, exit 130 within 60 s", names=("SIGINT",),
      expect="value", timeout=300, quick=False)
def _():
    return _interrupt_mid_run("sigint", signal.SIGINT, 2, 130)


@case("train", "SIGTERM, then resume=true: every step's loss equals an uninterrupted run", expect="value",
      timeout=500, quick=False)
def _():
    root = work() / "train" / "sigterm" / "out"
    if not (root / "r" / "checkpoints").exists():
        return result("traceback", "the SIGTERM case left no run to resume")
    args = [*TINY, *tokens_args(), "schedule.total_tokens=10240", "checkpoint_every=100"]
    resumed = run_cli("fox-train", [f"out_dir={root}", "run_name=r", *args, "resume=true"], timeout=220)
    if resumed.rc != 0:
        return classify_run(resumed, (), "value")
    whole = run_cli("fox-train", [f"out_dir={root}", "run_name=whole", *args], timeout=220)
    if whole.rc != 0:
        return classify_run(whole, (), "value")

    def losses(run):
        records = [json.loads(x) for x in (root / run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        return {r["step"]: r["loss"] for r in records if "loss" in r}

    a, b = losses("r"), losses("whole")
    worst = max((abs(a[s] - b[s]) for s in b if s in a), default=float("inf"))
    ok = sorted(a) == sorted(b) and worst <= 1e-6
    return result("correct" if ok else "silent-wrong", f"{len(a)} steps, largest difference {worst:.2g}")


@case("train", "fox-train tokenize: a missing input", names=("input", "/no/such"))
def _():
    return classify_run(run_cli("fox-train", ["tokenize", "/no/such/corpus", str(work() / "o.npy")]),
                        ("/no/such/corpus",), "error")


@case("train", "fox-train export: a folder that is no checkpoint", names=("checkpoint", "/no/such"))
def _():
    junk = work() / "export-junk"
    junk.mkdir(exist_ok=True)
    return classify_run(run_cli("fox-train", ["export", str(junk), str(work() / "exported")]),
                        (str(junk), "checkpoint"), "error")


# ------------------------------------------------------------------------------------------------- fox-eval


def model_dir() -> Path:
    return work() / "model"


def eval_case(name, argv, names, expect="error", timeout=120, quick=True, real=False):
    """A fox-eval call; ``{model}`` and ``{work}`` in ``argv`` are the tiny model folder and the scratch
    folder."""
    def run():
        args = [a.format(model=model_dir(), work=work()) for a in argv]
        return classify_run(run_cli("fox-eval", args, timeout=timeout, real=real), names, expect)
    case("eval", name, names=names, expect=expect, timeout=timeout + 30, quick=quick)(run)


GEN = ["generate", "--model", "{model}", "--device", "cpu", "--max-new-tokens", "2"]
for _args, _n in ((["--temperature", "1", "--top-p", "2"], "--top-p"), (["--temperature", "1", "--top-p", "0"], "--top-p"),
                  (["--temperature", "1", "--top-p", "nan"], "--top-p"), (["--temperature", "-1"], "--temperature"),
                  (["--temperature", "nan"], "--temperature"), (["--max-new-tokens", "0"], "--max-new-tokens"),
                  (["--max-new-tokens", "-1"], "--max-new-tokens"), (["--device", "cuda"], "--device"),
                  (["--device", "bogus"], "--device"), (["--device", "cuda:7"], "--device")):
    eval_case(f"generate {' '.join(_args)}", [*GEN, *_args, "hi"], (_n,))
eval_case("generate --top-p 2, installed console script", [*GEN, "--top-p", "2", "hi"], ("--top-p",), real=True)
eval_case("generate: a missing model folder", ["generate", "--model", "{work}/no-such-model", "hi"], ("--model",))
eval_case("generate: a folder without config.json", ["generate", "--model", "{work}", "hi"], ("--model",))
eval_case("generate: truncated model.safetensors", ["generate", "--model", "{work}/model-truncated", "--device", "cpu",
                                                    "hi"], ("--model",))
eval_case("generate: config.json that is not JSON", ["generate", "--model", "{work}/model-badjson", "--device", "cpu",
                                                     "hi"], ("--model",))
eval_case("generate: config.json of an unknown model_type", ["generate", "--model", "{work}/model-unknown", "--device",
                                                             "cpu", "hi"], ("--model",))
PTL = ["per-token-loss", "--model", "{model}", "--device", "cpu", "--out", "{work}/ptl-out"]
for _args, _n in ((["--data", "text:{work}/empty-text", "--seq-len", "8"], "--data"),
                  (["--data", "bogus:x", "--seq-len", "8"], "--data"),
                  (["--data", "tokens:{work}/no-such.npy", "--seq-len", "8"], "--data"),
                  (["--data", "tokens:{work}/tokens.npy", "--seq-len", "0"], "--seq-len"),
                  (["--data", "tokens:{work}/tokens.npy", "--seq-len", "8", "--batch-size", "0"], "--batch-size"),
                  (["--data", "tokens:{work}/tokens.npy", "--seq-len", "8", "--limit", "0"], "--limit"),
                  (["--data", "tokens:{work}/floats.npy", "--seq-len", "8"], "--data"),
                  (["--data", "tokens:{work}/big-ids.npy", "--seq-len", "8"], "--data"),
                  (["--data", "tokens:{work}/tokens.npy", "--seq-len", "1000000"], "--seq-len"),
                  (["--data", "tokens:{work}/tokens.npy", "--seq-len", "8", "--labels", "a", "b"], "--labels"),
                  (["--data", "tokens:{work}/tokens.npy", "--seq-len", "abc"], "--seq-len")):
    eval_case(f"per-token-loss {' '.join(_args)}".replace("{work}/", ""), [*PTL, *_args], (_n,))
eval_case("harness --tasks hellaswagg (unknown)", ["harness", "--model", "{model}", "--tasks", "hellaswagg", "--device",
                                                   "cpu", "--out", "{work}/h-out"], ("--tasks",), quick=False, timeout=300)
eval_case("harness --limit 0", ["harness", "--model", "{model}", "--limit", "0", "--device", "cpu"], ("--limit",))
eval_case("harness --include-path missing", ["harness", "--model", "{model}", "--include-path", "{work}/none",
                                             "--device", "cpu"], ("--include-path",))
eval_case("niah --depths 150", ["niah", "--model", "{model}", "--depths", "150", "--device", "cpu"], ("--depths",))
eval_case("niah --lengths 10", ["niah", "--model", "{model}", "--lengths", "10", "--device", "cpu"], ("--lengths",))
eval_case("niah --haystack missing", ["niah", "--model", "{model}", "--haystack", "{work}/none", "--device", "cpu"],
          ("--haystack",))
eval_case("longbench --data missing", ["longbench", "--model", "{model}", "--data", "{work}/none"], ("--data",))
eval_case("longbench --tasks bogus", ["longbench", "--model", "{model}", "--data", "{work}", "--tasks", "bogus"],
          ("--tasks",))
eval_case("inspect with both --text and --data", ["inspect", "--model", "{model}", "--text", "{work}/t.txt", "--data",
                                                  "tokens:{work}/tokens.npy"], ("--text", "--data"))
eval_case("inspect --text missing", ["inspect", "--model", "{model}", "--text", "{work}/none.txt"], ("--text",))
eval_case("inspect --layers 99", ["inspect", "--model", "{model}", "--text", "{work}/t.txt", "--layers", "99",
                                  "--device", "cpu", "--out", "{work}/i-out"], ("--layers",))
eval_case("inspect --heads -1", ["inspect", "--model", "{model}", "--text", "{work}/t.txt", "--heads", "-1",
                                 "--device", "cpu", "--out", "{work}/i-out2"], ("--heads",))
eval_case("an unknown command", ["bogus"], ("bogus", "command"))


@case("eval", "generate: a crafted pytorch_model.bin (a pickle that runs code)", names=("--model",))
def _():
    folder = work() / "model-pickle"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(model_dir(), folder)
    (folder / "model.safetensors").unlink()
    marker = work() / "eval-code-ran"
    (folder / "pytorch_model.bin").write_bytes(b"cposix\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    res = classify_run(run_cli("fox-eval", ["generate", "--model", str(folder), "--device", "cpu", "hi"]),
                       ("--model",), "error")
    return result("silent-wrong", "the crafted pickle ran its code") if marker.exists() else res


@case("eval", "valid: generate (greedy) equals an argmax loop over the model", expect="value", timeout=180)
def _():
    import torch
    from transformers import AutoModelForCausalLM

    from fox_eval.loading import load_tokenizer

    run = run_cli("fox-eval", ["generate", "--model", str(model_dir()), "--device", "cpu", "--max-new-tokens", "5",
                               "In the beginning"])
    res = classify_run(run, (), "value")
    if res["class"] != "correct":
        return res
    tok = load_tokenizer(str(model_dir()))
    model = AutoModelForCausalLM.from_pretrained(model_dir()).eval()
    ids = tok("In the beginning", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for _ in range(5):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
    expected = tok.decode(ids[0, -5:], skip_special_tokens=True)
    got = run.out.rstrip("\n")
    return result("correct" if got == expected else "silent-wrong", f"{got!r} vs {expected!r}")


@case("eval", "valid: per-token-loss equals cross-entropy computed here", expect="value", timeout=180)
def _():
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    out = work() / "ptl-valid"
    shutil.rmtree(out, ignore_errors=True)
    run = run_cli("fox-eval", ["per-token-loss", "--model", str(model_dir()), "--data", f"tokens:{work()}/tokens.npy",
                               "--seq-len", "16", "--limit", "3", "--device", "cpu", "--out", str(out)])
    res = classify_run(run, (), "value")
    if res["class"] != "correct":
        return res
    got = json.loads((out / "per_token_loss.json").read_text())["per_token_loss"]
    curve = torch.tensor(next(iter(got.values())))
    seqs = torch.from_numpy(np.load(work() / "tokens.npy")[: 3 * 16].astype(np.int64)).view(3, 16)
    inputs = torch.cat([torch.full((3, 1), 50256), seqs[:, :-1]], 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir()).eval()
    with torch.no_grad():
        logits = model(input_ids=inputs).logits.double()
    ref = F.cross_entropy(logits.transpose(1, 2), seqs, reduction="none").mean(0)
    return close(curve, ref, atol=1e-4)


# ------------------------------------------------------------------------------------------------- fixtures


def make_fixtures() -> None:
    """Token files, text folders and model folders the cases read (run once, in a forked process)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import fox_models

    w = work()
    rng = np.random.default_rng(0)
    np.save(w / "tokens.npy", rng.integers(0, 50_000, 20_000, dtype=np.uint16))
    np.save(w / "floats.npy", np.zeros(1000, np.float32))
    np.save(w / "big-ids.npy", np.full(1000, 60_000, np.uint16))
    (w / "empty-text").mkdir(exist_ok=True)
    (w / "empty-text" / "notes.md").write_text("not a .txt file")
    (w / "t.txt").write_text("In the beginning God created the heaven and the earth. " * 20)
    torch.manual_seed(0)
    cfg = fox_models.ForgettingTransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=2, num_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir())
    fox_models.JSONGPT2Tokenizer().save_pretrained(model_dir())
    for name in ("model-truncated", "model-badjson", "model-unknown"):
        shutil.copytree(model_dir(), w / name)
    weights = w / "model-truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (w / "model-badjson" / "config.json").write_text("{not json")
    config = json.loads((w / "model-unknown" / "config.json").read_text())
    (w / "model-unknown" / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))


# ----------------------------------------------------------------------------------------- servers and cases


def classify_exception(c: Case, e: BaseException) -> dict:
    """An exception's class: one line naming one of the case's arguments, or a traceback."""
    text = str(e).strip()
    head = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:400]
    if c.expect == "value":
        return result("traceback", f"a valid input refused: {head}")
    if not text or "\n" in text:
        return result("traceback", f"{len(text.splitlines())} lines: {head}")
    if not names_one(text, c.names):
        return result("traceback", f"names none of {c.names}: {head}")
    return result("one-line error", head)


def run_case(c: Case) -> dict:
    try:
        out = c.fn()
    except BaseException as e:  # noqa: BLE001 - every exception is a result here
        return classify_exception(c, e)
    if out is None:
        return accepted() if c.expect == "error" else result("correct", "")
    return out


def run_forked(fn, timeout: float, log: Path) -> dict:
    """``fn()`` (a result dict) in a forked process of its own process group; crash and hang recorded."""
    fd, path = tempfile.mkstemp(dir=work(), prefix="result-")
    os.close(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)  # a hang is killed with every process it started
        f = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, 1)
        os.dup2(f, 2)
        try:
            if os.environ.get("FOX_PROBE_THREADS"):
                import torch

                torch.set_num_threads(int(os.environ["FOX_PROBE_THREADS"]))
            res = fn()
        except BaseException as e:  # noqa: BLE001
            res = result("traceback", f"probe error: {type(e).__name__}: {e}"[:400])
            traceback.print_exc()
        Path(path).write_text(json.dumps(res))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    status, res = None, None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - start > timeout:
            res = result("hang", f"killed after {timeout:.0f} s")
            break
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # what it left running (a hang's command line)
    if res is None and os.WIFSIGNALED(status):
        res = result("crash", f"killed by {signal.Signals(os.WTERMSIG(status)).name}")
    elif res is None:
        text = Path(path).read_text()
        res = json.loads(text) if text else result("traceback", f"exited {os.WEXITSTATUS(status)} without a result")
    else:
        os.waitpid(pid, 0)
    Path(path).unlink(missing_ok=True)
    res["seconds"] = round(time.monotonic() - start, 2)
    return res


def preload(kind: str) -> None:
    """Import what the cases use, once, before any case is forked (no tensor work here: a forked process
    must not inherit a started thread pool)."""
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import fox_kernel  # noqa: F401
    if kind == "interp":
        import fox_kernel.ops.triton.bwd  # noqa: F401
        import fox_kernel.ops.triton.decode  # noqa: F401
        import fox_kernel.ops.triton.fwd  # noqa: F401
        return
    import transformers  # noqa: F401

    import fox_eval.cli  # noqa: F401
    import fox_eval.loading  # noqa: F401
    import fox_layers  # noqa: F401
    import fox_models  # noqa: F401
    import fox_train.cli  # noqa: F401
    import fox_train.train  # noqa: F401


def serve(kind: str) -> None:
    """A case server: reads case keys from stdin, runs each forked, writes one JSON line per result."""
    chan = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # what the imports print stays out of the results channel
    preload(kind)
    by_key = {c.key: c for c in CASES}
    logs = work() / "logs"
    logs.mkdir(exist_ok=True)
    chan.write(json.dumps({"ready": kind}) + "\n")
    for n, line in enumerate(sys.stdin):
        request = json.loads(line)
        key = request["key"]
        if key == "__fixtures__":
            res = run_forked(lambda: (make_fixtures(), result("correct"))[1], 300, logs / "fixtures.log")
        else:
            c = by_key[key]
            res = run_forked(lambda c=c: run_case(c), c.timeout * request["scale"], logs / f"{kind}-{n:03d}.log")
        chan.write(json.dumps({"key": key, **res}) + "\n")


class Server:
    def __init__(self, kind: str, env: dict):
        env = dict(env)
        if kind == "interp":
            env["TRITON_INTERPRET"] = "1"
        self.kind = kind
        self.proc = subprocess.Popen([sys.executable, __file__, "--server", kind], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        self.ready = json.loads(self._line(600))

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the {self.kind} case server stopped (exit {self.proc.poll()})")
        return line

    def run(self, key: str, timeout: float, scale: float) -> dict:
        self.proc.stdin.write(json.dumps({"key": key, "scale": scale}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line(timeout * scale + 120))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _versions() -> dict:
    out = subprocess.run([sys.executable, "-c", "import json, torch, triton, transformers, numpy; print(json.dumps("
                          "{'torch': torch.__version__, 'triton': triton.__version__, "
                          "'transformers': transformers.__version__, 'numpy': numpy.__version__}))"],
                         capture_output=True, text=True)
    versions = json.loads(out.stdout) if out.returncode == 0 else {}
    return {"python": platform.python_version(), **versions}


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} logical CPUs)"


def print_table(rows: list[dict], width: int = 170) -> None:
    print(f"{'group':<14} {'class':<15} case / note")
    for r in rows:
        line = f"{r['group']:<14} {r['class']:<15} {r['name']}"
        if r.get("note"):
            line += f"  | {r['note']}"
        print(line[:width])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="leave out the slow cases (training runs, signals, lm-eval)")
    ap.add_argument("--only", nargs="+", choices=sorted(GROUPS), help="run these groups only")
    ap.add_argument("--match", default=None, help="run the cases whose name holds this text")
    ap.add_argument("--out", default=None, help="write every result to this JSON file")
    ap.add_argument("--jobs", type=int, default=2, choices=(1, 2),
                    help="2: the PyTorch and the interpreter servers run side by side")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every case's timeout")
    ap.add_argument("--keep-work", action="store_true", help="keep the scratch folder (its path is printed)")
    ap.add_argument("--list", action="store_true", help="list the cases and stop")
    ap.add_argument("--server", choices=("torch", "interp"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.server:
        serve(args.server)
        return
    cases = [c for c in CASES if (not args.quick or c.quick) and (not args.only or c.group in args.only)
             and (args.match is None or args.match in c.name)]
    if args.list:
        for c in cases:
            print(f"{c.group:<14} {c.name}")
        print(f"{len(cases)} cases")
        return
    from tqdm import tqdm

    scratch = Path(tempfile.mkdtemp(prefix="fox-probe-"))
    env = dict(os.environ, FOX_PROBE_WORK=str(scratch), PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    if args.jobs > 1:
        env["FOX_PROBE_THREADS"] = "1"
    start = time.monotonic()
    results: dict[str, dict] = {}
    by_server = {kind: [c for c in cases if GROUPS[c.group] == kind] for kind in ("torch", "interp")}
    bar = tqdm(total=len(cases), unit="case", dynamic_ncols=True, mininterval=1.0)
    lock = threading.Lock()

    def drive(kind: str) -> None:
        todo = by_server[kind]
        if not todo:
            return
        try:
            server = Server(kind, env)
            if kind == "torch" and any(c.group in ("train", "eval") for c in todo):
                server.run("__fixtures__", 300, 1.0)
            for c in todo:
                with lock:
                    bar.set_postfix_str(f"{c.group}: {c.name}"[:60], refresh=False)
                res = server.run(c.key, c.timeout, args.timeout_scale)
                with lock:
                    results[c.key] = res
                    bar.update()
            server.close()
        except Exception as e:  # noqa: BLE001 - a server that died: the rest of its cases are recorded
            for c in todo:
                results.setdefault(c.key, result("crash", f"case server stopped: {e}"))

    threads = [threading.Thread(target=drive, args=(kind,)) for kind in ("interp", "torch")]
    if args.jobs > 1:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for t in threads:
            t.start()
            t.join()
    bar.close()
    rows = [{"group": c.group, "name": c.name, "expect": c.expect, **results[c.key]} for c in cases]
    print_table(rows)
    counts = Counter(r["class"] for r in rows)
    by_group = {g: dict(Counter(r["class"] for r in rows if r["group"] == g)) for g in GROUPS
                if any(r["group"] == g for r in rows)}
    seconds = time.monotonic() - start
    print()
    for g, cnt in by_group.items():
        print(f"{g:<14} " + ", ".join(f"{k}: {cnt[k]}" for k in CLASSES if k in cnt))
    print(f"{len(rows)} cases in {seconds / 60:.1f} min: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in CLASSES))
    if args.out:
        report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": _cpu(),
                  "platform": platform.platform(), "versions": _versions(), "quick": args.quick,
                  "seconds": round(seconds, 1), "counts": {k: counts.get(k, 0) for k in CLASSES},
                  "by_group": by_group, "cases": rows}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    if args.keep_work:
        print(f"scratch folder: {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
