"""The Gluon kernels (Hopper, warp-specialised): ``fwd``, ``bwd`` and what they share (``common``), their
tiles (``tiles``) and launchers (``host``). Gluon is experimental and not in every Triton build: only
``available()`` and ``tiles`` may be imported without it."""

from __future__ import annotations

import functools


@functools.cache
def available() -> bool:
    """Whether this Triton has a (usable) Gluon: the kernel modules import."""
    try:
        from fox_kernel.ops.gluon import bwd, fwd  # noqa: F401
    except Exception:  # ImportError, or an older Gluon API
        return False
    return True
