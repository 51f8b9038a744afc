"""Which activations does torch.compile keep for one block's backward? (CPU; no GPU needed)

Traces one decoder block of each model through AOTAutograd with inductor's partitioner (the min-cut
rematerialisation that compiled training uses) and lists the tensors the forward hands to the backward,
in units of one (T, hidden) bf16 tensor. Weights (T-independent) are listed apart. The graphs are not
compiled to kernels, so this runs on the CPU in seconds; the attention is an opaque op either way, so the
CPU trace keeps what the GPU one keeps (checked against GPU peak memory in session 19).

    python packages/fox-train/benchmarks/saved_activations.py --seq-len 1000 --out saved.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._functorch.aot_autograd import aot_module_simplified
from transformers import AutoModelForCausalLM

import fox_models  # noqa: F401
from fox_models.presets import get_preset

FAMILIES = {"FoX (Pro)": "fox-pro", "FoX (LLaMA)": "fox-llama", "Transformer (Pro)": "transformer-pro",
            "Transformer (LLaMA)": "transformer-llama"}


def saved_tensors(family: str, size: str, seq_len: int, memory_budget: float | None = None):
    """(name, shape, dtype, bytes, op) of every tensor the compiled block's forward keeps for its backward
    (and its outputs), for one sequence of ``seq_len`` tokens under bf16 autocast."""
    import torch._functorch.config as functorch_config

    config = get_preset(f"{family}-{size}", num_hidden_layers=1)
    torch.manual_seed(0)
    block = AutoModelForCausalLM.from_config(config).model.layers[0]
    if any(seq_len in p.shape for p in block.parameters()):
        raise ValueError(f"seq_len {seq_len} equals a weight dimension of {family}-{size}: pick another length")
    found = []

    def forward_compiler(gm, example_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        for node in out:
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(val, torch.Tensor):
                found.append((node.name, tuple(val.shape), str(val.dtype).removeprefix("torch."),
                              val.numel() * val.element_size(), str(node.target)))
        return make_boxed_func(gm)

    def backend(gm, example_inputs):
        partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler,
                                     bw_compiler=lambda gm, _: make_boxed_func(gm), partition_fn=partition)

    old_budget = functorch_config.activation_memory_budget
    functorch_config.activation_memory_budget = 1.0 if memory_budget is None else memory_budget
    try:
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=backend)
        x = torch.randn(1, seq_len, config.hidden_size, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    finally:
        functorch_config.activation_memory_budget = old_budget
    return config, found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--size", default="125m")
    ap.add_argument("--seq-len", type=int, default=1000, help="tokens; not a weight dimension of the model")
    ap.add_argument("--memory-budget", type=float, default=None, help="inductor's activation_memory_budget")
    ap.add_argument("--out", default="saved_activations.json")
    args = ap.parse_args()
    result = {}
    for name in args.models:
        config, rows = saved_tensors(FAMILIES[name], args.size, args.seq_len, args.memory_budget)
        unit = args.seq_len * config.hidden_size * 2
        per_token = lambda shape: args.seq_len in shape  # no weight has a T-long axis (checked above)
        acts = [r for r in rows if per_token(r[1])]
        print(f"\n{name} ({args.size}, T={args.seq_len}): one unit = (T, hidden) in bf16 = {unit / 2**20:.2f} MiB")
        for r in acts:
            print(f"  {r[0]:28s} {str(r[1]):22s} {r[2]:9s} {r[3] / unit:6.2f}  {r[4]}")
        total = sum(r[3] for r in acts) / unit
        weights = sum(r[3] for r in rows if not per_token(r[1])) / 2**20
        print(f"  per-token tensors: {total:.2f} units (the block's input and output included); weights and "
              f"other T-independent tensors: {weights:.1f} MiB")
        result[name] = dict(units=total, weight_mib=weights, unit_bytes=unit,
                            tensors=[dict(name=r[0], shape=r[1], dtype=r[2], bytes=r[3], op=r[4]) for r in rows])
    env = dict(torch=torch.__version__, size=args.size, seq_len=args.seq_len, memory_budget=args.memory_budget)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, models=result), f, indent=1)


if __name__ == "__main__":
    main()
