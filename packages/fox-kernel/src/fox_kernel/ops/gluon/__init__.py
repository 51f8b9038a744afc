"""The Gluon kernels (Hopper, warp-specialised): ``fwd``, ``bwd`` and what they share (``common``), their
tiles (``tiles``) and launchers (``host``). Gluon is experimental and not in every Triton build: only
``available()``, ``give_up()`` and ``tiles`` may be imported without it."""

from __future__ import annotations

import functools
import re
import warnings

# The oldest Triton whose Gluon these kernels are written for: 3.5's ``warp_specialize`` takes its
# partitions in another form. Releases from 3.6 to 3.9 are compiled for sm90 in tests/test_gluon_compile.py
# (the names that moved between them are picked in ``common``).
MIN_TRITON = (3, 6)

_failure: str | None = None  # why the Gluon kernels were given up in this process (``give_up``)


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton."""
    import triton

    return tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])


@functools.cache
def _usable() -> bool:
    """At least MIN_TRITON, and the kernel modules import (asked once: the dispatcher asks on every call)."""
    if triton_version() < MIN_TRITON:
        return False
    try:
        from fox_kernel.ops.gluon import bwd, fwd  # noqa: F401
    except Exception:  # ImportError, or an older Gluon API
        return False
    return True


def available() -> bool:
    """Whether this Triton has a usable Gluon: at least MIN_TRITON, the kernel modules import, and no Gluon
    kernel has failed to compile in this process."""
    return _failure is None and _usable()


def give_up(error: Exception) -> None:
    """Turns the Gluon kernels off for the rest of the process after one failed to compile (a Triton whose
    Gluon has moved past these kernels): the calls take the Triton kernels, and one warning says why."""
    global _failure
    if _failure is None:
        import triton

        _failure = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}"
        warnings.warn(f"fox_kernel: a Gluon kernel failed to compile with Triton {triton.__version__} "
                      f"({_failure}); using the Triton kernels from here on", RuntimeWarning, stacklevel=3)
