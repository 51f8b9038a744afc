"""The switches that steer the GPU kernels, in one object: ``KernelOptions``.

Calls that pass no ``options=`` take ``current_options()``: those of the innermost ``kernel_options(...)``
block, else the environment's ``FOX_KERNEL_*`` variables, read once, at the first call (see the table in
the package README). The options change how the Triton and Gluon kernels compute, never what: every
setting gives the same results up to rounding (the two-pass backward's are bit-reproducible), except
that ``check_gates`` turns the NaN rows after a gate of exactly 0 in a CUDA decoding cache into an error.

``TRITON_INTERPRET`` is not an option: Triton reads it when a kernel is defined, so it is read here once,
at import (``INTERPRET``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import os
from collections.abc import Iterator, Mapping

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""The Triton kernels run through the interpreter (CPU tensors, float32), as Triton decided at import."""


class FixedRows(enum.IntEnum):
    """How the Triton forward takes its fixed softmax bound (see ``KernelOptions.fixed_rows``)."""

    TILE = 0
    """One bound per query tile, folded into the column term."""
    ROW = 1
    """One bound per row (one more tile op per block)."""
    TILE_OR_ROW = 2
    """Per tile where that is tight enough, else per row (a run-time branch per tile)."""


BACKWARD_MODES = ("two-pass", "fused")
LAUNCH_ORDERS = ("heads", "blocks")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Switches of the CUDA kernels (on the CPU the PyTorch path ignores them). Each field's environment
    variable, in brackets, is its default source; ``None`` means "the tuned default for the shape"."""

    gluon: bool = True
    """[FOX_KERNEL_GLUON=0|1] Run the Gluon kernels where they apply (sm90, 16-bit, D 64 or 128, fixed-length
    batches without ``seq_start`` or a window); off keeps the Triton kernels everywhere."""
    backward: str = "two-pass"
    """[FOX_KERNEL_BACKWARD=two-pass|fused] ``two-pass``: a dK/dV pass then a dQ pass, each output owned by one
    program (bit-reproducible). ``fused``: one pass adding dQ in with atomics (not reproducible; slower at
    most shapes). ``torch.use_deterministic_algorithms(True)`` forces two passes."""
    fixed_bound: bool = True
    """[FOX_KERNEL_FIXED_BOUND=0|1] Let the forward run query tiles against a fixed softmax bound (no running
    maximum) where the bound is tight enough; off runs the online softmax everywhere. float16 never uses it."""
    fixed_rows: FixedRows | None = None
    """[FOX_KERNEL_FIXED_ROWS=0|1|2] How the Triton forward takes that bound (``FixedRows``); None: per tile
    or per row (2) above head dim 64, per tile (0) up to it."""
    tma: bool = True
    """[FOX_KERNEL_TMA=0|1] Tensor-memory-accelerator tile loads in the Triton kernels on Hopper."""
    order_fwd: str | None = None
    """[FOX_KERNEL_ORDER_FWD=heads|blocks] Launch order of the Triton forward: every head's heaviest query
    blocks first (heads), or one head's blocks together (blocks); None: by shape."""
    order_dkdv: str | None = None
    """[FOX_KERNEL_ORDER_DKDV=heads|blocks] Launch order of the Triton dK/dV pass; None: by shape."""
    order_dq: str | None = None
    """[FOX_KERNEL_ORDER_DQ=heads|blocks] Launch order of the Triton dQ pass; None: blocks."""
    check_gates: bool = False
    """[FOX_KERNEL_CHECK_GATES=0|1] Read CUDA gates as CPU ones are read, at one wait for the GPU per call
    (not while compiling or capturing a CUDA graph): the decoding calls refuse gates of exactly 0 (log gate
    -inf) in gates and caches (a cache of prefix sums cannot hold one); ``forgetting_attention`` refuses log
    gates above 0, and gates of exactly 0 where ``zero_gates=False`` promises none (it is exact with such
    gates otherwise). Off, CUDA inputs are not read and such decoding rows come out NaN."""
    torch_path: bool = False
    """[FOX_KERNEL_TORCH_PATH=0|1] Run CUDA (and interpreter) calls of ``forgetting_attention`` on the chunked
    PyTorch path instead of the kernels: slower, the same math."""

    def __post_init__(self):
        for name in ("gluon", "fixed_bound", "tma", "check_gates", "torch_path"):
            if not isinstance(getattr(self, name), bool):  # a string "false" would read as on
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.backward not in BACKWARD_MODES:
            raise ValueError(f"backward must be one of {BACKWARD_MODES}, got {self.backward!r}")
        if self.fixed_rows is not None:
            rows = self.fixed_rows
            if isinstance(rows, bool) or not isinstance(rows, int) or rows not in tuple(FixedRows):
                raise ValueError(f"fixed_rows must be None or one of {[int(r) for r in FixedRows]} (FixedRows), "
                                 f"got {rows!r}")
            object.__setattr__(self, "fixed_rows", FixedRows(rows))
        for name in ("order_fwd", "order_dkdv", "order_dq"):
            value = getattr(self, name)
            if value is not None and value not in LAUNCH_ORDERS:
                raise ValueError(f"{name} must be None or one of {LAUNCH_ORDERS}, got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelOptions:
        """The options set by ``FOX_KERNEL_*`` variables of ``environ`` (default ``os.environ``); an unset
        variable keeps its field's default, a bad value raises naming the variable."""
        env = os.environ if environ is None else environ
        values = {}
        for field in dataclasses.fields(cls):
            if _ENV_NAMES[field.name] in env:
                values[field.name] = read_env(env, _ENV_NAMES[field.name], _PARSERS[field.name],
                                              _ENV_VALUES[field.name])
        return cls(**values)

    def replace(self, **changes) -> KernelOptions:
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"KernelOptions has no field {', '.join(unknown)}; its fields: "
                            f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)

    @property
    def key(self) -> str:
        """The options as one string (their environment form), to pass through a torch.library op."""
        return ";".join(f"{_ENV_NAMES[f.name]}={_format(getattr(self, f.name))}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) is not None)

    @staticmethod
    def from_key(key: str) -> KernelOptions:
        """The inverse of ``key``; the empty string gives ``current_options()``."""
        return _from_key(key) if key else current_options()


def read_env(env: Mapping[str, str], name: str, parse, allowed: str, default=None):
    """``parse(env[name])``, or ``default`` where ``name`` is unset; a value ``parse`` refuses (ValueError)
    raises ValueError naming the variable and the ``allowed`` values."""
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"{name} must be {allowed}, got {raw!r}") from None


def parse_bool(raw: str) -> bool:
    """A "0" or "1" as a bool (a ValueError for anything else)."""
    if raw not in ("0", "1"):
        raise ValueError(raw)
    return raw == "1"


def _parse_choice(choices):
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(raw)
        return raw
    return parse


def _format(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    return str(int(value)) if isinstance(value, FixedRows) else str(value)


_ENV_NAMES = {
    "gluon": "FOX_KERNEL_GLUON", "backward": "FOX_KERNEL_BACKWARD", "fixed_bound": "FOX_KERNEL_FIXED_BOUND",
    "fixed_rows": "FOX_KERNEL_FIXED_ROWS", "tma": "FOX_KERNEL_TMA", "order_fwd": "FOX_KERNEL_ORDER_FWD",
    "order_dkdv": "FOX_KERNEL_ORDER_DKDV", "order_dq": "FOX_KERNEL_ORDER_DQ",
    "check_gates": "FOX_KERNEL_CHECK_GATES", "torch_path": "FOX_KERNEL_TORCH_PATH",
}
_PARSERS = {
    "gluon": parse_bool, "backward": _parse_choice(BACKWARD_MODES), "fixed_bound": parse_bool,
    "fixed_rows": lambda raw: FixedRows(int(_parse_choice(("0", "1", "2"))(raw))), "tma": parse_bool,
    "order_fwd": _parse_choice(LAUNCH_ORDERS), "order_dkdv": _parse_choice(LAUNCH_ORDERS),
    "order_dq": _parse_choice(LAUNCH_ORDERS), "check_gates": parse_bool, "torch_path": parse_bool,
}
_ENV_VALUES = {
    "gluon": "0 or 1", "backward": " or ".join(BACKWARD_MODES), "fixed_bound": "0 or 1", "fixed_rows": "0, 1 or 2",
    "tma": "0 or 1", "order_fwd": "heads or blocks", "order_dkdv": "heads or blocks", "order_dq": "heads or blocks",
    "check_gates": "0 or 1", "torch_path": "0 or 1",
}

_overrides: list[KernelOptions] = []


@functools.lru_cache(maxsize=64)
def _from_key(key: str) -> KernelOptions:
    return KernelOptions.from_env(dict(item.split("=", 1) for item in key.split(";")))


@functools.cache
def _environment_options() -> KernelOptions:
    return KernelOptions.from_env()


def current_options() -> KernelOptions:
    """The options of a call that passes none: the innermost ``kernel_options`` block's, else the
    environment's (read at the first call)."""
    return _overrides[-1] if _overrides else _environment_options()


@contextlib.contextmanager
def kernel_options(options: KernelOptions | None = None, **changes) -> Iterator[KernelOptions]:
    """Within the block, calls that pass no ``options=`` use ``options`` (default: the current ones) with
    ``changes`` applied, e.g. ``with kernel_options(backward="fused"): ...``. The setting is global to the
    process (not per thread); a backward runs with the options of its forward call."""
    if options is not None and not isinstance(options, KernelOptions):
        raise TypeError(f"options must be None or a fox_kernel.KernelOptions, got {type(options).__name__}")
    chosen = (options or current_options()).replace(**changes)
    _overrides.append(chosen)
    try:
        yield chosen
    finally:
        _overrides.pop()
