"""How the Triton passes are launched: tile shapes per pass and GPU, launch order, TMA descriptors, and
launches that skip Triton's per-call work once a specialisation has been launched (``run``)."""

from __future__ import annotations

import functools
import os

import torch
import triton

from fox_kernel.options import INTERPRET, KernelOptions, parse_bool, read_env

# Tile shapes per pass, from benchmarks/tune_tiles.py on an H200 (sm90, torch 2.11, triton 3.6, T=16k;
# the forward's swept with the fixed softmax bound, six tiles per head dim, fixed-bound-h200-s6.json);
# sm80 gets them with narrower key tiles and two stages (less shared memory); older GPUs, fp32 and
# D > 128 get small, safe tiles.
TILES = {
    "fwd": {64: dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
            128: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)},
    "dkdv": {64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
             128: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)},
    # D=64 dQ: 64x64 with three stages (backward 11.64 -> 10.65 ms at H=32, T=16k; backward-tiles-h200-s9.json)
    "dq": {64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
           128: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)},
    # the one-pass backward (dK/dV program adding dQ in with atomics)
    "fused": {64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
              128: dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3)},
}
SAFE_TILES = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)


@functools.cache
def _sm_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def sm_major(device: torch.device) -> int:
    """The compute capability's major number of a CUDA device, asked of the driver once per device (each
    launch asks it several times)."""
    return _sm_major(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The number of SMs of a CUDA device, asked of the driver once per device."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Triton's ``cdiv`` and ``next_power_of_2`` are constexpr functions whose every host call goes through
# Triton's JIT (1.5 us a call on a CPU host, Triton 3.6 and 3.9); the launchers call these plain ones, the
# same numbers (tests/test_launch.py checks them against Triton's).
def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` as ``triton.cdiv`` computes it."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 at least ``n`` (n >= 0; 0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


def block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def config(kind: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tiles and launch options of pass ``kind`` ("fwd", "dkdv", "dq" or "fused")."""
    bd = block_d(head_dim)
    if INTERPRET or device.type != "cuda":
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_D=bd, num_warps=4, num_stages=1)
    major = sm_major(device)
    if major < 8 or dtype == torch.float32 or bd > 128:
        cfg = dict(SAFE_TILES)
        if bd <= 128 and major >= 8:
            cfg["num_stages"] = 2
    else:
        cfg = dict(TILES[kind][max(64, bd)])
        if major == 8:  # A100-class shared memory: narrower key tiles, two stages
            cfg.update(BLOCK_N=min(cfg["BLOCK_N"], 64), num_stages=min(cfg["num_stages"], 2))
    cfg["BLOCK_D"] = bd
    return cfg


# Tiles of the passes that re-run what gates of exactly 0 change (fwd.forward_zero_gates,
# bwd.backward_zero_gates). On gates without a 0 every program reads one number and returns, and such
# programs cost what their registers and shared memory allow to run at once: lean tiles, one stage.
# On an H100 (bf16, no gate of 0, B=8 x 2k and 1 x 16k, D=64/128) the forward's pass took 27-40 us with
# 128x64 tiles against 65-200 us with the forward's tuned ones; the backward's 64x64 tiles matched or beat
# theirs, with and without gates of 0.
RERUN_TILES: dict[str, dict] = {
    "fwd": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=1),
    "dkdv": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1),
    "dq": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1),
}


def rerun_config(kind: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """``config(kind)`` for a zero-gate pass: RERUN_TILES where tiles are tuned (16-bit, sm80+)."""
    cfg = config(kind, head_dim, dtype, device)
    if cfg["BLOCK_D"] <= 128 and not INTERPRET and device.type == "cuda" and dtype != torch.float32:
        cfg.update(RERUN_TILES.get(kind, {}))
    return cfg


def use_tma(options: KernelOptions, *tensors) -> bool:
    """Tensor-memory-accelerator tile loads: Hopper (sm90+), 16-bit types, 16-byte aligned rows, unless
    ``options.tma`` is off (for comparison). Packed varlen batches keep the pointer loads (the callers'
    choice): with TMA, varlen outputs differed from each sequence run alone on an H200 (not yet understood)."""
    x0 = tensors[0]
    if not options.tma or INTERPRET or x0.device.type != "cuda":
        return False
    if sm_major(x0.device) < 9 or x0.dtype == torch.float32:
        return False
    size = x0.element_size()
    return all(
        x.stride(-1) == 1 and all((st * size) % 16 == 0 for st in x.stride()[:-1]) and x.data_ptr() % 16 == 0
        and x.shape[1] < 2**31
        for x in tensors
    )


def descriptors(tensors, block_rows, cfg, tma):
    """TMA descriptors of (B, T, H, D) tensors read in (block_rows, BLOCK_D) tiles; without ``tma``, None
    each (the kernels then read the tensors through pointers)."""
    if not tma:
        return [None] * len(tensors)
    from triton.tools.tensor_descriptor import TensorDescriptor

    return [TensorDescriptor(x, list(x.shape), list(x.stride()), [1, block_rows, 1, cfg["BLOCK_D"]]) for x in tensors]


MAX_GRID_YZ = 65535
"""CUDA's limit on a launch grid's second and third axes (the first takes up to 2^31 - 1 programs). ``run``
refuses a grid past it in one line; the launchers keep within it by choosing the axes (``grid``) or by
launching rows in parts (``row_parts``: ``sums.local_sums``, ``sums.delta``, ``decode.decode_eager``).
Tests lower it to reach those paths on small shapes."""


def check_grid(kernel, grid) -> None:
    """Raises ValueError, naming the kernel, where a tuple grid passes ``MAX_GRID_YZ`` on axis 1 or 2."""
    if len(grid) > 1 and max(grid[1:]) > MAX_GRID_YZ:
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", str(kernel))
        raise ValueError(f"{name}: launch grid {tuple(grid)} passes the {MAX_GRID_YZ:,} programs that CUDA allows "
                         "on grid axes 1 and 2")


def row_parts(n_rows: int, per_row: int) -> list[tuple[int, int]]:
    """(first, end) ranges of ``n_rows`` rows, each part at most ``MAX_GRID_YZ`` programs of ``per_row`` a
    row: the parts of a launch whose grid axis 1 counts rows times heads."""
    step = max(1, MAX_GRID_YZ // max(per_row, 1))
    return [(r0, min(n_rows, r0 + step)) for r0 in range(0, n_rows, step)]


def grid(kind, n_heads, n_blocks, order=None, head_dim=128, group=1):
    """Grid and launch order of a pass (see common.block_and_head): ``order`` "heads" or "blocks", None for
    the measured default. Measured on an H200 (T=16k/8k): the forward gains from all heads' heaviest
    blocks first at D <= 64 and with GQA (2-3%), loses at D=128 MHA; both backward passes lose with it
    (D=64 dK/dV up to 2x: Q/dO no longer shared in L2), except the dK/dV pass of GQA at D=128: a program
    there runs the whole group, so one group's heaviest programs, launched last, left a tail (fwd+bwd 1-8%
    faster heads first at four shapes on an H200, gqa-launch-order-h200-s10.json; at D=64 it was 3%
    slower at T=16k)."""
    if order is None:
        heads = (kind == "fwd" and (head_dim <= 64 or group > 1)) or (kind == "dkdv" and group > 1 and head_dim > 64)
        order = "heads" if heads else "blocks"
    heads_first = order == "heads"
    if (n_blocks if heads_first else n_heads) > MAX_GRID_YZ:  # the other axis order fits where this one does not
        heads_first = not heads_first
    return ((n_heads, n_blocks) if heads_first else (n_blocks, n_heads)), heads_first


def grid_rows(cu_seqlens, batch, length):
    """(programs along the batch axis, longest sequence) for the grid."""
    if cu_seqlens is None:
        return batch, length
    return cu_seqlens.numel() - 1, int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())


def scan() -> int:
    """Block bounds read per vector load when searching the pruned range (small in the interpreter, so
    tests cross several loads)."""
    return 4 if INTERPRET else 64


def precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def strides(x, n=3):
    """The first ``n`` strides of ``x``, one kernel argument (a tuple)."""
    return tuple(x.stride()[:n])


# Copies of the kernels that do not specialise on the sequence lengths, used when one of them is 1:
# Triton turns a length of 1 into a constant, and that made ptxas (Triton 3.6, sm90) crash on the dQ
# kernel. Other lengths keep the specialised kernels (not specialising cost 10-20% at T=16k).
_LENGTHS = ("Tq", "Tk")
_ANY_LENGTH = {}


def any_length(kernel, Tq, Tk):
    """``kernel``, or where a length is 1 its copy that does not specialise on the lengths."""
    if min(Tq, Tk) > 1:
        return kernel
    if kernel not in _ANY_LENGTH:
        _ANY_LENGTH[kernel] = triton.jit(do_not_specialize=_LENGTHS)(kernel.fn)
    return _ANY_LENGTH[kernel]


# Launches without Triton's per-call work. ``kernel[grid](...)`` binds the 10-50 arguments into a dict,
# specialises each, formats the launch options into a string for its cache key, checks the kernel's globals,
# reads four knobs and builds launch metadata for the (empty) launch hooks before the driver launches: 14 us a
# launch of the prefix-sums kernel on an H200 host, and a pruned forward+backward makes 7 launches through the
# Gluon kernels (``prologue.py``) and about a dozen through the Triton ones. ``run`` binds the same arguments
# with a function made once per kernel, keys the compiled kernel on every argument's specialisation (Triton's
# own ``native_specialize_impl``, asked for at least what Triton specialises on: a key at least as fine as
# Triton's, so a hit is the kernel Triton would launch) and the constexpr and launch-option values, and hands
# the arguments to the compiled kernel's launcher. A miss (the first launch of a specialisation) goes through
# ``kernel[grid](...)``, which compiles or finds the kernel and launches it. Off with
# ``FOX_KERNEL_CACHED_LAUNCH=0`` (read at import; ``CACHED`` for benchmarks), in the interpreter, while a
# launch hook is registered (a profiler's), and for good after a launcher refuses the arguments (a Triton
# whose launchers take others). Values other than 0 and 1 are refused at import, naming the variable.
CACHED = read_env(os.environ, "FOX_KERNEL_CACHED_LAUNCH", parse_bool, "0 or 1", default=True)
_BINDERS: dict[int, tuple] = {}  # id(kernel) -> (kernel, bind)
_COMPILED: dict[tuple, object] = {}


def make_binder(kernel, backend=None):
    """``bind(*args, **kwargs) -> (values in parameter order, specialisation key, launch options)`` of a
    Triton kernel, written as a Python function of the kernel's own signature (so Python binds the call).
    ``backend``: the compiler backend whose specialisation rules apply (default: the current GPU's)."""
    from triton._C.libtriton import native_specialize_impl

    if backend is None:
        from triton.compiler import make_backend
        from triton.runtime.driver import driver

        backend = make_backend(driver.active.get_current_target())
    names, keys, defaults = [], [], {}
    for p in kernel.params:
        name = p.name
        if p.has_default:
            defaults[f"default_{name}"] = p.default
            names.append(f"{name}=default_{name}")
        else:
            names.append(name)
        # constexprs by value; the others by their specialisation with everything on that Triton may
        # specialise (do_not_specialize only ever narrows Triton's key, so ours stays at least as fine)
        keys.append(name if p.is_constexpr else f"_spec(_backend, {name}, {p.is_const}, True, True)")
    params = ", ".join(p.name for p in kernel.params)
    source = (f"def bind({', '.join(names)}, **_options):\n"
              f"    return ({params},), ({', '.join(keys)},), tuple(_options.items())\n")
    scope = {"_spec": native_specialize_impl, "_backend": backend, **defaults}
    exec(source, scope)  # noqa: S102 (the source is built above from the kernel's parameter names)
    return scope["bind"]


@functools.cache
def _runtime():
    from triton import knobs
    from triton.runtime.driver import driver

    return driver.active.get_current_device, driver.active.get_current_stream, knobs.runtime


def _hooked(hook) -> bool:
    """Whether a launch hook would run: Triton keeps them in chains that are empty until a profiler adds
    one (older releases: None until set)."""
    return hook is not None and bool(getattr(hook, "calls", True))


# Options every launch passes. Fused multiply-adds stay on: Triton 3.9 warns that its default turns them off
# in 3.10, and the kernels are measured and checked with them.
LAUNCH_OPTIONS = dict(enable_fp_fusion=True)


def run(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` with LAUNCH_OPTIONS, through the compiled kernel's launcher once
    this specialisation has been launched (see above). While ``recording`` is on, each launch is also
    appended to its list, as a ``Recorded`` or, where it went through Triton's own path, as None."""
    global CACHED
    kwargs = {**LAUNCH_OPTIONS, **kwargs}
    if not callable(grid):
        check_grid(kernel, grid)
    if not CACHED or INTERPRET:
        kernel[grid](*args, **kwargs)
        _record(None)
        return
    entry = _BINDERS.get(id(kernel))
    if entry is None:
        # a kernel without a JIT function's parameters (an autotuner, say) always launches through Triton
        entry = _BINDERS[id(kernel)] = (kernel, make_binder(kernel) if hasattr(kernel, "params") else None)
    if entry[1] is None or callable(grid):  # a grid computed from the bound arguments: Triton's path
        kernel[grid](*args, **kwargs)
        _record(None)
        return
    values, spec, options = entry[1](*args, **kwargs)
    current_device, current_stream, knobs = _runtime()
    device = current_device()
    key = (id(kernel), device, spec, options)
    compiled = _COMPILED.get(key)
    if compiled is None or _hooked(knobs.launch_enter_hook) or _hooked(knobs.launch_exit_hook):
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # Triton's asynchronous compile mode returns a future
            compiled = compiled.result()
        if compiled is not None:
            _COMPILED[key] = compiled
        _record(None if compiled is None else Recorded(kernel, compiled, _grid3(grid), values))
        return
    grid3 = _grid3(grid)
    try:
        _launch(compiled, grid3, current_stream(device), values)
    except TypeError:  # the launcher parses its arguments before it launches anything
        CACHED = False
        kernel[grid](*args, **kwargs)
        _record(None)
        return
    _record(Recorded(kernel, compiled, grid3, values))


def _launch(compiled, grid3, stream, values) -> None:
    """Launches ``compiled`` through its launcher (no launch hooks), its arguments in parameter order."""
    compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)


def _grid3(grid) -> tuple[int, int, int]:
    n = len(grid)
    return grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1


# Recording and replaying launches: a host function whose launches are a function of a key it computes (the
# shapes, strides and options of its call: ``gluon/host.py``'s forward and backward) records them once through ``run``
# and then replays them with each later call's tensors put in their places, skipping its own Python, the
# binding and the specialisation key of every launch. ``run`` records a launch only where it went through
# the compiled kernel's launcher with a key at least as fine as Triton's (a None marks any other launch, so
# that such a call is not replayed), and replays skip Triton the same way ``run`` does: not while a launch
# hook is registered, and not after a launcher refused its arguments (``CACHED`` off).
class Recorded:
    """One launch as ``run`` made it: the kernel, its compiled form, the (x, y, z) grid and the arguments
    in the kernel's parameter order."""

    __slots__ = ("kernel", "compiled", "grid", "values")

    def __init__(self, kernel, compiled, grid: tuple[int, int, int], values: tuple):
        self.kernel, self.compiled, self.grid, self.values = kernel, compiled, grid, values


_RECORDING: list | None = None


class recording:
    """``with recording() as launches:`` appends each launch ``run`` makes inside (a ``Recorded``, or None for
    one that went through Triton's own path) to ``launches``. Not re-entrant."""

    def __enter__(self) -> list:
        global _RECORDING
        self.launches = _RECORDING = []
        return self.launches

    def __exit__(self, *exc) -> None:
        global _RECORDING
        _RECORDING = None


def _record(launch: Recorded | None) -> None:
    if _RECORDING is not None:
        _RECORDING.append(launch)


def slots_of(values: tuple, named: dict[int, str]) -> tuple[tuple[int, str], ...] | None:
    """(position, name) of each argument in ``values`` that is one of a call's tensors (``named``: id of
    the object -> its name), or None where an argument holds a buffer that is not named (a replay could
    not replace it)."""
    slots = []
    for i, value in enumerate(values):
        name = named.get(id(value))
        if name is not None:
            slots.append((i, name))
        elif hasattr(value, "data_ptr") or hasattr(value, "base"):  # tensors, TMA descriptors
            return None
    return tuple(slots)


def replayable() -> bool:
    """Whether recorded launches may be replayed now: cached launches on, no launch hook registered."""
    if not CACHED or INTERPRET:
        return False
    knobs = _runtime()[2]
    return not (_hooked(knobs.launch_enter_hook) or _hooked(knobs.launch_exit_hook))


def current_device() -> int:
    """The current CUDA device, as ``run`` keys its compiled kernels on it."""
    return _runtime()[0]()


def current_stream():
    """The current device's current stream, as ``run`` launches on it."""
    current_device, current_stream, _ = _runtime()
    return current_stream(current_device())


def replay(launch: Recorded, slots, tensors: dict, stream) -> None:
    """Launches ``launch`` again on ``stream`` with ``tensors[name]`` at each of its ``slots`` (``slots_of``)."""
    values = list(launch.values)
    for i, name in slots:
        values[i] = tensors[name]
    _launch(launch.compiled, launch.grid, stream, values)
