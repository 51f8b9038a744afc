"""``fox-eval``: evaluations of FoX models.

    fox-eval per-token-loss --model DIR [DIR ...] --data tokens:PATH|text:PATH|zarr:PATH --seq-len N
    fox-eval niah --model DIR --mode standard|easy [--haystack DIR] [--judge-url URL]
    fox-eval harness --model DIR [DIR ...] --tasks paper|TASK [TASK ...] [--max-length 16384]
    fox-eval longbench --model DIR [DIR ...] --data DIR [--tasks ...] [--prompts dataset2prompt.json]
    fox-eval generate --model DIR "prompt"
    fox-eval inspect --model DIR --text FILE [--layers 0 5] [--heads 0 1]

Each command writes its results to ``--out`` (default ``outputs/eval/<command>`` under the working directory,
e.g. ``outputs/eval/niah``). Offline by default: nothing is fetched from the Hugging Face Hub unless
``--online`` is given (or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set to 0 in the environment).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import urllib.parse
from pathlib import Path

# torch, transformers and fox_models are imported inside the command that runs, after its arguments are
# checked: `fox-eval --help` and an argument error answer at once instead of after seconds of imports.

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
OUT_ROOT = "outputs/eval"  # the default --out is OUT_ROOT/<command>; git ignores outputs/


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _init_context_parallel(device):
    """Join the torchrun job this process is a rank of (NCCL on GPUs, gloo on the CPU); each rank takes GPU
    LOCAL_RANK. Returns the rank's device."""
    import os

    import torch
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        raise ValueError("--context-parallel runs under torchrun: torchrun --nproc_per_node=N -m fox_eval.cli "
                         "per-token-loss --context-parallel ...")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def _per_token_loss(args) -> None:
    from fox_eval.data import check_spec
    from fox_eval.loading import check_model_dir, model_labels

    for path in args.model:
        check_model_dir(path)
    labels = model_labels(args.model, args.labels)
    check_spec(args.data)

    import fox_models
    from fox_eval.data import load_sequences
    from fox_eval.loading import resolve_device
    from fox_eval.per_token_loss import run

    device = resolve_device(args.device)
    if args.context_parallel:
        device = _init_context_parallel(device)
    seqs = load_sequences(args.data, args.seq_len, args.limit, fox_models.JSONGPT2Tokenizer())
    curves = run(args.model, seqs, Path(args.out), args.batch_size, device, args.train_len, labels,
                 split=args.context_parallel)
    if args.context_parallel and _rank() != 0:
        return
    for name, c in curves.items():
        print(f"{name}: mean loss {c.mean():.4f} over {len(seqs)} sequences of {seqs.shape[1]} tokens")
    print(f"wrote {args.out}/per_token_loss.{{json,npz,png,pdf}}")


def _generate(args) -> None:
    from fox_eval.loading import check_model_dir

    check_model_dir(args.model)

    import torch

    from fox_eval.loading import autocast, load_model, load_tokenizer, resolve_device

    device = resolve_device(args.device)
    model = load_model(args.model, device)
    tok = load_tokenizer(args.model)
    ids = tok(args.prompt, return_tensors="pt")["input_ids"].to(device)
    kw = dict(do_sample=False) if args.temperature == 0 else dict(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    with autocast(device), torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, **kw)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


def _inspect(args) -> None:
    from fox_eval.data import check_spec
    from fox_eval.loading import check_model_dir

    if (args.text is None) == (args.data is None):
        raise ValueError("pass exactly one of --text FILE and --data SPEC")
    check_model_dir(args.model)
    if args.text is not None and not Path(args.text).exists():
        raise FileNotFoundError(f"--text {args.text!r} does not exist")
    if args.data is not None:
        check_spec(args.data)

    import torch

    import fox_models
    from fox_eval.data import load_sequences
    from fox_eval.inspect_cmd import run
    from fox_eval.loading import load_model, resolve_device
    from fox_models.inspect import NoForgetGateError

    model = load_model(args.model, resolve_device(args.device))
    tok = fox_models.JSONGPT2Tokenizer()
    if args.text is not None:
        text = Path(args.text).read_text(encoding="utf-8")
        if not text.strip():  # one BOS token would be inspected
            raise ValueError(f"--text {args.text!r} holds no text")
        ids = tok(text, return_tensors="pt")["input_ids"][:, : args.max_tokens]
    else:
        ids = torch.from_numpy(load_sequences(args.data, args.max_tokens, 1, tok))
    try:
        report = run(model, ids.to(model.device), Path(args.out), args.layers, args.heads, args.block)
    except NoForgetGateError as e:  # a Transformer: the wrong model for this command
        raise ValueError(f"--model {args.model!r}: {e}") from None
    for i, layer in enumerate(report["layers"]):
        times = " ".join(f"{h['decay_time']:.3g}" for h in layer)
        print(f"layer {i:2d}: decay times {times} | pruning would skip {report['pruned_fraction_per_layer'][i]:.0%}")
    print(f"wrote {args.out}/inspect.json, decay_times.png and the per-head figures")


def _niah(args) -> None:
    from fox_eval import niah
    from fox_eval.loading import (
        check_model_dir,
        load_model,
        load_tokenizer,
        model_fingerprint,
        precision,
        resolve_device,
    )

    check_model_dir(args.model)
    bad_depths = [d for d in args.depths or [] if not 0 <= d <= 100]
    if bad_depths:
        raise ValueError(f"--depths must lie in [0, 100] (percent), got {bad_depths}")
    short = [n for n in args.lengths or [] if n <= niah.RESERVED_TOKENS]
    if short:
        raise ValueError(f"--lengths must exceed the {niah.RESERVED_TOKENS} tokens held back for the question "
                         f"and answer, got {short}")
    if args.haystack is not None:
        niah.haystack_text(args.haystack)  # a missing or empty folder fails before the model loads
    judge = None
    if args.judge_url:
        judge = {"url": args.judge_url, "model": args.judge_model, "api_key": os.environ.get("FOX_EVAL_JUDGE_API_KEY")}
    device = resolve_device(args.device)
    haystack = str(Path(args.haystack).resolve()) if args.haystack is not None else "bundled"
    resume_key = "|".join([model_fingerprint(args.model), precision(device), args.mode, haystack,
                           str(args.max_new_tokens)])
    model = load_model(args.model, device)
    report = niah.run(model, load_tokenizer(args.model), Path(args.out), args.mode, args.lengths, args.depths,
                      args.max_new_tokens, args.limit, judge, args.haystack, resume_key)
    line = f"mean score {report['mean_score']:.2f} / 10 over {len(report['results'])} prompts"
    if judge and report.get("mean_judge_score") is not None:
        line += f", judge {report['mean_judge_score']:.2f} / 10"
    print(f"{line} -> {args.out}")


def _harness(args) -> None:
    from fox_eval.loading import check_model_dir, model_labels

    for path in args.model:
        check_model_dir(path)
    labels = model_labels(args.model, args.labels)
    if args.include_path and not Path(args.include_path).exists():
        raise FileNotFoundError(f"--include-path {args.include_path!r} does not exist")

    from fox_eval import harness
    from fox_eval.loading import resolve_device

    tasks = list(harness.PAPER_TASKS) if args.tasks == ["paper"] else args.tasks
    device = str(resolve_device(args.device))
    _, md = harness.run(args.model, tasks, Path(args.out), args.include_path, args.limit, args.batch_size, device,
                        args.max_length, labels)
    print(md)


def _longbench(args) -> None:
    import json

    from fox_eval import longbench
    from fox_eval.loading import check_model_dir, model_labels, resolve_device

    for path in args.model:
        check_model_dir(path)
    labels = model_labels(args.model, args.labels)
    if not Path(args.data).is_dir():
        raise FileNotFoundError(f"--data {args.data!r} is not a folder of LongBench <task>.jsonl files")
    tasks = args.tasks or list(longbench.TASKS)
    unknown = [t for t in tasks if t not in longbench.TASKS]
    if unknown:
        raise ValueError(f"--tasks: unknown LongBench tasks {unknown}; known: {longbench.TASKS}")
    missing = [t for t in tasks if not (Path(args.data) / f"{t}.jsonl").exists()]
    if missing:
        raise FileNotFoundError(f"--data {args.data!r} has no {', '.join(f'{t}.jsonl' for t in missing)}")
    prompts = None
    if args.prompts:
        if not Path(args.prompts).exists():
            raise FileNotFoundError(f"--prompts {args.prompts!r} does not exist")
        try:
            prompts = json.loads(Path(args.prompts).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts {args.prompts!r} is not valid JSON: {e}") from None
    device = resolve_device(args.device)
    _, md = longbench.run_models(args.model, Path(args.data), Path(args.out), tasks, args.budget, args.limit, prompts,
                                 device, labels)
    print(md)


OUT_HELP = "folder for the results, created if missing (default: %(default)s, under the working directory)"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fox-eval", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda or cuda:N")
    common.add_argument("--online", action="store_true",
                        help="allow downloads from the Hugging Face Hub (default: offline, local files and caches)")
    sub = ap.add_subparsers(dest="command", required=True)
    models_help = "Hugging Face model folders; each is a row of the table"
    labels_help = "a name per model for the tables (default: the folder's name, its parent's for RUN/hf)"
    p = sub.add_parser("per-token-loss", parents=[common], help="L(i) over held-out sequences, with figures")
    p.add_argument("--model", nargs="+", required=True, help="Hugging Face model folders; each is a curve")
    p.add_argument("--labels", nargs="+", default=None, help=labels_help)
    p.add_argument("--data", required=True, help="tokens:PATH (.npy/.bin), text:PATH (file or folder) or zarr:PATH")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--limit", type=int, default=None, help="at most this many sequences (>= 1)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--train-len", type=int, default=None, help="training context length, marked on the plot")
    p.add_argument("--context-parallel", action="store_true",
                   help="under torchrun: split each sequence across the job's processes (sequences longer than "
                        "one GPU holds); --seq-len a multiple of 2 x the processes")
    p.add_argument("--out", default=f"{OUT_ROOT}/per_token_loss", help=OUT_HELP)
    p.set_defaults(func=_per_token_loss)
    g = sub.add_parser("generate", parents=[common], help="continue a prompt")
    g.add_argument("--model", required=True)
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.set_defaults(func=_generate)
    i = sub.add_parser("inspect", parents=[common], help="forget gates, decay times, F / attention maps, pruning")
    i.add_argument("--model", required=True)
    i.add_argument("--text", help="a text file to run the model on")
    i.add_argument("--data", help="or held-out data: tokens:PATH, text:PATH or zarr:PATH (first sequence)")
    i.add_argument("--max-tokens", type=int, default=4096)
    i.add_argument("--layers", type=int, nargs="*", default=None, help="layers to draw (default: first and last)")
    i.add_argument("--heads", type=int, nargs="*", default=None, help="heads to draw (default: all)")
    i.add_argument("--block", type=int, default=128, help="tile size for the pruning count")
    i.add_argument("--out", default=f"{OUT_ROOT}/inspect", help=OUT_HELP)
    i.set_defaults(func=_inspect)
    n = sub.add_parser("niah", parents=[common], help="needle in a haystack, the paper's prompts, heat map")
    n.add_argument("--model", required=True)
    n.add_argument("--mode", choices=["standard", "easy"], default="standard")
    n.add_argument("--haystack", default=None, help="a folder of .txt files (default: the bundled King James Bible)")
    n.add_argument("--lengths", type=int, nargs="+", default=None, help="default: linspace(1000, 32000, 11)")
    n.add_argument("--depths", type=float, nargs="+", default=None, help="percent; default: linspace(0, 100, 11)")
    n.add_argument("--max-new-tokens", type=int, default=1024, help="greedy tokens per answer (official: 1024)")
    n.add_argument("--limit", type=int, default=None, help="only the first N (length, depth) cells")
    n.add_argument("--judge-url", default=None, help="OpenAI-compatible base URL (key: $FOX_EVAL_JUDGE_API_KEY)")
    n.add_argument("--judge-model", default="gpt-4o-2024-08-06", help="the paper's judge by default")
    n.add_argument("--out", default=f"{OUT_ROOT}/niah", help=OUT_HELP)
    n.set_defaults(func=_niah)
    h = sub.add_parser("harness", parents=[common], help="lm-eval-harness tasks, one table across models")
    h.add_argument("--model", nargs="+", required=True, help=models_help)
    h.add_argument("--labels", nargs="+", default=None, help=labels_help)
    h.add_argument("--tasks", nargs="+", default=["paper"], help="'paper' (the 11 zero-shot tasks) or task names")
    h.add_argument("--include-path", default=None, help="a folder of local lm-eval task YAML files")
    h.add_argument("--limit", type=float, default=None, help="examples per task (or a fraction below 1)")
    h.add_argument("--batch-size", type=int, default=1)
    h.add_argument("--max-length", type=int, default=16384, help="longest context in tokens (the paper: 16384)")
    h.add_argument("--out", default=f"{OUT_ROOT}/harness", help=OUT_HELP)
    h.set_defaults(func=_harness)
    lb = sub.add_parser("longbench", parents=[common], help="LongBench v1, the 14 English tasks, one table")
    lb.add_argument("--model", nargs="+", required=True, help=models_help)
    lb.add_argument("--labels", nargs="+", default=None, help=labels_help)
    lb.add_argument("--data", required=True, help="folder with LongBench <task>.jsonl files")
    lb.add_argument("--tasks", nargs="+", default=None, help="default: all 14")
    lb.add_argument("--prompts", default=None, help="a dataset2prompt.json to use instead of LongBench's prompts")
    lb.add_argument("--budget", type=int, default=15500, help="prompt tokens kept (middle truncation)")
    lb.add_argument("--limit", type=int, default=None, help="samples per task")
    lb.add_argument("--out", default=f"{OUT_ROOT}/longbench", help=OUT_HELP)
    lb.set_defaults(func=_longbench)
    return ap


# Integer options that must be >= 1 (a limit of 0 would average over nothing).
POSITIVE = ("limit", "seq_len", "batch_size", "max_new_tokens", "max_length", "budget", "max_tokens", "block",
            "train_len")


def check_args(args) -> None:
    """One line naming the option for a value no run can use."""
    for name in POSITIVE:
        value = getattr(args, name, None)
        if value is None:
            continue
        if args.command == "harness" and name == "limit":
            if not value > 0:
                raise ValueError(f"--limit must be > 0 (examples per task, or a fraction below 1), got {value:g}")
        elif value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    out = getattr(args, "out", None)
    if out is not None and Path(out).exists() and not Path(out).is_dir():  # "Not a directory: '.../partial'"
        raise ValueError(f"--out {out!r} is a file; it must be a folder (made if missing)")
    text = getattr(args, "text", None)
    if args.command == "inspect" and text is not None and Path(text).is_dir():
        raise ValueError(f"--text {text!r} is a folder; it must be a text file")
    judge_url = getattr(args, "judge_url", None)
    if judge_url and urllib.parse.urlparse(judge_url).scheme not in ("http", "https"):
        raise ValueError(f"--judge-url must be an http(s) URL of an OpenAI-compatible API (.../v1), got {judge_url!r}")
    if args.command == "generate":
        if not args.temperature >= 0:  # also refuses nan
            raise ValueError(f"--temperature must be >= 0 (0: greedy), got {args.temperature:g}")
        if not 0 < args.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (the probability mass sampled from), got {args.top_p:g}")


def offline_first(online: bool) -> None:
    """Hub and datasets offline unless ``--online`` (an explicit value in the environment wins)."""
    for var in OFFLINE_VARIABLES:
        os.environ.setdefault(var, "0" if online else "1")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    offline_first(args.online)
    try:
        check_args(args)
        args.func(args)
    except (OSError, ValueError, ImportError) as e:
        hint = ""
        if isinstance(e, ConnectionError) and not args.online:
            hint = " (fox-eval runs offline: --online lets it download)"
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) and e.filename is None:
            raise SystemExit(f"fox-eval: cannot write --out {args.out}: {e}") from None  # a write names no file
        raise SystemExit(f"fox-eval: {e}{hint}") from None
    except KeyboardInterrupt:
        # per-token-loss keeps its sums after every batch: the same command with the same --out resumes
        print(f"fox-eval {args.command}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
