"""``generate()`` speed of FoX against transformers' own Llama of the same width, depth and vocabulary.

For each model, batch size and prompt length: the prefill (one forward over the prompt that fills the
cache, median of ``--reps``), greedy decoding of ``--new-tokens`` tokens (tokens/s over the whole batch,
after the prefill), and the peak GPU memory of the whole generate() call. bf16 weights, random init
(speed does not depend on the values). Contenders:

- FoX (Pro), FoX (LLaMA) and the project's Transformer (LLaMA) (fox_models presets at ``--size``);
- ``LlamaForCausalLM`` (SDPA) with transformers' dynamic cache, and with its static cache (``--static``),
  for which generate() itself compiles the decoding step (transformers' default compile config);
- with ``--static`` also the FoX models with their static cache, whose decoding steps replay a CUDA graph
  (``fox_models.static_cache``): the step compiled first (generate()'s default on a GPU), and eager
  (``disable_compile=True``).

``--profile N`` also profiles one prefill of each row: its wall time against the time of the device
kernels it ran (a prefill much slower than its kernels waits on the host), the number of kernel launches,
the N costliest kernels and the N costliest host-side operators.

Prints a table and writes JSON:

    python packages/fox-models/benchmarks/generate.py --size 125m --batch 1 32 --prompt 2048 16384 --out gen.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import fox_models  # noqa: F401  (registers the model types)
from fox_layers.mlp import intermediate_size_for
from fox_models.presets import get_preset

FOX_MODELS = {"FoX (Pro)": "fox-pro", "FoX (LLaMA)": "fox-llama", "Transformer (LLaMA)": "transformer-llama"}
FOX_STATIC = {f"{name}, static cache{how} + CUDA graph" for name in FOX_MODELS for how in ("", " + compile")}


def llama_like(config) -> LlamaForCausalLM:
    """transformers' Llama with the FoX config's width, depth, heads, MLP size and vocabulary."""
    inter = config.intermediate_size or intermediate_size_for(config.hidden_size, config.hidden_ratio)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads or config.num_heads,
        intermediate_size=inter, max_position_embeddings=32768, rope_theta=500000.0, tie_word_embeddings=False,
        attn_implementation="sdpa", bos_token_id=50256, eos_token_id=50256, pad_token_id=50256))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps: int) -> tuple[float, object]:
    """Median seconds of ``reps`` calls after one warm-up, and the last result."""
    out = fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2], out


def _rank(d: dict, top: int, per: float = 1.0) -> list[dict]:
    """The ``top`` entries of {name: (calls, ms)} by ms, each divided by ``per``."""
    return [dict(name=k, calls=n / per, ms=ms / per)
            for k, (n, ms) in sorted(d.items(), key=lambda kv: -kv[1][1])[:top]]


def _profiled(fn, device) -> tuple[float, dict, dict]:
    """One call of ``fn`` under torch.profiler: wall seconds, {kernel: (calls, device ms)} and
    {host operator: (calls, self CPU ms)}."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - t
    kernels, host = {}, {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, ms = kernels.get(e.name, (0, 0.0))
            kernels[e.name] = (n + 1, ms + e.device_time / 1e3)
    for e in prof.key_averages():
        if e.self_cpu_time_total > 0:
            host[e.key] = (e.count, e.self_cpu_time_total / 1e3)
    return wall, kernels, host


def profile_call(fn, device, top: int) -> dict:
    """One call of ``fn`` under torch.profiler: wall ms, device-kernel ms and launches, the ``top`` costliest
    kernels (device time) and host operators (self CPU time)."""
    wall, kernels, host = _profiled(fn, device)
    return dict(wall_ms=wall * 1e3, kernel_ms=sum(ms for _, ms in kernels.values()),
                kernel_launches=sum(n for n, _ in kernels.values()),
                host_ms=sum(ms for _, ms in host.values()), kernels=_rank(kernels, top), host_ops=_rank(host, top))


def profile_decoding(prefill, generate, steps: int, device, top: int) -> dict:
    """Per decoded token: a ``generate`` of ``steps`` more tokens than ``prefill``, minus ``prefill``, under
    the profiler (kernels replayed from a CUDA graph count too), divided by ``steps``."""
    wall0, k0, h0 = _profiled(prefill, device)
    wall1, k1, h1 = _profiled(generate, device)
    diff = lambda a, b: {k: (n - b.get(k, (0, 0.0))[0], ms - b.get(k, (0, 0.0))[1]) for k, (n, ms) in a.items()}
    kernels, host = diff(k1, k0), diff(h1, h0)
    return dict(wall_ms=(wall1 - wall0) * 1e3 / steps, kernel_ms=sum(ms for _, ms in kernels.values()) / steps,
                kernel_launches=sum(n for n, _ in kernels.values()) / steps,
                host_ms=sum(ms for _, ms in host.values()) / steps,
                kernels=_rank(kernels, top, steps), host_ops=_rank(host, top, steps))


@torch.no_grad()
def measure(model, batch: int, prompt: int, new_tokens: int, reps: int, device, gen_kwargs=None,
            profile_top: int = 0) -> dict:
    ids = torch.randint(0, 50000, (batch, prompt), device=device, generator=torch.Generator(device).manual_seed(0))
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=50256,
               **(gen_kwargs or {}))
    prefill_s, _ = timed(lambda: model.generate(ids, **{**gen, "max_new_tokens": 1, "min_new_tokens": 1}), device, reps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    total_s, out = timed(lambda: model.generate(ids, **gen), device, reps)
    assert out.shape == (batch, prompt + new_tokens), out.shape
    decode_s = max(total_s - prefill_s, 1e-9)
    row = {"prefill_ms": prefill_s * 1e3, "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s,
           "total_s": total_s,
           "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    if profile_top:
        prefill = lambda: model.generate(ids, **{**gen, "max_new_tokens": 1, "min_new_tokens": 1})
        row["prefill_profile"] = profile_call(prefill, device, profile_top)
        steps = min(new_tokens - 1, 32)
        row["decode_profile"] = profile_decoding(
            prefill, lambda: model.generate(ids, **{**gen, "max_new_tokens": steps + 1, "min_new_tokens": steps + 1}),
            steps, device, profile_top)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="125m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--static", action="store_true", help="also every model with a static cache (Llama: + "
                    "torch.compile; FoX: + CUDA graphs)")
    ap.add_argument("--models", nargs="+", help="subset of the model names (default: all)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer width-64 model (a CPU smoke run)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile one prefill per row: wall vs kernel time, launches, the N costliest "
                         "kernels and host operators")
    ap.add_argument("--out", default="generate.json")
    args = ap.parse_args()
    if min(args.batch + args.prompt) < 1 or args.new_tokens < 2 or args.reps < 1 or args.profile < 0:
        raise SystemExit("generate.py: --batch and --prompt must be >= 1, --new-tokens >= 2, --reps >= 1, "
                         "--profile >= 0")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = dict(hidden_size=64, num_hidden_layers=2, num_heads=2) if args.tiny else {}
    builders = {name: (lambda fam=fam: AutoModelForCausalLM.from_config(get_preset(f"{fam}-{args.size}", **shape)))
                for name, fam in FOX_MODELS.items()}
    llama_config = get_preset(f"fox-llama-{args.size}", **shape)
    builders["HF Llama (SDPA, dynamic cache)"] = lambda: llama_like(llama_config)
    if args.static:
        builders["HF Llama (SDPA, static cache + compile)"] = lambda: llama_like(llama_config)
        for name in FOX_MODELS:
            builders[f"{name}, static cache + compile + CUDA graph"] = builders[name]
            builders[f"{name}, static cache + CUDA graph"] = builders[name]
    names = args.models or list(builders)
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise SystemExit(f"generate.py: --models: unknown {unknown}; known: {list(builders)}")
    env = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "dtype": str(dtype), "size": args.size,
           "new_tokens": args.new_tokens, "reps": args.reps}
    rows = []
    for name in names:
        model = builders[name]().to(device=device, dtype=dtype).eval()
        gen_kwargs = {"cache_implementation": "static"} if "static" in name else None
        if name in FOX_STATIC and "compile" not in name:
            gen_kwargs["disable_compile"] = True
        for batch in args.batch:
            for prompt in args.prompt:
                try:
                    r = measure(model, batch, prompt, args.new_tokens, args.reps, device, gen_kwargs, args.profile)
                except (torch.OutOfMemoryError, RuntimeError) as e:  # one failed contender does not stop the rest
                    r = {"error": str(e).splitlines()[0][:200]}
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append({"model": name, "batch": batch, "prompt": prompt, **r})
                print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_profile")}), flush=True)
                for what, label in (("prefill_profile", "one prefill"), ("decode_profile", "per decoded token")):
                    if what not in r:
                        continue
                    prof = r[what]
                    print(f"  {label}: {prof['wall_ms']:.2f} ms wall, {prof['kernel_ms']:.2f} ms in "
                          f"{prof['kernel_launches']:.0f} kernels, {prof['host_ms']:.2f} ms of host operators")
                    for kind in ("kernels", "host_ops"):
                        for k in prof[kind]:
                            print(f"  {kind:8s} {k['ms']:8.3f} ms {k['calls']:7.1f}x  {k['name'][:90]}")
                write(args.out, env, rows)
        del model
        gc.collect()  # a model with a compiled step is freed by the collector
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{'model':56s} {'batch':>5s} {'prompt':>6s} {'prefill ms':>10s} {'decode tok/s':>12s} {'peak GiB':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:56s} {r['batch']:5d} {r['prompt']:6d} {r['error']}")
            continue
        peak = f"{r['peak_gib']:8.2f}" if r["peak_gib"] is not None else "     n/a"
        print(f"{r['model']:56s} {r['batch']:5d} {r['prompt']:6d} {r['prefill_ms']:10.1f} {r['decode_tokens_per_s']:12,.0f} {peak}")
    print(f"wrote {args.out}")


def write(path: str, env: dict, rows: list[dict]) -> None:
    """The JSON so far (after every row: a run cut short keeps what it measured)."""
    with open(path, "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
