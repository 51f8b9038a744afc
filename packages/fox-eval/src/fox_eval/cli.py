"""``fox-eval``: evaluations of FoX models.

    fox-eval per-token-loss --model DIR [DIR ...] --data tokens:PATH|text:PATH|zarr:PATH --seq-len N
    fox-eval generate --model DIR "prompt"
    fox-eval inspect --model DIR --text FILE [--layers 0 5] [--heads 0 1]
    fox-eval niah --model DIR --mode standard|easy
    fox-eval harness --model DIR [DIR ...] --tasks paper|TASK [TASK ...] [--include-path DIR]
    fox-eval longbench --model DIR --data DIR [--tasks ...] [--prompts dataset2prompt.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def _device(name: str) -> torch.device:
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else ("cpu" if name == "auto" else name))


def _per_token_loss(args) -> None:
    import fox_models
    from fox_eval.data import load_sequences
    from fox_eval.per_token_loss import check_model_dir, run

    for path in args.model:
        check_model_dir(path)
    seqs = load_sequences(args.data, args.seq_len, args.limit, fox_models.JSONGPT2Tokenizer())
    curves = run(args.model, seqs, Path(args.out), args.batch_size, _device(args.device), args.train_len)
    for name, c in curves.items():
        print(f"{name}: mean loss {c.mean():.4f} over {len(seqs)} sequences of {seqs.shape[1]} tokens")
    print(f"wrote {args.out}/per_token_loss.{{json,npz,png,pdf}}")


def _generate(args) -> None:
    from transformers import AutoTokenizer

    from fox_eval.per_token_loss import load_model

    device = _device(args.device)
    model = load_model(args.model, device)
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = tok(args.prompt, return_tensors="pt")["input_ids"].to(device)
    kw = dict(do_sample=False) if args.temperature == 0 else dict(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, pad_token_id=tok.eos_token_id, **kw)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


def _inspect(args) -> None:
    import fox_models
    from fox_eval.data import load_sequences
    from fox_eval.inspect_cmd import run
    from fox_eval.per_token_loss import load_model
    from fox_models.inspect import NoForgetGateError

    if (args.text is None) == (args.data is None):
        raise ValueError("pass exactly one of --text FILE and --data SPEC")
    model = load_model(args.model, _device(args.device))
    tok = fox_models.JSONGPT2Tokenizer()
    if args.text is not None:
        if not Path(args.text).exists():
            raise FileNotFoundError(f"--text {args.text!r} does not exist")
        ids = tok(Path(args.text).read_text(encoding="utf-8"), return_tensors="pt")["input_ids"][:, : args.max_tokens]
    else:
        ids = torch.from_numpy(load_sequences(args.data, args.max_tokens, 1, tok))
    try:
        report = run(model, ids.to(model.device), Path(args.out), args.layers, args.heads, args.block)
    except NoForgetGateError as e:
        print(f"fox-eval inspect: {e}")
        return
    for i, layer in enumerate(report["layers"]):
        times = " ".join(f"{h['decay_time']:.3g}" for h in layer)
        print(f"layer {i:2d}: decay times {times} | pruning would skip {report['pruned_fraction_per_layer'][i]:.0%}")
    print(f"wrote {args.out}/inspect.json, decay_times.png and the per-head figures")


def _niah(args) -> None:
    import os

    from transformers import AutoTokenizer

    from fox_eval import niah
    from fox_eval.per_token_loss import load_model

    model = load_model(args.model, _device(args.device))
    tok = AutoTokenizer.from_pretrained(args.model)
    judge = None
    if args.judge_url:
        judge = {"url": args.judge_url, "model": args.judge_model, "api_key": os.environ.get("FOX_EVAL_JUDGE_API_KEY")}
    report = niah.run(model, tok, Path(args.out), args.mode, args.lengths, args.depths, args.max_new_tokens,
                      args.limit, judge)
    print(f"mean score {report['mean_score']:.2f} / 10 over {len(report['results'])} prompts -> {args.out}")


def _harness(args) -> None:
    from fox_eval import harness
    from fox_eval.per_token_loss import check_model_dir

    for path in args.model:
        check_model_dir(path)
    if args.include_path and not Path(args.include_path).exists():
        raise FileNotFoundError(f"--include-path {args.include_path!r} does not exist")
    tasks = list(harness.PAPER_TASKS) if args.tasks == ["paper"] else args.tasks
    device = str(_device(args.device))
    _, md = harness.run(args.model, tasks, Path(args.out), args.include_path, args.limit, args.batch_size, device)
    print(md)


def _longbench(args) -> None:
    import json

    from transformers import AutoTokenizer

    from fox_eval import longbench
    from fox_eval.per_token_loss import check_model_dir, load_model

    check_model_dir(args.model)
    if not Path(args.data).is_dir():
        raise FileNotFoundError(f"--data {args.data!r} is not a folder of LongBench <task>.jsonl files")
    unknown = [t for t in args.tasks if t not in longbench.TASKS]
    if unknown:
        raise ValueError(f"--tasks: unknown LongBench tasks {unknown}; known: {longbench.TASKS}")
    prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else None
    model = load_model(args.model, _device(args.device))
    tok = AutoTokenizer.from_pretrained(args.model)
    longbench.run(model, tok, Path(args.data), Path(args.out), args.tasks, args.budget, args.limit, prompts)
    print((Path(args.out) / "longbench.md").read_text())


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fox-eval", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("per-token-loss", help="L(i) over held-out sequences, with figures")
    p.add_argument("--model", nargs="+", required=True, help="Hugging Face model directories")
    p.add_argument("--data", required=True, help="tokens:PATH (.npy/.bin), text:PATH (file or folder) or zarr:PATH")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--limit", type=int, default=None, help="at most this many sequences")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--train-len", type=int, default=None, help="training context length, marked on the plot")
    p.add_argument("--out", default="eval/per_token_loss")
    p.add_argument("--device", default="auto")
    p.set_defaults(func=_per_token_loss)
    g = sub.add_parser("generate", help="continue a prompt")
    g.add_argument("--model", required=True)
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--device", default="auto")
    g.set_defaults(func=_generate)
    i = sub.add_parser("inspect", help="forget gates, decay times, F / attention maps, pruning fractions")
    i.add_argument("--model", required=True)
    i.add_argument("--text", help="a text file to run the model on")
    i.add_argument("--data", help="or held-out data: tokens:PATH, text:PATH or zarr:PATH (first sequence)")
    i.add_argument("--max-tokens", type=int, default=4096)
    i.add_argument("--layers", type=int, nargs="*", default=None, help="layers to draw (default: first and last)")
    i.add_argument("--heads", type=int, nargs="*", default=None, help="heads to draw (default: all)")
    i.add_argument("--block", type=int, default=128, help="tile size for the pruning count")
    i.add_argument("--out", default="eval/inspect")
    i.add_argument("--device", default="auto")
    i.set_defaults(func=_inspect)
    n = sub.add_parser("niah", help="needle in a haystack, scored offline (optional LLM judge)")
    n.add_argument("--model", required=True)
    n.add_argument("--mode", choices=["standard", "easy"], default="standard")
    n.add_argument("--lengths", type=int, nargs="*", default=None, help="default: linspace(1000, 32000, 11)")
    n.add_argument("--depths", type=float, nargs="*", default=None, help="default: linspace(0, 100, 11)")
    n.add_argument("--max-new-tokens", type=int, default=32)
    n.add_argument("--limit", type=int, default=None, help="only the first N (length, depth) cells")
    n.add_argument("--judge-url", default=None, help="OpenAI-compatible base URL (key: $FOX_EVAL_JUDGE_API_KEY)")
    n.add_argument("--judge-model", default="gpt-4o-mini")
    n.add_argument("--out", default="eval/niah")
    n.add_argument("--device", default="auto")
    n.set_defaults(func=_niah)
    h = sub.add_parser("harness", help="lm-eval-harness tasks, with markdown and LaTeX tables")
    h.add_argument("--model", nargs="+", required=True)
    h.add_argument("--tasks", nargs="+", default=["paper"], help="'paper' (the 11 zero-shot tasks) or task names")
    h.add_argument("--include-path", default=None, help="a folder of local lm-eval task YAML files")
    h.add_argument("--limit", type=float, default=None, help="examples per task (or a fraction)")
    h.add_argument("--batch-size", type=int, default=1)
    h.add_argument("--out", default="eval/harness")
    h.add_argument("--device", default="auto")
    h.set_defaults(func=_harness)
    lb = sub.add_parser("longbench", help="LongBench v1, the 14 English tasks")
    lb.add_argument("--model", required=True)
    lb.add_argument("--data", required=True, help="folder with LongBench <task>.jsonl files")
    lb.add_argument("--tasks", nargs="+", default=None, help="default: all 14")
    lb.add_argument("--prompts", default=None, help="LongBench's dataset2prompt.json (exact prompts)")
    lb.add_argument("--budget", type=int, default=15500, help="prompt tokens kept (middle truncation)")
    lb.add_argument("--limit", type=int, default=None, help="samples per task")
    lb.add_argument("--out", default="eval/longbench")
    lb.add_argument("--device", default="auto")
    lb.set_defaults(func=_longbench)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if getattr(args, "func", None) is _longbench and args.tasks is None:
        from fox_eval.longbench import TASKS

        args.tasks = list(TASKS)
    try:
        args.func(args)
    except (FileNotFoundError, ValueError, ImportError) as e:
        raise SystemExit(f"fox-eval: {e}") from None


if __name__ == "__main__":
    main()
