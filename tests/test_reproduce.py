"""scripts/reproduce.py end to end on the CPU: a small corpus slice -> two tiny models -> report."""

import json
import lzma
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_heads=2", "data.seq_len=64",
        "global_batch_tokens=256", "micro_batch_size=2", "schedule.total_tokens=1536", "schedule.warmup_tokens=256",
        "eval_every=3", "eval_sequences=2", "log_every=1"]


def write_slice(path: Path, seed: int = 0) -> None:
    rng = random.Random(seed)
    with lzma.open(path, "wt", encoding="utf-8") as f:
        for i in range(24):
            lines = [f"\tu32 reg_{rng.randint(0, 999)} = readl(base + {rng.randint(0, 255):#x});" for _ in range(rng.randint(40, 90))]
            f.write(json.dumps({"path": f"drivers/f{i}.c", "split": "heldout" if i % 4 == 0 else "train",
                                "text": "#include <linux/io.h>\n" + "\n".join(lines)}) + "\n")


def reproduce(*args, out: Path):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce.py"), *args, "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)


@pytest.mark.slow
def test_reproduce_all_on_cpu(tmp_path):
    write_slice(tmp_path / "slice.jsonl.xz")
    out, docs = tmp_path / "out", tmp_path / "docs"
    docs.mkdir()  # a page that already summarises paper-scale runs keeps that section
    (docs / "results.md").write_text("# old page\n\n## Paper scale (125M, 16k)\n\nkept: 3.724 nats\n")
    sets = [a for s in TINY for a in ("--set", s)]
    r = reproduce("all", "--slice", str(tmp_path / "slice.jsonl.xz"), "--models", "fox_pro,transformer_llama",
                  "--docs", str(docs), "--eval-factor", "2", "--eval-docs", "3", "--eval-batch", "2", *sets, out=out)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((docs / "results" / "results.json").read_text())
    ev = results["evaluation"]
    assert ev["train_len"] == 64 and ev["eval_len"] == 128 and ev["eval_documents"] == 3
    for name in ("fox_pro", "transformer_llama"):
        s = ev["models"][name]
        assert 3 < s["loss_first_L"] < 12 and s["end_over_L"] > 0  # trained a little from ln(50257) = 10.8
        assert results["training"][name]["tokens"] == 1536 and results["training"][name]["steps"] == 6
    pruning = ev["models"]["fox_pro"]["pruning"]
    assert set(pruning["by_length"]) == {"64", "128"} and 0 <= pruning["by_length"]["128"]["tiles_pruned"] <= 1
    assert "pruning" not in ev["models"]["transformer_llama"]  # no forget gate, nothing to prune
    assert len(ev["models"]["fox_pro"]["inspect"]["decay_times"]) == 2
    for fig in ("per_token_loss", "training_curves", "decay_times", "forget_and_attention"):
        assert (docs / "results" / f"{fig}.png").stat().st_size > 10_000
    page = (docs / "results.md").read_text()
    assert "| FoX (Pro) |" in page and "| Transformer (LLaMA) |" in page and "The paper's orderings" in page
    assert page.endswith("results.json).\n\n## Paper scale (125M, 16k)\n\nkept: 3.724 nats\n")
    assert "# old page" not in page
    r = reproduce("report", "--docs", str(tmp_path / "fresh"), "--models", "fox_pro,transformer_llama", out=out)
    assert r.returncode == 0, r.stderr[-3000:]
    fresh = (tmp_path / "fresh" / "results.md").read_text()
    assert fresh.count("## Paper scale (125M, 16k)") == 1 and "results-paper-125m*.md" in fresh

    again = reproduce("train", "--models", "fox_pro", *sets, out=out)  # trained models are not trained again
    assert again.returncode == 0 and "trained already" in again.stdout


def test_bad_arguments_are_named(tmp_path):
    r = reproduce("train", "--models", "fox_pro,gpt5", out=tmp_path)
    assert r.returncode != 0 and "--models: unknown ['gpt5']" in r.stderr
    r = reproduce("prepare", "--slice", str(tmp_path / "none.jsonl.xz"), out=tmp_path)
    assert r.returncode != 0 and "none.jsonl.xz' does not exist" in r.stderr
    r = reproduce("evaluate", out=tmp_path)
    assert r.returncode != 0 and "no prepared corpus under" in r.stderr
