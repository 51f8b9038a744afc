"""Which activations does torch.compile keep for one block's backward? (CPU; no GPU needed)

Compiles one decoder block of each model with inductor for the CPU and lists the tensors that its
partitioned forward hands to the backward (after inductor's joint-graph passes and its min-cut
rematerialisation, as in compiled training), in units of one (T, hidden) bf16 tensor. Weights and other
T-independent tensors are summed apart. The attention is an opaque op on either device, so the CPU
graph keeps what the GPU one keeps, up to differences between torch versions (saved-activations-cpu-s19-125m.json:
the difference between FoX (Pro) and the Transformer (LLaMA) matched the H100's peak memory to 2%).

Inductor's CPU backend needs a C++ compiler.

    python packages/fox-train/benchmarks/saved_activations.py --seq-len 1000 --out saved.json
"""

from __future__ import annotations

import argparse
import json

import torch
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from transformers import AutoModelForCausalLM

import fox_models  # noqa: F401
from fox_models.presets import get_preset

FAMILIES = {"FoX (Pro)": "fox-pro", "FoX (LLaMA)": "fox-llama", "Transformer (Pro)": "transformer-pro",
            "Transformer (LLaMA)": "transformer-llama"}


def _has_token_axis(shape, seq_len: int) -> bool:
    """A T-long axis, or T + 1 (the token shift's concatenation)."""
    return seq_len in shape or seq_len + 1 in shape


def saved_tensors(family: str, size: str, seq_len: int, memory_budget: float | None = None):
    """(name, shape, dtype, bytes, op) of every tensor the compiled block's forward keeps for its backward
    (and its outputs), for one sequence of ``seq_len`` tokens under bf16 autocast."""
    import torch._functorch.config as functorch_config

    config = get_preset(f"{family}-{size}", num_hidden_layers=1)
    torch.manual_seed(0)
    block = AutoModelForCausalLM.from_config(config).model.layers[0]
    if any(_has_token_axis(p.shape, seq_len) for p in block.parameters()):
        raise ValueError(f"seq_len {seq_len} equals a weight dimension of {family}-{size}: pick another length")
    found = []

    def inner_compile(gm, example_inputs, **kwargs):
        if not kwargs.get("is_backward") and not found:  # the partitioned forward: outputs, then what it keeps
            out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            for node in out:
                val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
                if isinstance(val, torch.Tensor):
                    found.append((node.name, tuple(val.shape), str(val.dtype).removeprefix("torch."),
                                  val.numel() * val.element_size(), str(node.target)))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    # No cache: a cached graph skips inner_compile (and would bring an earlier run's partition).
    patches = dict(activation_memory_budget=1.0 if memory_budget is None else memory_budget, enable_autograd_cache=False)
    with torch._inductor.config.patch(fx_graph_cache=False), functorch_config.patch(**patches):
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=lambda gm, ex: compile_fx(gm, ex, inner_compile=inner_compile))
        x = torch.randn(1, seq_len, config.hidden_size, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    if not found:
        raise RuntimeError(f"{family}-{size}: inductor compiled no forward graph for the block")
    return config, found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--size", default="125m")
    ap.add_argument("--seq-len", type=int, default=1000, help="tokens; not a weight dimension of the model")
    ap.add_argument("--memory-budget", type=float, default=None, help="inductor's activation_memory_budget")
    ap.add_argument("--out", default="saved_activations.json")
    args = ap.parse_args()
    if args.memory_budget is not None and not 0 < args.memory_budget <= 1:
        ap.error(f"--memory-budget must be in (0, 1], got {args.memory_budget}")
    if args.seq_len < 1:
        ap.error(f"--seq-len must be positive, got {args.seq_len}")
    result = {}
    for name in args.models:
        config, rows = saved_tensors(FAMILIES[name], args.size, args.seq_len, args.memory_budget)
        unit = args.seq_len * config.hidden_size * 2
        acts = [r for r in rows if _has_token_axis(r[1], args.seq_len)]  # no weight has one (checked)
        print(f"\n{name} ({args.size}, T={args.seq_len}): one unit = (T, hidden) in bf16 = {unit / 2**20:.2f} MiB")
        for r in acts:
            print(f"  {r[0]:28s} {str(r[1]):22s} {r[2]:9s} {r[3] / unit:6.2f}  {r[4]}")
        total = sum(r[3] for r in acts) / unit
        weights = sum(r[3] for r in rows if not _has_token_axis(r[1], args.seq_len)) / 2**20
        print(f"  per-token tensors: {total:.2f} units (the block's input and output included); weights and "
              f"other T-independent tensors: {weights:.1f} MiB")
        result[name] = dict(units=total, weight_mib=weights, unit_bytes=unit,
                            tensors=[dict(name=r[0], shape=r[1], dtype=r[2], bytes=r[3], op=r[4]) for r in rows])
    env = dict(torch=torch.__version__, size=args.size, seq_len=args.seq_len, memory_budget=args.memory_budget)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, models=result), f, indent=1)


if __name__ == "__main__":
    main()
