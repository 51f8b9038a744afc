"""Reproduce the paper's findings at small scale on one GPU: Linux C corpus -> train -> evaluate -> report.

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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
SLICE_NAME = "linux-6.12-slice.jsonl.xz"


# ---------------------------------------------------------------------------------------------- stages
def corpus(args) -> Path:
    from fox_train import linux_corpus

    path = args.out / "corpus" / SLICE_NAME
    deb = linux_corpus.download(args.out / "corpus")
    summary = linux_corpus.write_slice(deb, path, args.slice_mb)
    (args.out / "corpus" / "slice.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return path


def prepare(args) -> dict:
    from fox_train import linux_corpus

    data = args.out / "data"
    if (data / "corpus.json").exists() and not args.force:
        return json.loads((data / "corpus.json").read_text())
    slice_path = args.slice or args.out / "corpus" / SLICE_NAME
    if not Path(slice_path).exists():
        raise FileNotFoundError(f"--slice {str(slice_path)!r} does not exist: run `reproduce.py corpus` first")
    t = time.perf_counter()
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
        overrides = [f"experiment=repro/{name}", f"out_dir={args.out / 'runs'}", f"run_name={name}",
                     f"data.path={data / 'train.npy'}", f"data.heldout_path={data / 'heldout.npy'}", *args.set]
        print(f"{name}: fox-train {' '.join(overrides)}", flush=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fox_train.cli", *overrides], check=True)
        run.mkdir(parents=True, exist_ok=True)
        (run / "wall_clock.json").write_text(json.dumps({"seconds": time.perf_counter() - t}))


def evaluate(args) -> dict:
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


def report(args) -> Path:
    from repro_report import write_report

    return write_report(args.out, args.docs, args.models, environment())


# ------------------------------------------------------------------------------------------ evaluation
def _train_len(args) -> int:
    from fox_train.cli import compose

    return compose([f"experiment=repro/{args.models[0]}", *args.set]).data.seq_len


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

    calls = []
    import fox_layers.attention as fla

    original = fla.forgetting_attention

    def recording(q, k, v, log_fgate, **kw):
        calls.append((q.detach(), k.detach(), v.detach(), log_fgate.detach(), kw))
        return original(q, k, v, log_fgate, **kw)

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
        fla.forgetting_attention = recording
        try:
            model_step()
        finally:
            fla.forgetting_attention = original
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
    ap.add_argument("--out", type=Path, default=Path("outputs/repro"), help="working folder (default outputs/repro)")
    ap.add_argument("--docs", type=Path, default=Path("docs"), help="where results.md and results/ go")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a fox-train override for every model, e.g. schedule.total_tokens=83886080")
    ap.add_argument("--slice", type=Path, help=f"the compressed corpus slice (default OUT/corpus/{SLICE_NAME})")
    ap.add_argument("--slice-mb", type=float, default=100.0, help="corpus: MB of train text in the slice (0: all)")
    ap.add_argument("--eval-factor", type=int, default=4, help="per-token loss out to this many training lengths")
    ap.add_argument("--eval-docs", type=int, default=256, help="held-out documents for the per-token loss")
    ap.add_argument("--eval-batch", type=int, default=8)
    ap.add_argument("--inspect", default="fox_pro", help="the model whose gates are inspected")
    ap.add_argument("--force", action="store_true", help="redo stages whose outputs exist")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        raise SystemExit(f"reproduce.py: --models: unknown {unknown or 'none given'}; known: {', '.join(MODELS)}")
    if args.eval_factor < 1 or args.eval_docs < 1 or args.eval_batch < 1:
        raise SystemExit("reproduce.py: --eval-factor, --eval-docs and --eval-batch must be >= 1")
    bad = [s for s in args.set if "=" not in s]
    if bad:
        raise SystemExit(f"reproduce.py: --set takes KEY=VALUE, got {bad}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    try:
        slice_path = args.slice or args.out / "corpus" / SLICE_NAME
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
