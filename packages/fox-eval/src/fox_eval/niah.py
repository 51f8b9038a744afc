"""Needle in a haystack (FOX.md section 5): the paper's needle, question, lengths and depths.

The haystack is public-domain text shipped with fox-eval (the historical books of the King James
Bible). Answers are scored offline by how much of the needle's continuation the model reproduces
(0-10); an LLM judge on an OpenAI-compatible endpoint can score them as well (``--judge-url``).
"""

from __future__ import annotations

import json
import lzma
import re
import urllib.request
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco? Answer: The best thing to do in San Francisco is"
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day."
EASY_NEEDLE = f"{QUESTION} {ANSWER}"
LENGTHS = [int(x) for x in np.linspace(1000, 32000, 11)]
DEPTHS = [float(x) for x in np.linspace(0, 100, 11)]


def haystack_text() -> str:
    path = resources.files("fox_eval") / "assets" / "haystack_kjv.txt.xz"
    with lzma.open(path.open("rb"), "rt", encoding="utf-8") as f:
        return f.read()


def build_prompt(tokenizer, haystack_ids: list[int], length: int, depth: float, mode: str = "standard"):
    """Token ids of a prompt of exactly ``length`` tokens (BOS included) with the needle at ``depth`` percent
    of the haystack, moved back to the start of a sentence. Returns (ids, needle token offset)."""
    if mode not in ("standard", "easy"):
        raise ValueError(f"--mode must be standard or easy, got {mode!r}")
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    needle = enc(" " + (EASY_NEEDLE if mode == "easy" else NEEDLE) + " ")
    question = enc("\n\n" + QUESTION)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    budget = length - len(needle) - len(question) - len(bos)
    if budget <= 0:
        raise ValueError(f"context length {length} is too short for the needle and question")
    if budget > len(haystack_ids):
        raise ValueError(f"the haystack holds {len(haystack_ids)} tokens, fewer than the {budget} needed for {length}")
    hay = haystack_ids[:budget]
    at = int(round(budget * depth / 100))
    period = set(enc(".")) | set(enc(". "))
    while 0 < at < budget and hay[at - 1] not in period:
        at -= 1
    ids = bos + hay[:at] + needle + hay[at:] + question
    return ids, len(bos) + at


def score_offline(continuation: str) -> float:
    """0-10: the share of the answer's words that the continuation reproduces in order from its start."""
    want = re.findall(r"[a-z]+", ANSWER.lower())
    got = re.findall(r"[a-z]+", continuation.lower())
    n = 0
    while n < min(len(want), len(got)) and want[n] == got[n]:
        n += 1
    return 10.0 * n / len(want)


def score_with_judge(continuation: str, url: str, model: str, api_key: str | None) -> float:
    """1-10 from an LLM judge behind an OpenAI-compatible chat completions endpoint."""
    prompt = (f"Reference answer: {ANSWER}\nModel answer: {continuation}\nOn a scale of 1 to 10, how well does the "
              "model answer match the reference? Reply with the number only.")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/chat/completions", data=body, headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = json.load(r)["choices"][0]["message"]["content"]
    m = re.search(r"\d+(\.\d+)?", text)
    return float(m.group()) if m else 0.0


@torch.no_grad()
def run(model, tokenizer, out: Path, mode: str, lengths=None, depths=None, max_new_tokens: int = 32,
        limit: int | None = None, judge: dict | None = None) -> dict:
    lengths, depths = lengths or LENGTHS, depths or DEPTHS
    hay_ids = tokenizer(haystack_text(), add_special_tokens=False)["input_ids"]
    cells = [(L, d) for L in lengths for d in depths][:limit]
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for length, depth in tqdm(cells, desc=f"niah ({mode})", unit="prompt"):
        ids, _ = build_prompt(tokenizer, hay_ids, length, depth, mode)
        x = torch.tensor([ids], device=model.device)
        gen = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(gen[0, len(ids):], skip_special_tokens=True)
        row = {"length": length, "depth": depth, "continuation": text, "score": score_offline(text)}
        if judge:
            row["judge_score"] = score_with_judge(text, **judge)
        results.append(row)
    report = {"mode": mode, "lengths": lengths, "depths": depths, "results": results,
              "mean_score": float(np.mean([r["score"] for r in results]))}
    (out / f"niah_{mode}.json").write_text(json.dumps(report, indent=1))
    heatmap(results, lengths, depths, out / f"niah_{mode}.png", f"needle in a haystack ({mode})")
    return report


def heatmap(results, lengths, depths, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.full((len(depths), len(lengths)), np.nan)
    for r in results:
        grid[depths.index(r["depth"]), lengths.index(r["length"])] = r.get("judge_score", r["score"])
    fig, ax = plt.subplots(figsize=(8, 5))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=10, aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{L // 1000}k" if L >= 1000 else str(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0f}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="score")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
