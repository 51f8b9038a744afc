"""Needle in a haystack with the prompt structure of the paper's evaluation (docs/evaluation.md).

A prompt of context length L is: BOS, the first L - 200 - len(needle) tokens of the haystack with the needle
on a line of its own inserted at the requested depth (moved back to just after a period; at 100% it ends the
haystack), then the instruction and the retrieval question. The 200 tokens held back are the official
script's allowance for the question and the answer. Greedy decoding of up to 1024 new tokens, as the
official script; the answer is scored offline (0-10, how much of the needle's continuation the model
reproduces) and, with ``--judge-url``, by an LLM judge with the official judge prompt (1-10).

The default haystack is public-domain text shipped with fox-eval (the historical books of the King James
Bible); ``--haystack DIR`` takes the ``.txt`` files of a folder instead (the paper used Paul Graham's essays).
"""

from __future__ import annotations

import json
import lzma
import re
import sys
import time
import urllib.request
from importlib import resources
from pathlib import Path

import numpy as np

from fox_eval.loading import autocast

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco? Answer: The best thing to do in San Francisco is"
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day."
EASY_NEEDLE = f"{QUESTION} {ANSWER}"
INSTRUCTION = ("There is an important piece of information hidden inside the above document. Now that you've read "
               "the document, I will quiz you about it. Answer the following question: ")
RESERVED_TOKENS = 200
MAX_NEW_TOKENS = 1024
LENGTHS = [int(x) for x in np.round(np.linspace(1000, 32000, 11))]
DEPTHS = [float(x) for x in np.round(np.linspace(0, 100, 11))]

JUDGE_MODEL = "gpt-4o-2024-08-06"
JUDGE_SYSTEM = "You are a helpful assistant."
JUDGE_QUESTION = "What is the best thing to do in San Francisco?"
JUDGE_CRITERIA = (
    "For this evaluation, you should primarily consider the following criteria:\naccuracy: \n"
    "    Score 1: The answer is completely unrelated to the reference.\n"
    "    Score 3: The answer has minor relevance but does not align with the reference.\n"
    "    Score 5: The answer has moderate relevance but contains inaccuracies.\n"
    "    Score 7: The answer aligns with the reference but has minor omissions.\n"
    "    Score 10: The answer is completely accurate and aligns perfectly with the reference.\n"
    "    Only respond with a numberical score\n    \n")
JUDGE_TEMPLATE = (
    "[Instruction]\nPlease act as an impartial judge and evaluate the quality of the response provided by small "
    "language model to a question displayed below. {criteria}[Ground truth]\n{reference}\nRemember that the model "
    "is small and not instruction-tuned so it may output additional garbage content and have strange formatting. "
    "These should absolutely not affect your rating as long as the ground truth is included in the model's "
    "response. Only give your rating based on the relevant (if any) part of the response. Begin your evaluation "
    "by providing a short explanation. Be as objective as possible. After providing your explanation, you must "
    "rate the response on a scale of 1 to 10 by strictly following this format: \"[[rating]]\", for example: "
    "\"Rating: [[5]]\". Some bad models might give empty response in which case you should give the lowest "
    "score.\n\n[Question]\n{question}\n\n[The Start of the Model's Answer]\n{prediction}\n"
    "[The End of the Model's Answer]")


def needle_text(mode: str) -> str:
    """The needle as inserted: on a line of its own."""
    if mode not in ("standard", "easy"):
        raise ValueError(f"--mode must be standard or easy, got {mode!r}")
    return "\n" + (EASY_NEEDLE if mode == "easy" else NEEDLE) + "\n"


def bundled_haystack() -> str:
    path = resources.files("fox_eval") / "assets" / "haystack_kjv.txt.xz"
    with lzma.open(path.open("rb"), "rt", encoding="utf-8") as f:
        return f.read()


def haystack_text(folder: str | Path | None = None) -> str:
    """The bundled haystack, or the ``.txt`` files of ``folder`` joined in name order."""
    if folder is None:
        return bundled_haystack()
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"--haystack {str(folder)!r} is not a folder")
    files = sorted(folder.glob("*.txt"))
    text = "".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    if not text.strip():
        raise ValueError(f"--haystack {str(folder)!r} holds no text in .txt files")
    return text


def haystack_ids(tokenizer, text: str, min_tokens: int) -> list[int]:
    """At least ``min_tokens`` token ids of ``text``, read from its start and repeating it if it is shorter
    (as the official script does), without tokenizing more of a long text than needed."""
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    chars = 8 * min_tokens + 1000
    while True:
        ids = enc(text[:chars])
        if len(ids) >= min_tokens or chars >= len(text):
            break
        chars *= 2
    if not ids:
        raise ValueError("the haystack holds no tokens")
    if len(ids) < min_tokens:
        ids = enc(text * -(-min_tokens // len(ids)))
    return ids[:min_tokens] if len(ids) > min_tokens else ids


def build_prompt(tokenizer, haystack: list[int], length: int, depth: float, mode: str = "standard"):
    """Token ids of the prompt for context length ``length`` and needle depth ``depth`` percent, and the
    offset of the needle's first token. The prompt is BOS + haystack-with-needle (``length`` - 200 tokens)
    + instruction and question, so it is shorter than ``length`` by about 140 tokens, as the official one."""
    if not 0 <= depth <= 100:
        raise ValueError(f"--depths must lie in [0, 100], got {depth}")
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    needle = enc(needle_text(mode))
    tail = enc("\n\n" + INSTRUCTION + QUESTION)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    budget = length - RESERVED_TOKENS - len(needle)
    if budget <= 0:
        raise ValueError(f"--lengths: {length} is too short; a prompt keeps {RESERVED_TOKENS} tokens for the "
                         f"question and answer and {len(needle)} for the needle")
    if budget > len(haystack):
        raise ValueError(f"the haystack holds {len(haystack)} tokens, fewer than the {budget} needed for {length}")
    hay = haystack[:budget]
    if depth == 100:
        at = budget
    else:
        at = int(budget * depth / 100)
        period = set(enc("."))
        while at > 0 and hay[at - 1] not in period:
            at -= 1
    return bos + hay[:at] + needle + hay[at:] + tail, len(bos) + at


def score_offline(continuation: str) -> float:
    """0-10: the share of the answer's words that the continuation reproduces in order from its start."""
    want = re.findall(r"[a-z]+", ANSWER.lower())
    got = re.findall(r"[a-z]+", continuation.lower())
    n = 0
    while n < min(len(want), len(got)) and want[n] == got[n]:
        n += 1
    return 10.0 * n / len(want)


def judge_messages(prediction: str) -> list[dict]:
    """The official judge's chat messages: the reference is the standard needle on its own line."""
    user = JUDGE_TEMPLATE.format(criteria=JUDGE_CRITERIA, reference=needle_text("standard"),
                                 question=JUDGE_QUESTION, prediction=prediction)
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


JUDGE_TRIES = 3
"""Attempts per judge call; a call that still fails is recorded as no judgement (see ``run``)."""


def score_with_judge(prediction: str, url: str, model: str = JUDGE_MODEL, api_key: str | None = None,
                     tries: int = JUDGE_TRIES, wait: float = 2.0) -> float | None:
    """1-10 from an LLM judge behind an OpenAI-compatible chat completions endpoint (temperature 0), read
    from its "[[rating]]"; None when the reply holds no rating. A failed request is tried again after
    ``wait``, then twice that, up to ``tries`` attempts; then ValueError naming the URL."""
    body = json.dumps({"model": model, "messages": judge_messages(prediction), "temperature": 0.0}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/chat/completions", data=body, headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                text = json.load(r)["choices"][0]["message"]["content"]
            break
        except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
            if attempt == tries - 1:
                raise ValueError(f"--judge-url {url}: no judgement after {tries} tries ({type(e).__name__}: {e})") \
                    from None
            time.sleep(wait * 2**attempt)
    m = re.search(r"\[\[(\d+)\]\]", text)
    return float(m.group(1)) if m else None


def _resume(part: Path, key: str) -> dict[tuple[int, float], dict]:
    """The rows a run with the same ``key`` (model, mode, haystack, answer length) wrote to ``part`` before it
    stopped, by (length, depth); none for another key, or no file. A last line cut off mid-write is skipped."""
    try:
        lines = part.read_text().splitlines()
    except OSError:
        return {}
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    if not rows or rows[0].get("key") != key:
        return {}
    return {(r["length"], r["depth"]): r for r in rows[1:] if "length" in r}


def generate(model, tokenizer, ids: list[int], max_new_tokens: int) -> str:
    """Greedy continuation of ``ids`` (bf16 autocast on a GPU), decoded and stripped as the official script."""
    import torch  # here, not at the top: the CLI imports this module to check --lengths before loading torch

    x = torch.tensor([ids], device=model.device)
    with torch.no_grad(), autocast(model.device):
        gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             num_beams=1, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(gen[0, len(ids):], skip_special_tokens=True).strip()


def run(model, tokenizer, out: Path, mode: str, lengths=None, depths=None, max_new_tokens: int = MAX_NEW_TOKENS,
        limit: int | None = None, judge: dict | None = None, haystack: str | Path | None = None,
        resume_key: str | None = None) -> dict:
    """Every (length, depth) cell's continuation and scores, written to ``out/niah_<mode>.json``.

    Resumable: each finished cell goes to ``out/partial/niah_<mode>.jsonl`` at once, under ``resume_key``
    (the CLI's: the model's fingerprint, precision, mode, haystack and answer length); a run with the same
    key takes those cells as they are. A judge call that fails after its tries is recorded as
    ``judge_score`` None with its ``judge_error``, and a later run with the same key asks the judge again."""
    from tqdm.auto import tqdm

    # a repeated length or depth runs once and is one column or row of the heat map
    lengths, depths = list(dict.fromkeys(lengths or LENGTHS)), list(dict.fromkeys(depths or DEPTHS))
    needle_tokens = len(tokenizer(needle_text(mode), add_special_tokens=False)["input_ids"])
    hay = haystack_ids(tokenizer, haystack_text(haystack), max(1, max(lengths) - RESERVED_TOKENS - needle_tokens))
    cells = [(L, d) for L in lengths for d in depths][:limit]
    out.mkdir(parents=True, exist_ok=True)
    part = out / "partial" / f"niah_{mode}.jsonl"
    done = _resume(part, resume_key) if resume_key is not None else {}
    if resume_key is not None:
        part.parent.mkdir(exist_ok=True)
        part.write_text(json.dumps({"key": resume_key}) + "\n" + "".join(
            json.dumps(r) + "\n" for r in done.values() if not (judge and r.get("judge_error"))))
    results, failed = [], 0
    for length, depth in tqdm(cells, desc=f"niah ({mode})", unit="prompt"):
        row = done.get((length, depth))
        if row is None:
            ids, at = build_prompt(tokenizer, hay, length, depth, mode)
            text = generate(model, tokenizer, ids, max_new_tokens)
            row = {"length": length, "depth": depth, "prompt_tokens": len(ids), "needle_token": at,
                   "continuation": text, "score": score_offline(text)}
        elif not judge or (not row.get("judge_error") and "judge_score" in row):
            results.append(row)
            continue
        if judge:
            row.pop("judge_error", None)
            try:
                row["judge_score"] = score_with_judge(row["continuation"], **judge)
            except ValueError as e:
                row["judge_score"], row["judge_error"] = None, str(e)
                failed += 1
        if resume_key is not None:
            with part.open("a") as f:
                f.write(json.dumps(row) + "\n")
        results.append(row)
    if failed:
        print(f"fox-eval niah: {failed} of {len(cells)} judge calls failed; their judge_score is null "
              f"(the same command again asks the judge for those only)", file=sys.stderr)
    report = {"mode": mode, "haystack": str(haystack) if haystack else "bundled (King James Bible)",
              "lengths": lengths, "depths": depths, "max_new_tokens": max_new_tokens, "results": results,
              "mean_score": float(np.mean([r["score"] for r in results]))}
    if judge:
        judged = [r["judge_score"] for r in results if r["judge_score"] is not None]
        report["mean_judge_score"] = float(np.mean(judged)) if judged else None
    (out / f"niah_{mode}.json").write_text(json.dumps(report, indent=1))
    heatmap(results, lengths, depths, out / f"niah_{mode}.png", f"needle in a haystack ({mode})")
    return report


def heatmap(results, lengths, depths, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.full((len(depths), len(lengths)), np.nan)
    for r in results:
        value = r.get("judge_score", r["score"])
        grid[depths.index(r["depth"]), lengths.index(r["length"])] = np.nan if value is None else value
    fig, ax = plt.subplots(figsize=(8, 5))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=10, aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{L / 1000:g}k" if L >= 1000 else str(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0f}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="judge score" if any("judge_score" in r for r in results) else "score")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
