"""A needle-in-a-haystack analog on C code (the paper's retrieval test, in the corpus the models were
trained on; fox_eval.niah asks an English question that these models never saw).

The haystack is a held-out document (one kernel source directory, scripts/paper_corpus.py). The needle is a
unique definition on a line of its own, ``static const unsigned int <name> = <value>;`` with a made-up name
and a 6-digit value, placed at a depth (0-100% of the haystack, moved back to just after a newline). The
prompt ends with its use, ``\\tBUILD_BUG_ON(<name> !=``, and the model must complete the value. Scoring is
exact: a cell counts as found when greedy decoding would produce every token of `` <value>`` — read off one
forward pass over prompt + value (teacher forcing), which is the same test as decoding step by step, since
greedy decoding reproduces the value exactly when the argmax at each of its positions is its next token.
Every prompt is exactly ``length`` tokens (haystack trimmed to fit), starting with <|endoftext|>.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

EOT = 50256
LENGTHS = [4096, 8192, 16384, 32768, 65536]
DEPTHS = [float(d) for d in range(0, 101, 10)]


def _enc(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_needle(rng: random.Random) -> tuple[str, str, str]:
    """(definition line, use, answer): a name that occurs in no kernel file and a 6-digit value."""
    name = "fx_" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8)) + "_magic"
    value = str(rng.randint(100000, 999999))
    return f"static const unsigned int {name} = {value};\n", f"\n\tBUILD_BUG_ON({name} !=", f" {value}"


def build(tokenizer, haystack: np.ndarray, length: int, depth: float, needle: tuple[str, str, str]):
    """(input ids of exactly ``length`` tokens, answer ids, needle position): EOT + haystack[:a] + definition
    + haystack[a:b] + use + answer, the last token dropped (it is only ever a target)."""
    if not 0 <= depth <= 100:
        raise ValueError(f"needle depth must lie in [0, 100], got {depth}")
    definition, use, answer = needle
    nl = _enc(tokenizer, "\n")
    need = _enc(tokenizer, definition)
    full = _enc(tokenizer, use + answer)
    query = _enc(tokenizer, use)
    ans = full[len(query):] if full[: len(query)] == query else _enc(tokenizer, answer)
    query = full[: len(full) - len(ans)]
    budget = length + 1 - 1 - len(need) - len(query) - len(ans)  # +1: the dropped last token; -1: EOT
    if budget <= 0:
        raise ValueError(f"length {length} leaves no room for a haystack")
    if budget > len(haystack):
        raise ValueError(f"the haystack holds {len(haystack)} tokens, fewer than the {budget} needed for {length}")
    hay = [int(t) for t in haystack[:budget]]
    at = int(round(budget * depth / 100))
    # move back to just after a newline, so the definition is a line of its own (at 100% too: the haystack
    # is cut mid-line)
    while at > 0 and hay[at - len(nl) : at] != nl:
        at -= 1
    ids = [EOT, *hay[:at], *need, *hay[at:], *query, *ans]
    return ids[:-1], ans, 1 + at


def score(model, rows: list[list[int]], answers: list[list[int]], device) -> list[dict]:
    """For prompts of one length: whether greedy decoding reproduces each answer exactly, and the share of
    its tokens predicted (argmax) right."""
    import torch

    from fox_eval.loading import autocast

    keep = max(len(a) for a in answers)
    x = torch.tensor(rows, device=device)
    with torch.no_grad(), autocast(device):
        logits = model(input_ids=x, logits_to_keep=keep, use_cache=False).logits
    pred = logits.argmax(-1).cpu().numpy()
    out = []
    for i, ans in enumerate(answers):
        got = pred[i, keep - len(ans) :]
        right = got == np.asarray(ans)
        out.append({"found": bool(right.all()), "token_accuracy": float(right.mean())})
    return out


def run(model, tokenizer, haystacks: np.ndarray, lengths=None, depths=None, samples: int = 4, batch: int = 1,
        seed: int = 0, device=None) -> dict:
    """Every (length, depth) cell with ``samples`` needles, each in another held-out document; returns the
    found rate per cell (a grid: depths x lengths) and the rows."""
    lengths, depths = list(lengths or LENGTHS), list(depths or DEPTHS)
    device = device or model.device
    if len(haystacks) < samples:
        raise ValueError(f"the needle test needs {samples} held-out documents, got {len(haystacks)}")
    rng = random.Random(seed)
    rows = []
    for length in lengths:
        for depth in depths:
            cases = [build(tokenizer, haystacks[s], length, depth, make_needle(rng)) for s in range(samples)]
            for b in range(0, samples, batch):
                part = cases[b : b + batch]
                for s, res in zip(range(b, b + len(part)), score(model, [c[0] for c in part], [c[1] for c in part], device)):
                    rows.append({"length": length, "depth": depth, "document": s, "needle_token": part[s - b][2], **res})
    grid = np.zeros((len(depths), len(lengths)))
    tokens = np.zeros_like(grid)  # the share of the value's tokens the argmax gets right: partial recall
    for r in rows:
        cell = depths.index(r["depth"]), lengths.index(r["length"])
        grid[cell] += r["found"] / samples
        tokens[cell] += r["token_accuracy"] / samples
    return {"lengths": lengths, "depths": depths, "samples": samples, "grid_found": grid.tolist(),
            "found_by_length": {str(L): float(grid[:, j].mean()) for j, L in enumerate(lengths)},
            "found_all": float(grid.mean()),
            "token_accuracy_by_length": {str(L): float(tokens[:, j].mean()) for j, L in enumerate(lengths)},
            "token_accuracy_all": float(tokens.mean()), "rows": rows}


def heatmap(result: dict, path: Path, title: str, train_len: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.asarray(result["grid_found"])
    lengths, depths = result["lengths"], result["depths"]
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{L // 1024}k" if L >= 1024 else str(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0f}%" for d in depths])
    if train_len is not None:  # a line between the cells within the training length and those beyond it
        inside = sum(train_len >= L for L in lengths)
        if 0 < inside < len(lengths):
            ax.axvline(inside - 0.5, color="black", linewidth=1.5, linestyle="--")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("definition depth")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=f"found (exact greedy value), {result['samples']} needles a cell")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """``python scripts/code_needle.py MODEL_DIR DATA_DIR OUT.json``: the test on a trained model."""
    import argparse

    import torch

    from fox_models import JSONGPT2Tokenizer
    from fox_train.linux_corpus import heldout_documents

    ap = argparse.ArgumentParser(prog="code_needle.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("data", type=Path, help="the prepared corpus (heldout.npy, heldout_index.json)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    import fox_models  # noqa: F401  (registers the FoX model types)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model).to(device).eval()
    lengths = [int(x) for x in args.lengths.split(",")]
    hay = heldout_documents(args.data, max(lengths) + 64, args.samples)
    result = run(model, JSONGPT2Tokenizer(), hay, lengths, samples=args.samples)
    args.out.write_text(json.dumps(result, indent=1))
    heatmap(result, args.out.with_suffix(".png"), args.model.name)


if __name__ == "__main__":
    main()
