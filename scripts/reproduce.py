"""Reproduce the paper's findings on a Linux C corpus: corpus -> prepare -> train -> evaluate -> report.

    python scripts/reproduce.py corpus     # apt-get download linux-source-6.12, write the compressed slice
    python scripts/reproduce.py prepare    # tokenize the slice (train.npy, heldout.npy)
    python scripts/reproduce.py train      # fox-train experiment=repro/<model> for every model
    python scripts/reproduce.py evaluate   # per-token loss out to 4L, inspect, pruning speed and loss
    python scripts/reproduce.py report     # docs/results.md, its figures and results.json
    python scripts/reproduce.py all        # prepare, train, evaluate, report (corpus first if no slice)

Each stage reads what the one before wrote under --out (default outputs/repro) and skips work already
done (a trained model is not trained again unless --force). Larger budgets are one flag away:
``--set schedule.total_tokens=...`` (every model), ``--slice-mb 0`` (the whole corpus), ``--set
data.seq_len=4096`` etc. Writes only small artefacts into the report: JSON and PNG.

``--scale paper-125m`` runs the paper's own setting, scaled down only in tokens: the official 125M
experiments (``experiment=repro_paper/<model>``, loading ``longcrawl64/*/*_125m_2b``), training length
16,384, data-parallel over ``--devices`` GPUs, evaluated to 64k on held-out directory documents
(scripts/paper_corpus.py), with the needle analog (scripts/code_needle.py), pruning and inspect. One model
per job: ``all --scale paper-125m --models fox_pro`` prepares, trains and evaluates that model and leaves
everything the report needs under OUT/results/ (JSON and PNG, kilobytes to a few MB); ``report --scale
paper-125m`` then runs anywhere from OUT/results/ alone (docs/results-paper-125m.md, docs/results/paper-125m/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MODELS = {  # name -> label, in the order of the paper's tables
    "fox_pro": "FoX (Pro)",
    "transformer_pro": "Transformer (Pro)",
    "fox_llama": "FoX (LLaMA)",
    "transformer_llama": "Transformer (LLaMA)",
}
PAPER_MODELS = {  # the paper-scale models, in the order they are worth running
    "fox_pro": "FoX (Pro)",
    "transformer_llama": "Transformer (LLaMA)",
    "fox_llama": "FoX (LLaMA)",
    "transformer_pro": "Transformer (Pro)",
    "delta_net": "DeltaNet",
}
LABELS = {**MODELS, **PAPER_MODELS}
SLICE_NAME = "linux-6.12-slice.jsonl.xz"
# What differs between the scales; every field can be changed on the command line.
SCALES = {
    "small": {"experiment": "repro", "models": MODELS, "out": "outputs/repro", "slice": SLICE_NAME,
              "eval_docs": 256, "eval_batch": 8, "needle_samples": 0},
    "paper-125m": {"experiment": "repro_paper", "models": PAPER_MODELS, "out": "outputs/repro-paper-125m",
                   "slice": "linux-6.12-dirs-slice.jsonl.xz", "eval_docs": 64, "eval_batch": 1, "needle_samples": 2},
}


# ---------------------------------------------------------------------------------------------- stages
def corpus(args) -> Path:
    from fox_train import linux_corpus

    path = args.out / "corpus" / args.slice_name
    deb = linux_corpus.download(args.out / "corpus")
    if args.paper:
        import paper_corpus

        summary = paper_corpus.write_slice(linux_corpus.iter_sources(deb), path, args.slice_mb)
    else:
        summary = linux_corpus.write_slice(deb, path, args.slice_mb)
    (args.out / "corpus" / "slice.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return path


def prepare(args) -> dict:
    from fox_train import linux_corpus

    data = args.out / "data"
    if (data / "corpus.json").exists() and not args.force:
        return json.loads((data / "corpus.json").read_text())
    slice_path = args.slice or args.out / "corpus" / args.slice_name
    if not Path(slice_path).exists():
        raise FileNotFoundError(f"--slice {str(slice_path)!r} does not exist: run `reproduce.py corpus` first")
    t = time.perf_counter()
    if args.paper:  # train tokens only as far as the models read (tokenizing is slow), every held-out document
        import paper_corpus

        need = max(_total_tokens(args, name) for name in args.models)
        summary = paper_corpus.tokenize(Path(slice_path), data, int(need * 1.02) + 1, args.eval_factor * _train_len(args))
        if summary["heldout_long_docs"] < args.eval_docs:
            print(f"prepare: only {summary['heldout_long_docs']} held-out documents reach {summary['min_heldout_tokens']} "
                  f"tokens (--eval-docs {args.eval_docs})", flush=True)
    else:
        summary = linux_corpus.tokenize_slice(Path(slice_path), data)
    summary["seconds"] = time.perf_counter() - t
    (data / "corpus.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


def train(args) -> None:
    data = args.out / "data"
    for name in args.models:
        run = args.out / "runs" / name
        if (run / "hf" / "config.json").exists() and not args.force:
            print(f"{name}: trained already ({run})")
            continue
        overrides = [f"experiment={args.experiment}/{name}", f"out_dir={args.out / 'runs'}", f"run_name={name}",
                     f"data.path={data / 'train.npy'}", f"data.heldout_path={data / 'heldout.npy'}",
                     *_paper_overrides(args, name), *args.set]
        print(f"{name}: fox-train {' '.join(overrides)}", flush=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fox_train.cli", *overrides], check=True)
        run.mkdir(parents=True, exist_ok=True)
        (run / "wall_clock.json").write_text(json.dumps({"seconds": time.perf_counter() - t}))
        if args.paper:  # the config the model trained under, for the report and the equality with the official one
            from dataclasses import asdict

            from fox_train.cli import compose

            (run / "resolved.json").write_text(json.dumps(asdict(compose(overrides)), indent=1, default=str))


def evaluate(args) -> dict:
    if args.paper:
        return evaluate_paper(args)
    import torch

    from fox_models.inspect import has_forget_gate
    from fox_train.linux_corpus import heldout_documents

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    L = _train_len(args)
    if not (args.out / "data" / "heldout_index.json").exists():
        raise FileNotFoundError(f"no prepared corpus under {args.out / 'data'} (run the prepare stage first)")
    seqs = heldout_documents(args.out / "data", args.eval_factor * L, args.eval_docs)
    result = {"train_len": L, "eval_len": int(seqs.shape[1]), "eval_documents": int(len(seqs)), "models": {}}
    curves = {}
    for name in args.models:
        hf = args.out / "runs" / name / "hf"
        if not (hf / "config.json").exists():
            raise FileNotFoundError(f"{name}: no trained model at {hf} (run the train stage)")
        model = _load(hf, device)
        curves[name] = per_token_loss(model, seqs, args.eval_batch, device)
        result["models"][name] = loss_summary(curves[name], L)
        if has_forget_gate(model):
            result["models"][name]["pruning"] = pruning(model, seqs, curves[name], L, args.eval_batch, device)
            if name == args.inspect:
                result["models"][name]["inspect"] = inspect(model, seqs[:1, :L], args.out / "eval" / "inspect")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (args.out / "eval").mkdir(parents=True, exist_ok=True)
    np.savez(args.out / "eval" / "per_token_loss.npz", **curves)
    (args.out / "eval" / "evaluation.json").write_text(json.dumps(result, indent=1))
    return result


def evaluate_paper(args) -> dict:
    """Paper scale, per model: L(i) to --eval-factor x L, the needle analog, pruning and inspect (FoX),
    written with the model's training record to OUT/results/<model>.json (+ PNGs): all the report needs."""
    import code_needle
    import torch

    from fox_models import JSONGPT2Tokenizer
    from fox_models.inspect import has_forget_gate
    from fox_train.linux_corpus import heldout_documents

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    L = _train_len(args)
    data, results = args.out / "data", args.out / "results"
    if not (data / "heldout_index.json").exists():
        raise FileNotFoundError(f"no prepared corpus under {data} (run the prepare stage first)")
    seqs = heldout_documents(data, args.eval_factor * L, args.eval_docs)
    results.mkdir(parents=True, exist_ok=True)
    corpus_summary = json.loads((data / "corpus.json").read_text())
    lengths = sorted({max(64, L // 4), max(64, L // 2), L, *(L * f for f in (2, 4, 8) if f <= args.eval_factor)})
    lengths = [n for n in lengths if n <= seqs.shape[1]]
    out, stages = {}, args.out / "timings.json"  # this job's prepare and train times
    for name in args.models:
        hf, run = args.out / "runs" / name / "hf", args.out / "runs" / name
        if not (hf / "config.json").exists():
            raise FileNotFoundError(f"{name}: no trained model at {hf} (run the train stage)")
        t = time.perf_counter()
        model = _load(hf, device)
        curve = per_token_loss(model, seqs, args.eval_batch, device)
        ev = {"train_len": L, "eval_len": int(seqs.shape[1]), "eval_documents": int(len(seqs)),
              **loss_summary(curve, L), "params": sum(p.numel() for p in model.parameters())}
        timings = {"per_token_loss_s": time.perf_counter() - t}
        if args.needle_samples:
            t = time.perf_counter()
            needle = code_needle.run(model, JSONGPT2Tokenizer(), seqs, lengths, samples=args.needle_samples,
                                     batch=max(1, args.eval_batch), device=device)
            code_needle.heatmap(needle, results / f"{name}_needle.png", f"{LABELS[name]}: definition recall", L)
            ev["needle"] = {k: v for k, v in needle.items() if k != "rows"}
            timings["needle_s"] = time.perf_counter() - t
        if has_forget_gate(model):
            t = time.perf_counter()
            ev["pruning"] = pruning(model, seqs, curve, L, args.eval_batch, device)
            timings["pruning_s"] = time.perf_counter() - t
            if name == args.inspect:
                t = time.perf_counter()
                n = min(L, args.inspect_len)
                ev["inspect"] = inspect(model, seqs[:1, :n], results / f"{name}_inspect")
                ev["inspect"]["tokens"] = n
                (results / f"{name}_inspect" / "inspect.json").unlink(missing_ok=True)  # the summary is in ev
                timings["inspect_s"] = time.perf_counter() - t
        ev["seconds"] = timings
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        record = {"model": name, "label": LABELS[name], "scale": args.scale, "environment": environment(),
                  "config": json.loads((run / "resolved.json").read_text()) if (run / "resolved.json").exists() else None,
                  "corpus": corpus_summary, "training": _training_record(run), "evaluation": ev,
                  "stage_seconds": json.loads(stages.read_text()) if stages.exists() else {},
                  "curve": [round(float(x), 5) for x in curve]}
        (results / f"{name}.json").write_text(json.dumps(record))
        out[name] = ev
    return out


def _training_record(run: Path) -> dict:
    """What the report shows of a run: its metrics records (JSON lines -> a list), wall-clock and the
    stage times of this job."""
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    wall = json.loads((run / "wall_clock.json").read_text())["seconds"] if (run / "wall_clock.json").exists() else None
    return {"records": records, "wall_clock_s": wall}


def report(args) -> Path:
    if args.paper:
        from repro_report import write_paper_report

        return write_paper_report(args.out / "results", args.docs, args.report_name)
    from repro_report import write_report

    return write_report(args.out, args.docs, args.models, environment())


# ------------------------------------------------------------------------------------------ evaluation
def _config(args, name: str):
    from fox_train.cli import compose

    return compose([f"experiment={args.experiment}/{name}", *args.set])


def _train_len(args) -> int:
    return _config(args, args.models[0]).data.seq_len


def _given(args, key: str) -> bool:
    return any(s.startswith(key + "=") for s in args.set)


def _total_tokens(args, name: str) -> int:
    """Paper scale: --tokens-per-device x --devices in whole optimizer steps (unless --set gives the total)."""
    cfg = _config(args, name)
    if _given(args, "schedule.total_tokens") or not args.paper:
        return cfg.schedule.total_tokens
    batch = cfg.global_batch_tokens
    return max(1, round(args.tokens_per_device * args.devices / batch)) * batch


def _paper_overrides(args, name: str) -> list[str]:
    """Paper scale: DDP over --devices GPUs (one device: no DDP), the token budget and a warmup that keeps
    the experiment's warmup share (the official 10%)."""
    if not args.paper:
        return []
    cfg = _config(args, name)
    total = _total_tokens(args, name)
    out = [f"strategy.name={'ddp' if args.devices > 1 else 'single'}", f"strategy.devices={args.devices}",
           f"schedule.total_tokens={total}"]
    if not _given(args, "schedule.warmup_tokens"):
        out.append(f"schedule.warmup_tokens={round(total * cfg.schedule.warmup_tokens / cfg.schedule.total_tokens)}")
    return out


def _load(path: Path, device):
    from transformers import AutoModelForCausalLM

    import fox_models  # noqa: F401  (registers the FoX model types)

    return AutoModelForCausalLM.from_pretrained(path).to(device).eval()


def per_token_loss(model, seqs: np.ndarray, batch: int, device) -> np.ndarray:
    """Mean loss at every position over the held-out documents (float64, (T,))."""
    from fox_eval.per_token_loss import sequence_losses

    total = np.zeros(seqs.shape[1])
    for _, loss in sequence_losses(model, seqs, batch, device, desc="per-token loss"):
        total += loss.sum(0)
    return total / len(seqs)


def window_mean(curve: np.ndarray, end: int, width: int) -> float:
    return float(curve[max(0, end - width) : end].mean())


def loss_summary(curve: np.ndarray, L: int) -> dict:
    """Held-out loss over the first L tokens and over all of them, and L(i) averaged over the last 10% of
    the window before L and before the end (the flatness check: the ratio of the two)."""
    T, w = len(curve), max(1, L // 10)
    at_L, at_end = window_mean(curve, L, w), window_mean(curve, T, w)
    return {"loss_first_L": float(curve[:L].mean()), "loss_all": float(curve.mean()),
            "L_i_near_L": at_L, "L_i_near_end": at_end, "end_over_L": at_end / at_L}


def set_pruning(model, log_tolerance: float | None) -> None:
    from fox_models.inspect import attention_layers

    for layer in attention_layers(model):
        layer.log_pruning_tolerance = log_tolerance


def pruning(model, seqs: np.ndarray, curve: np.ndarray, L: int, batch: int, device, log_eps: float = -10.0) -> dict:
    """Adaptive computation pruning (ln eps = -10) on the trained model: the loss it changes over the
    held-out documents, the attention tiles it skips, and the speed of a training step (forward + backward
    of the whole model) and of the attention calls alone, at the training length and at the eval length."""
    from fox_models.inspect import capture, pruning_fraction

    set_pruning(model, log_eps)
    pruned_curve = per_token_loss(model, seqs, batch, device)
    out = {"log_eps": log_eps, "loss_all": float(pruned_curve.mean()),
           "loss_change_rel": float(pruned_curve.mean() / curve.mean() - 1),
           "max_abs_change_L_i": float(np.abs(pruned_curve - curve).max()), "by_length": {}}
    for T in sorted({L, seqs.shape[1]}):
        ids = _inputs(seqs[:1, :T], device)
        caps = capture(model, ids)
        tiles = float(np.mean([pruning_fraction(c, 128, log_eps).mean().item() for c in caps]))
        b = max(1, (batch * seqs.shape[1]) // T)
        ids = _inputs(np.repeat(seqs[:, :T], -(-b // len(seqs)), axis=0)[:b], device)
        row = {"tiles_pruned": tiles, "batch": b}
        if device.type == "cuda":
            row.update(_speed(model, ids, log_eps))
        out["by_length"][str(T)] = row
    set_pruning(model, None)
    return out


def _inputs(seqs: np.ndarray, device):
    import torch

    labels = torch.from_numpy(np.ascontiguousarray(seqs)).to(device)
    inputs = torch.roll(labels, 1, dims=1)
    inputs[:, 0] = 50256
    return inputs


def _speed(model, ids, log_eps: float, reps: int = 10) -> dict:
    """Median milliseconds of a forward + backward (bf16 autocast, as in training) without and with
    pruning, the whole model and the attention kernel calls alone (replayed from the same step)."""
    import torch

    from fox_kernel import forgetting_attention
    from fox_layers import set_attention_kernel

    calls = []

    def recording(q, k, v, log_fgate, **kw):
        calls.append((q.detach(), k.detach(), v.detach(), log_fgate.detach(), kw))
        return forgetting_attention(q, k, v, log_fgate, **kw)

    def time_ms(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return float(np.median(times))

    def model_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss  # the mean loss, Hugging Face convention
        loss.float().mean().backward()
        model.zero_grad(set_to_none=True)

    row = {}
    model.train()
    for tag, tol in (("full", None), ("pruned", log_eps)):
        set_pruning(model, tol)
        row[f"model_ms_{tag}"] = time_ms(model_step)
        calls.clear()
        set_attention_kernel(model, recording)
        try:
            model_step()
        finally:
            set_attention_kernel(model, None)
        if not calls:
            raise RuntimeError("the model made no forgetting_attention call to time")
        args = [(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), lf.requires_grad_(), kw)
                for q, k, v, lf, kw in calls]

        def attention_step():
            for q, k, v, lf, kw in args:
                o = forgetting_attention(q, k, v, lf, **kw)
                o.backward(torch.ones_like(o))

        row[f"attention_ms_{tag}"] = time_ms(attention_step)
    model.eval()
    row["model_speedup"] = row["model_ms_full"] / row["model_ms_pruned"]
    row["attention_speedup"] = row["attention_ms_full"] / row["attention_ms_pruned"]
    return row


def inspect(model, ids: np.ndarray, out: Path) -> dict:
    """``fox-eval inspect`` of one held-out document of L tokens: the decay-time heat map of every layer
    and head, and F / attention maps of the middle layer's slowest-forgetting head."""
    from fox_eval.inspect_cmd import run
    from fox_models.inspect import gate_statistics

    inputs = _inputs(ids, model.device)
    stats = gate_statistics(model, inputs)
    layer = len(stats) // 2
    head = int(np.argmax([h["decay_time"] for h in stats[layer]]))
    rep = run(model, inputs, out, [layer], [head])
    return {"layer": layer, "head": head, "pruned_fraction_model": rep["pruned_fraction_model"],
            "decay_times": [[h["decay_time"] for h in layer_stats] for layer_stats in rep["layers"]]}


def environment() -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


# ------------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="reproduce.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("corpus", "prepare", "train", "evaluate", "report", "all"))
    ap.add_argument("--scale", choices=tuple(SCALES), default="small",
                    help="small (25M models, L = 2048, one GPU) or paper-125m (official 125M, L = 16384, --devices GPUs)")
    ap.add_argument("--out", type=Path, help="working folder (default outputs/repro, outputs/repro-paper-125m)")
    ap.add_argument("--docs", type=Path, default=Path("docs"), help="where results.md and results/ go")
    ap.add_argument("--models", help=f"comma-separated; small: {', '.join(MODELS)}; paper-125m: {', '.join(PAPER_MODELS)} "
                    "(default: all of the scale's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a fox-train override for every model, e.g. schedule.total_tokens=83886080")
    ap.add_argument("--slice", type=Path, help="the compressed corpus slice (default OUT/corpus/<the scale's slice>)")
    ap.add_argument("--slice-mb", type=float, help="corpus: MB of train text in the slice (0: all; default 100, paper 250)")
    ap.add_argument("--eval-factor", type=int, default=4, help="per-token loss out to this many training lengths")
    ap.add_argument("--eval-docs", type=int, help="held-out documents for the per-token loss (default 256, paper 64)")
    ap.add_argument("--eval-batch", type=int, help="sequences per forward in evaluation (default 8, paper 1)")
    ap.add_argument("--devices", type=int, default=2, help="paper-125m: GPUs of this host, data-parallel (DDP)")
    ap.add_argument("--tokens-per-device", type=int, default=32 * 2**20,
                    help="paper-125m: training tokens per GPU (total = this x --devices, in whole steps)")
    ap.add_argument("--needle-samples", type=int, help="paper-125m: needles per (length, depth) cell (default 2)")
    ap.add_argument("--report-name", default="paper-125m",
                    help="paper-125m report: writes DOCS/results-<name>.md and DOCS/results/<name>/ (another "
                         "token budget beside the default page)")
    ap.add_argument("--inspect-len", type=int, default=8192, help="paper-125m: tokens of the inspected document")
    ap.add_argument("--inspect", default="fox_pro", help="the model whose gates are inspected")
    ap.add_argument("--force", action="store_true", help="redo stages whose outputs exist")
    args = ap.parse_args(argv)
    scale = SCALES[args.scale]
    args.paper, args.experiment, args.slice_name = args.scale != "small", scale["experiment"], scale["slice"]
    args.out = args.out or Path(scale["out"])
    args.slice_mb = args.slice_mb if args.slice_mb is not None else (250.0 if args.paper else 100.0)
    for key in ("eval_docs", "eval_batch", "needle_samples"):
        if getattr(args, key) is None:
            setattr(args, key, scale[key])
    known = scale["models"]
    args.models = [m for m in (args.models or ",".join(known)).split(",") if m]
    unknown = [m for m in args.models if m not in known]
    if unknown or not args.models:
        raise SystemExit(f"reproduce.py: --models: unknown {unknown or 'none given'}; known: {', '.join(known)}")
    if args.eval_factor < 1 or args.eval_docs < 1 or args.eval_batch < 1:
        raise SystemExit("reproduce.py: --eval-factor, --eval-docs and --eval-batch must be >= 1")
    if args.devices < 1 or args.tokens_per_device < 1 or args.needle_samples < 0 or args.inspect_len < 1:
        raise SystemExit("reproduce.py: --devices, --tokens-per-device and --inspect-len must be >= 1, "
                         "--needle-samples >= 0")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.report_name):
        raise SystemExit(f"reproduce.py: --report-name must be letters, digits, '.', '_' or '-', got {args.report_name!r}")
    bad = [s for s in args.set if "=" not in s]
    if bad:
        raise SystemExit(f"reproduce.py: --set takes KEY=VALUE, got {bad}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    try:
        slice_path = args.slice or args.out / "corpus" / args.slice_name
        if args.stage == "corpus" or (args.stage == "all" and not slice_path.exists()
                                      and not (args.out / "data" / "corpus.json").exists()):
            corpus(args)
        timings_path = args.out / "timings.json"
        timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
        for stage, fn in (("prepare", prepare), ("train", train), ("evaluate", evaluate), ("report", report)):
            if args.stage in (stage, "all"):
                t = time.perf_counter()
                if stage == "report":  # the report shows the wall-clock of every stage
                    timings_path.write_text(json.dumps(timings, indent=1))
                fn(args)
                timings[stage] = time.perf_counter() - t
                args.out.mkdir(parents=True, exist_ok=True)
                timings_path.write_text(json.dumps(timings, indent=1))
                print(f"{stage}: {timings[stage]:.0f} s", flush=True)
    except (FileNotFoundError, ValueError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"reproduce.py {args.stage}: {e}") from None


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
