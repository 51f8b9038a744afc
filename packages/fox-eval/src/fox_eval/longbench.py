"""LongBench (v1), the 14 English tasks of the paper: prompts truncated in the middle to a token budget,
greedy generation with per-task lengths (bf16 autocast on a GPU), the standard metrics, and one table across
models.

Data: a folder with ``<task>.jsonl`` files in LongBench's format (``input``, ``context``, ``answers``,
``all_classes``), e.g. LongBench's data.zip unpacked. Prompts: LongBench's own (below); ``--prompts FILE``
takes another ``dataset2prompt.json``.
"""

from __future__ import annotations

import difflib
import json
import re
import string
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fox_eval.loading import autocast, load_model, load_tokenizer, model_labels, precision
from fox_eval.tables import tables

if TYPE_CHECKING:
    import torch

# torch and tqdm are imported inside the functions that run models: the CLI imports this module to check
# --tasks, and an argument error must not wait for torch.

TASKS = ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
         "multi_news", "trec", "triviaqa", "samsum", "lcc", "repobench-p"]
MAX_NEW_TOKENS = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32,
                  "musique": 32, "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32,
                  "samsum": 128, "lcc": 64, "repobench-p": 64}
# LongBench v1's prompts for these tasks (its config/dataset2prompt.json, typos included), as the paper used.
PROMPTS = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer "
        "the question asconcisely as you can, using a single phrase if possible. Do not provide any "
        "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you "
        "can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
        "{input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, "
        "using a single phrase or sentence if possible. If the question cannot be answered based on the "
        "information in the article, write \"unanswerable\". If the question is a yes/no question, answer "
        "\"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer "
        "the question based on the above article as concisely as you can, using a single phrase or "
        "sentence if possible. If the question cannot be answered based on the information in the "
        "article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
        "\"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
        "based on the above text, only give me the answer and do not output any other words.\n\nQuestion: "
        "{input}\nAnswer:"
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
        "{input}\nAnswer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
        "{input}\nAnswer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not output any "
        "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the "
        "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
        "{input}\nAnswer:"
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the "
        "report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
        "above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. "
        "\n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of "
        "questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some "
        "examples.\n\n{context}\n\n{input}"
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
# LongBench's own scorer keeps only the first line of trec, triviaqa and samsum answers; the paper's scorer
# keeps the first line of every answer, and so does ``score``.


def normalize_answer(s: str) -> str:
    """Lower case, drop punctuation and the articles a/an/the, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def qa_f1(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(gold)
    return 2 * p * r / (p + r)


def rouge_l(prediction: str, truth: str) -> float:
    """ROUGE-L F1 over whitespace tokens (longest common subsequence)."""
    a, b = prediction.split(), truth.split()
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def classification(prediction: str, truth: str, all_classes: list[str]) -> float:
    """1/k if the true class is among the k classes named in the prediction (ignoring classes that are only
    substrings of the true one), else 0."""
    named = [c for c in all_classes if c in prediction]
    named = [c for c in named if not (c in truth and c != truth)]
    return 1.0 / len(named) if truth in named else 0.0


def code_sim(prediction: str, truth: str) -> float:
    """Similarity to the truth of the prediction's first line holding no `, # or // (LongBench's rule), as a
    difflib ratio rounded to a percent (fuzzywuzzy's ratio without python-Levenshtein), 0-1."""
    line = next((ln for ln in prediction.lstrip("\n").split("\n") if not any(c in ln for c in ("`", "#", "//"))), "")
    return round(100 * difflib.SequenceMatcher(None, line, truth).ratio()) / 100


METRIC = {**{t: qa_f1 for t in ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa")},
          **{t: rouge_l for t in ("gov_report", "qmsum", "multi_news", "samsum")},
          "trec": classification, "lcc": code_sim, "repobench-p": code_sim}


def score(task: str, prediction: str, answers: list[str], all_classes: list[str] | None = None) -> float:
    """The task's metric (0-1) of the prediction's first line against the best of the answers."""
    prediction = prediction.lstrip("\n").split("\n")[0]
    fn = METRIC[task]
    if fn is classification:
        return max(classification(prediction, a, all_classes or []) for a in answers)
    return max(fn(prediction, a) for a in answers)


def truncate_middle(ids: list[int], budget: int) -> list[int]:
    """Keep the first and last budget/2 tokens of a prompt longer than budget."""
    if len(ids) <= budget:
        return ids
    half = budget // 2
    return ids[:half] + ids[len(ids) - (budget - half):]


def load_rows(data_dir: Path, task: str, limit: int | None = None) -> list[dict]:
    """The first ``limit`` samples of ``<task>.jsonl`` in LongBench's format; a line that is no JSON object,
    or a sample without its list of ``answers``, raises ValueError naming the file and the line."""
    path = data_dir / f"{task}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"--data {str(data_dir)!r} has no {task}.jsonl")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"--data {str(path)!r} line {number} is not JSON: {e}") from None
        answers = row.get("answers") if isinstance(row, dict) else None
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise ValueError(f"--data {str(path)!r} line {number}: a LongBench sample needs \"answers\", a list of "
                             f"strings, got {answers!r}")
        rows.append(row)
        if limit is not None and len(rows) == limit:
            break
    return rows


def check_prompts(prompts) -> None:
    """``--prompts``: a JSON object of task -> template whose only fields are {context} and {input}."""
    import string

    if not isinstance(prompts, dict):
        raise ValueError(f"--prompts must hold a JSON object of task -> prompt template, got {type(prompts).__name__}")
    for task, template in prompts.items():
        if not isinstance(template, str):
            raise ValueError(f"--prompts {task!r}: a template must be a string, got {type(template).__name__}")
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError as e:
            raise ValueError(f"--prompts {task!r}: {e}") from None
        if fields - {"context", "input"}:
            raise ValueError(f"--prompts {task!r}: a template may hold {{context}} and {{input}} only, got "
                             f"{sorted(fields - {'context', 'input'})}")


def run(model, tokenizer, data: dict[str, list[dict]], out: Path, budget: int = 15500,
        prompts: dict | None = None) -> dict:
    """One model on ``data`` (task -> its samples, ``load_rows``'): task -> score (0-100) and their average;
    predictions in ``out/<task>.jsonl``."""
    import torch
    from tqdm.auto import tqdm

    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for task, rows in data.items():
        template = (prompts or {}).get(task, PROMPTS[task])
        preds, scores = [], []
        for row in tqdm(rows, desc=f"longbench {task}", unit="sample"):
            prompt = template.format(context=row.get("context", ""), input=row.get("input", ""))
            ids = truncate_middle(tokenizer(prompt)["input_ids"], budget)
            x = torch.tensor([ids], device=model.device)
            with torch.no_grad(), autocast(model.device):
                gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW_TOKENS[task],
                                     do_sample=False, num_beams=1, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.eos_token_id)
            pred = tokenizer.decode(gen[0, len(ids):], skip_special_tokens=True)
            preds.append(pred)
            scores.append(score(task, pred, row["answers"], row.get("all_classes")))
        results[task] = 100 * float(np.mean(scores)) if scores else float("nan")
        (out / f"{task}.jsonl").write_text("\n".join(json.dumps({"pred": p, "answers": r["answers"], "score": s})
                                                     for p, r, s in zip(preds, rows, scores)))
    results["average"] = float(np.mean([v for k, v in results.items() if k != "average"]))
    (out / "longbench.json").write_text(json.dumps(results, indent=1))
    md = "| task | score |\n|---|---|\n" + "".join(f"| {k} | {v:.2f} |\n" for k, v in results.items())
    (out / "longbench.md").write_text(md)
    return results


def run_models(models: list[str], data_dir: Path, out: Path, tasks: list[str], budget: int = 15500,
               limit: int | None = None, prompts: dict | None = None, device: torch.device | str = "cpu",
               labels: list[str] | None = None) -> tuple[dict[str, dict[str, float]], str]:
    """Each model folder in turn (its predictions under ``out/<label>/``), then longbench.json and
    longbench.md / longbench.tex with one row per model and one column per task, as the paper's table."""
    import torch

    names = model_labels(models, labels)
    if prompts is not None:
        check_prompts(prompts)
    data = {task: load_rows(data_dir, task, limit) for task in tasks}  # read and checked once, before a model loads
    per_model = {}
    for path, name in zip(models, names):
        model = load_model(path, torch.device(device))
        per_model[name] = run(model, load_tokenizer(path), data, out / name, budget, prompts)
        del model
    md, tex = tables(per_model, [*tasks, "average"])
    settings = {"tasks": tasks, "budget": budget, "limit": limit, "prompts": "--prompts" if prompts else "LongBench",
                "precision": precision(device), "models": {n: str(Path(p).resolve()) for n, p in zip(names, models)}}
    (out / "longbench.json").write_text(json.dumps({"settings": settings, "table": per_model}, indent=1))
    (out / "longbench.md").write_text(md)
    (out / "longbench.tex").write_text(tex)
    return per_model, md
