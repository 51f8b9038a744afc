"""Forward and forward+backward of two source trees of fox-kernel side by side on one GPU, with cuDNN SDPA:
this checkout and another (``--before``, e.g. ``git archive <commit> packages/fox-kernel/src | tar -x -C
before``), in interleaved rounds of fresh processes (``decode_trees_ab.run_tree``).

Each round times, at ``launch_groups_ab.SHAPES`` (bench_attention's quick cells and one 125M layer), ours
and cuDNN SDPA eagerly (``bench_attention._time``, the median of ``triton.testing.do_bench``), and where the
tree has the one-program-per-SM forward (``gluon.tiles.PERSISTENT``) also ours with one program per query
tile. Each
process first checks its forward and gradients against the float64 reference at a small shape. Prints the
medians over the rounds (and cuDNN's time over ours) and writes JSON with every round.

    python packages/fox-kernel/benchmarks/attention_trees_ab.py --before before/packages/fox-kernel/src \\
        --rounds 3 --out attention-trees-ab.json
"""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path

from decode_trees_ab import interleaved_rounds, save_rounds, tree_args

HERE = Path(__file__).resolve()


def worker() -> None:
    """One round in this process, printed as one JSON line."""
    import torch
    import triton
    from bench_attention import _inputs, _ours, _sdpa, _time
    from launch_groups_ab import SHAPES, _groups
    from torch.nn.attention import SDPBackend

    from fox_kernel.ops.gluon import tiles
    from fox_kernel.reference import forgetting_attention_ref
    from fox_kernel.testing import assert_close_to_reference

    torch.manual_seed(0)
    leaves = [x.detach().requires_grad_() for x in _inputs(2, 700, 4, 4, 64)]
    got = _ours()(*leaves)
    got = (got.detach(), *torch.autograd.grad(got, leaves, torch.ones_like(got)))
    refs = []
    for cast in (lambda x: x.double(), lambda x: x.clone()):  # float64, and the inputs' own types
        ref_leaves = [cast(x.detach()).requires_grad_() for x in leaves]
        ref = forgetting_attention_ref(*ref_leaves)
        refs.append((ref.detach(), *torch.autograd.grad(ref, ref_leaves, torch.ones_like(ref))))
    for name, a, e, s in zip(("out", "dq", "dk", "dv", "dlog_fgate"), got, *refs):
        assert_close_to_reference(a, e, s, name=name, factor=3.0)

    # (function, launch_groups_ab._groups' setting or None); one program per query tile where the tree
    # has the choice
    calls = {"ours": (_ours(), None), "cudnn": (_sdpa(SDPBackend.CUDNN_ATTENTION), None)}
    if hasattr(tiles, "PERSISTENT"):
        calls["ours per tile"] = (_ours(), "per-tile fwd")
    cells = {}
    for B, T, H, Hkv, D in SHAPES:
        args = _inputs(B, T, H, Hkv, D)
        for mode in ("fwd", "fwd+bwd"):
            for name, (fn, setting) in calls.items():
                with _groups(setting, None) if setting else contextlib.nullcontext():
                    cells[f"B={B} T={T} H={H}/{Hkv} D={D} {mode}|{name}"] = _time(fn, args, mode)
    print(json.dumps(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                          cells=cells)))


def main() -> None:
    args = tree_args(__doc__, 3, "attention-trees-ab.json").parse_args()
    if args.worker:
        return worker()
    rounds = interleaved_rounds(args, HERE, lambda last: f"{len(last['cells'])} cells")
    summary = {}
    print(f"{'cell':52} {'before ms':>9} {'after ms':>9} {'after/before':>12} {'cuDNN/after':>11}")
    for cell in rounds["after"][0]["cells"]:
        med = {name: statistics.median(r["cells"][cell] for r in runs)
               for name, runs in rounds.items() if cell in runs[0]["cells"]}
        summary[cell] = {f"{name}_ms": ms for name, ms in med.items()}
        case, name = cell.split("|")
        if name == "cudnn":
            continue
        cudnn = statistics.median(r["cells"][f"{case}|cudnn"] for r in rounds["after"])
        before = med.get("before", float("nan"))
        print(f"{case + ' ' + name:52} {before:9.3f} {med['after']:9.3f} {med['after'] / before:12.3f} "
              f"{cudnn / med['after']:11.3f}")
    save_rounds(args, rounds, summary)


if __name__ == "__main__":
    main()
