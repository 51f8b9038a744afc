"""The PTX of fox-kernel's GPU kernels from two source trees, compiled for Hopper (sm90) on any machine,
no GPU needed: whether a change meant to leave the generated code alone (a shared helper, a renamed
argument, a moved function) does so for every kernel.

Each tree is imported in a fresh process (``decode_trees_ab.run_tree``) that stands in an sm90 driver for
Triton's and turns every launch into Triton's compile-only ``warmup``, as ``tests/test_gluon_compile.py``
does. The process then runs the host launchers as the dispatcher calls them, on CPU tensors: the Gluon
forward (fixed softmax bound, online softmax, "auto" pruning) and backward (two passes, and the one pass
where it exists), the Triton forward and backward (exact, a threshold, a sliding window), and the norms'
own kernel (maxima and per-row norms), at both head dims. Every compiled kernel's PTX is kept without its
debug lines (``.loc``, ``.file`` and the ``.debug_*`` sections, which name source lines that move with any
edit). A kernel is told apart by its constexprs and the arguments given as None; where a change added or
dropped a constexpr, the same kernel's compilations are paired in compile order. Prints which kernels
differ and writes JSON with each kernel's hash and line count. With
``--dump DIR`` each tree's PTX is also written there, and for each kernel that differs the script counts the
lines that still differ once registers and labels are renamed alike (a few: the same instructions in
another order or with one more; many: other code).

    git archive <commit> packages/fox-kernel/src | tar -x -C before
    python packages/fox-kernel/benchmarks/ptx_trees_ab.py --before before/packages/fox-kernel/src \\
        --out ptx-trees-ab.json
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import re
import sys
from pathlib import Path

from decode_trees_ab import run_tree

HERE = Path(__file__).resolve()
_DEBUG_LINE = re.compile(r"^\s*(\.(loc|file)\b|\$L__tmp\d+:)")  # the labels only the debug sections name
_DEBUG_SECTION = re.compile(r"^\s*\.section\s+\.debug")
# registers, branch labels and the register counts of the .reg lines, each renamed alike
_RENAMES = ((re.compile(r"%([a-z]+)\d+"), r"%\1"), (re.compile(r"\$L__BB\d+_\d+"), "$L"), (re.compile(r"<\d+>"), "<>"))


def renamed_changes(before: str, after: str) -> int:
    """Lines of ``after`` that differ from ``before`` (either side of each changed stretch, the longer),
    with every register and label renamed alike (and the register counts of the ``.reg`` lines dropped)."""
    def plain(text):
        lines = text.splitlines()
        for pattern, name in _RENAMES:
            lines = [pattern.sub(name, line) for line in lines]
        return lines

    matcher = difflib.SequenceMatcher(None, plain(before), plain(after), autojunk=False)
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal")


def code_lines(ptx: str) -> list[str]:
    """The PTX without what names source lines: ``.loc`` and ``.file`` directives, the ``$L__tmp`` labels
    that only the debug sections name, and those ``.debug_*`` sections (from the first one to the end:
    Triton writes them last)."""
    lines = []
    for line in ptx.splitlines():
        if _DEBUG_SECTION.match(line):
            break
        if not _DEBUG_LINE.match(line):
            lines.append(line.rstrip())
    return lines


class Sm90Driver:
    """The driver Triton's JIT asks for the device, stream and target: an sm90 GPU never launched on (also
    ``tests/test_gluon_compile.py``'s). Kept here, not in fox_kernel, so that a worker can run any tree."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self):
        return True


def worker(dump: Path | None = None) -> None:
    """Compile every kernel of the calls above in this process; one JSON line: {kernel(constexprs): (hash,
    lines, file name under ``dump``)} (with the positions of the arguments given as None after the
    constexprs) and where fox_kernel was imported from. ``dump``: also write each kernel's PTX (without debug
    lines) there, one file per kernel, numbered in compile order."""
    import torch
    import torch.nn.functional as F
    from triton.runtime import driver

    import fox_kernel
    from fox_kernel.ops.call import AttentionCall
    from fox_kernel.ops.gluon import host
    from fox_kernel.ops.gluon.tiles import GLUON_ONE_PASS_DIMS
    from fox_kernel.ops.triton import bwd, fwd, launch, norms, sums
    from fox_kernel.options import KernelOptions

    seen = {}

    def compile_only(kernel, grid, *args, **kwargs):
        compiled = kernel.run(*args, grid=grid, warmup=True, **{**launch.LAUNCH_OPTIONS, **kwargs})
        lines = code_lines(compiled.asm["ptx"])
        constexprs = ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if k[:1].isupper())
        # arguments given as None specialise the kernel as much as a constexpr does
        nones = ",".join(str(i) for i, arg in enumerate(args) if arg is None)
        key = f"{kernel.fn.__name__}({constexprs})" + (f" None at {nones}" if nones else "")
        if key not in seen:
            name = f"{len(seen) + 1:03d}-{kernel.fn.__name__}.ptx"
            seen[key] = (hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16], len(lines), name)
            if dump is not None:
                (dump / name).write_text("\n".join(lines) + "\n")

    driver.set_active(Sm90Driver())
    launch.run = compile_only
    launch.sm_count = lambda device: 132  # an H100's or H200's
    for D in (64, 128):
        g = torch.Generator().manual_seed(D)
        B, T, H, Hkv = 1, 1000, 4, 2  # a partial last block and GQA
        q = torch.randn(B, T, H, D, generator=g).bfloat16()
        k, v = (torch.randn(B, T, Hkv, D, generator=g).bfloat16() for _ in range(2))
        log_fgate = F.logsigmoid(torch.randn(B, T, H, generator=g) + 4)
        do = torch.randn(q.shape, generator=g).bfloat16()
        exact = AttentionCall(D**-0.5, options=KernelOptions(), zero_gates=False)
        pruned = AttentionCall(D**-0.5, options=KernelOptions(), zero_gates=False, auto_log_eps=-10.0)
        for call, fixed in ((exact, True), (exact, False), (pruned, True)):
            out, lse, threshold, (c, _, _) = host.forward(q, k, v, log_fgate, call, fixed)
        backward_call = AttentionCall(D**-0.5, options=KernelOptions(), zero_gates=False, threshold=threshold)
        for one_pass in (False, True) if D in GLUON_ONE_PASS_DIMS else (False,):
            host.backward(do, q, k, v, c, lse, out, backward_call, one_pass)
        c = sums.prefix_sums(log_fgate, None)
        thresholds = torch.full((B, H), -5.0)
        for call in (exact, AttentionCall(D**-0.5, options=KernelOptions(), zero_gates=False, threshold=thresholds),
                     AttentionCall(D**-0.5, options=KernelOptions(), zero_gates=False, window=300)):
            out, lse, _ = fwd.forward(q, k, v, c, call, True)
            bwd.backward(do, q, k, v, c, lse, sums.delta(out, do), call, False)
        norms.max_sq_row_norms(q, k)
        norms.max_sq_row_norms(k, per_row=True)
    print(json.dumps({"fox_kernel": str(Path(fox_kernel.__file__).parent), "kernels": seen}))


def pairs(before: dict, after: dict) -> list[tuple[str | None, str | None]]:
    """(before's key, after's key) of each kernel compiled: the same kernel with the same constexprs; else,
    where a change added or dropped a constexpr, the same kernel's unmatched compilations paired in compile
    order (the order of the dicts); a compilation with no partner pairs with None."""
    matched = [(key, key) for key in before if key in after]
    left = [key for key in before if key not in after]
    right = [key for key in after if key not in before]
    for name in dict.fromkeys(key.split("(")[0] for key in left + right):
        lone_b = [key for key in left if key.split("(")[0] == name]
        lone_a = [key for key in right if key.split("(")[0] == name]
        if len(lone_b) != len(lone_a):
            print(f"note: {name} compiled {len(lone_b)} times only before and {len(lone_a)} times only after; "
                  "paired in compile order")
        for i in range(max(len(lone_b), len(lone_a))):
            matched.append((lone_b[i] if i < len(lone_b) else None, lone_a[i] if i < len(lone_a) else None))
    return matched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, help="the other tree's fox-kernel src folder")
    ap.add_argument("--out", default="ptx-trees-ab.json")
    ap.add_argument("--dump", type=Path, help="write every kernel's PTX under DUMP/before and DUMP/after")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.dump)
        return
    if args.before is None or not (args.before / "fox_kernel").is_dir():
        raise SystemExit(f"{HERE.name}: --before must be a folder holding fox_kernel/, got {args.before}")
    trees = {"before": args.before.resolve(), "after": HERE.parents[1] / "src"}
    runs = {}
    for name, src in trees.items():
        dump = [] if args.dump is None else ["--dump", str((args.dump / name).resolve())]
        if dump:
            Path(dump[1]).mkdir(parents=True, exist_ok=True)
        runs[name] = run_tree(src, HERE, *dump)
    before, after = runs["before"]["kernels"], runs["after"]["kernels"]
    rows = []
    for key_b, key_a in sorted(pairs(before, after), key=lambda p: p[1] or p[0]):
        b, a = before.get(key_b), after.get(key_a)
        state = "only before" if a is None else "only after" if b is None else "same" if a[0] == b[0] else "differs"
        row = {"kernel": key_a or key_b, "state": state, "before": b, "after": a}
        if key_a and key_b and key_a != key_b:
            row["kernel before"] = key_b
        if state == "differs" and args.dump is not None:
            texts = [(args.dump / name / entry[2]).read_text() for name, entry in (("before", b), ("after", a))]
            row["changed_lines_renamed"] = renamed_changes(*texts)
        rows.append(row)
        extra = f" ({row['changed_lines_renamed']} of {a[1]} lines with registers renamed)" \
            if "changed_lines_renamed" in row else ""
        if "kernel before" in row:
            extra += f"; before: {key_b[:150]}"
        print(f"{state:12s} {row['kernel'][:150]}{extra}")
    counts = {s: sum(r["state"] == s for r in rows) for s in ("same", "differs", "only before", "only after")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    import triton

    Path(args.out).write_text(json.dumps({"triton": triton.__version__, "target": "cuda sm90",
                                          "trees": {k: runs[k]["fox_kernel"] for k in runs}, "counts": counts,
                                          "kernels": rows}, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
