"""scripts/reproduce.py --scale paper-125m: its experiments are the official 125M ones, its corpus holds
directory documents split by directory, and the whole pipeline runs end to end on the CPU at a tiny size."""

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

OFFICIAL = {
    "fox_pro": "longcrawl64/forgetting_transformer/pro_125m_2b",
    "fox_llama": "longcrawl64/forgetting_transformer/llama_125m_2b",
    "transformer_pro": "longcrawl64/transformer/pro_125m_2b",
    "transformer_llama": "longcrawl64/transformer/llama_125m_2b",
    "delta_net": "longcrawl64/delta_net/125m_2b",
}
# What the reproduction may change, and why: where the data is (the Linux corpus, not LongCrawl64), how it is
# spread over GPUs (DDP on one host), the token budget (warmup checked apart: the official share of it), where
# runs go, how often a short run logs and evaluates, and torch.compile (speed only).
MAY_DIFFER = {"data.source", "data.path", "data.heldout_path", "schedule.total_tokens", "schedule.warmup_tokens",
              "out_dir", "run_name", "log_every", "eval_every", "compile"}


def _leaves(cfg):
    from dataclasses import asdict

    from fox_train.config import leaves

    return leaves(asdict(cfg))


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_paper_experiments_are_the_official_ones(name):
    from fox_train.cli import compose

    ours = _leaves(compose([f"experiment=repro_paper/{name}"]))
    official = _leaves(compose([f"experiment={OFFICIAL[name]}"]))
    assert ours.keys() == official.keys()
    differ = {k for k in ours if ours[k] != official[k]}
    strategy = {k for k in differ if k.startswith("strategy.")}
    assert strategy <= {"strategy.name", "strategy.devices"} and ours["strategy.name"] == "ddp"
    assert differ - strategy <= MAY_DIFFER, sorted(differ - strategy - MAY_DIFFER)
    assert ours["data.seq_len"] == 16384 and ours["model.hidden_size"] == 768 and ours["global_batch_tokens"] == 524288
    assert ours["schedule.total_tokens"] < official["schedule.total_tokens"]
    from repro_report import OFFICIAL_TOKENS

    assert official["schedule.total_tokens"] == OFFICIAL_TOKENS  # the budget the report scales against
    share = ours["schedule.warmup_tokens"] / ours["schedule.total_tokens"]
    assert share == pytest.approx(official["schedule.warmup_tokens"] / official["schedule.total_tokens"], rel=1e-6)
    assert ours["schedule.total_tokens"] % ours["global_batch_tokens"] == 0


def write_tree(root: Path, dirs: int = 48, seed: int = 0) -> None:
    """A small kernel-like tree: directories of a few C files, each file a few hundred lines."""
    rng = random.Random(seed)
    for d in range(dirs):
        folder = root / "drivers" / f"dev{d:02d}"
        folder.mkdir(parents=True)
        for f in range(rng.randint(2, 4)):
            lines = [f"\tu32 reg_{rng.randint(0, 999)} = readl(base + {rng.randint(0, 255):#x});" for _ in range(rng.randint(60, 120))]
            (folder / f"part{f}.c").write_text(f"#include <linux/io.h>\n/* dev{d} part {f} */\n" + "\n".join(lines) + "\n")
        (folder / "notes.txt").write_text("not C")


def test_directory_documents_and_split(tmp_path):
    import paper_corpus

    from fox_train.linux_corpus import read_slice

    write_tree(tmp_path / "tree")
    s = paper_corpus.write_slice(paper_corpus.iter_tree(tmp_path / "tree"), tmp_path / "s.jsonl.xz", train_mb=0,
                                 heldout_percent=30, min_heldout_kb=6, heldout_kb=7)
    files = read_slice(tmp_path / "s.jsonl.xz")
    held, train = {p for p, _ in files["heldout"]}, {p for p, _ in files["train"]}
    assert held and train and not held & train and s["heldout_docs"] == len(held)
    assert len(held) + len(train) <= 48 and len(train) == s["train_docs"]
    for path, text in files["heldout"] + files["train"]:
        headers = [line for line in text.splitlines() if line.startswith("/* file: ")]
        assert headers == sorted(headers) and all(h.startswith(f"/* file: {path}/") for h in headers)  # one directory, path order
        assert "not C" not in text
    for _, text in files["heldout"]:
        assert len(text) >= 6 * 1024  # long enough, cut only after a whole file past 7 KB
        assert text.endswith("\n") and text.count("/* file: ") <= 4


def test_documents_tokenized_file_by_file_equal_whole(tmp_path):
    import paper_corpus

    from fox_models import JSONGPT2Tokenizer
    from fox_train.linux_corpus import read_slice, tokenize_files

    write_tree(tmp_path / "tree", dirs=12, seed=3)
    paper_corpus.write_slice(paper_corpus.iter_tree(tmp_path / "tree"), tmp_path / "s.jsonl.xz", train_mb=0,
                             heldout_percent=30, min_heldout_kb=1, heldout_kb=4)
    files = read_slice(tmp_path / "s.jsonl.xz")
    texts = [t for _, t in files["train"] + files["heldout"]]
    texts.insert(2, "")  # an empty document keeps its EOT
    texts.append("int x;\n/* file: a/b.c */\nint y; /* file: not a header */\n")
    tok = JSONGPT2Tokenizer()
    whole, whole_offsets = tokenize_files(texts, tok)
    by_file, offsets = paper_corpus.tokenize_documents(texts, tok)
    assert sum(t.count("/* file: ") for t in texts) > len(texts)  # documents of several files
    np.testing.assert_array_equal(by_file, whole)
    np.testing.assert_array_equal(offsets, whole_offsets)


def reproduce(*args, out: Path):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce.py"), *args, "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)


TINY = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_heads=2", "data.seq_len=256",
        "global_batch_tokens=1024", "micro_batch_size=2", "compile=false", "eval_every=2", "eval_sequences=2",
        "log_every=1"]


@pytest.mark.slow
def test_paper_pipeline_on_cpu(tmp_path):
    import paper_corpus

    write_tree(tmp_path / "tree", dirs=60)
    paper_corpus.write_slice(paper_corpus.iter_tree(tmp_path / "tree"), tmp_path / "s.jsonl.xz", train_mb=0,
                             heldout_percent=25, min_heldout_kb=6, heldout_kb=8)
    out, docs = tmp_path / "out", tmp_path / "docs"
    sets = [a for s in TINY for a in ("--set", s)]
    r = reproduce("all", "--scale", "paper-125m", "--slice", str(tmp_path / "s.jsonl.xz"), "--models",
                  "fox_pro,transformer_llama", "--devices", "1", "--tokens-per-device", "3000", "--docs", str(docs),
                  "--eval-docs", "4", "--eval-batch", "2", "--needle-samples", "1", "--inspect-len", "256", *sets, out=out)
    assert r.returncode == 0, r.stderr[-3000:]
    corpus = json.loads((out / "data" / "corpus.json").read_text())
    assert corpus["heldout_long_docs"] >= 4 and corpus["min_heldout_tokens"] == 1024

    results = out / "results"
    shipped = [p for p in results.rglob("*") if p.is_file()]
    assert {p.suffix for p in shipped} == {".json", ".png"} and max(p.stat().st_size for p in shipped) < 16e6
    for name in ("fox_pro", "transformer_llama"):
        rec = json.loads((results / f"{name}.json").read_text())
        ev = rec["evaluation"]
        assert ev["train_len"] == 256 and ev["eval_len"] == 1024 and ev["eval_documents"] == 4 and len(rec["curve"]) == 1024
        assert 3 < ev["loss_first_L"] < 12
        assert rec["config"]["schedule"]["total_tokens"] == 3072 and rec["config"]["schedule"]["warmup_tokens"] == 307
        assert rec["config"]["strategy"]["name"] == "single" and rec["config"]["data"]["seq_len"] == 256
        assert [r["tokens"] for r in rec["training"]["records"] if "loss" in r][-1] == 3072
        n = ev["needle"]
        assert n["lengths"] == [64, 128, 256, 512, 1024] and len(n["depths"]) == 11
        assert all(0 <= v <= 1 for row in n["grid_found"] for v in row)
        assert 0 <= n["token_accuracy_all"] <= 1 and n["token_accuracy_all"] >= n["found_all"]
        assert (results / f"{name}_needle.png").stat().st_size > 5_000
    fox = json.loads((results / "fox_pro.json").read_text())["evaluation"]
    assert set(fox["pruning"]["by_length"]) == {"256", "1024"} and abs(fox["pruning"]["loss_change_rel"]) < 0.01
    assert len(fox["inspect"]["decay_times"]) == 2 and fox["inspect"]["tokens"] == 256

    # the report runs from OUT/results alone
    r = reproduce("report", "--scale", "paper-125m", "--docs", str(docs / "again"), out=out)
    assert r.returncode == 0, r.stderr[-3000:]
    for d in (docs, docs / "again"):
        page = (d / "results-paper-125m.md").read_text()
        assert "| FoX (Pro) |" in page and "| Transformer (LLaMA) |" in page and "Needle analog" in page
        assert "partial recall" in page
        figs = d / "results" / "paper-125m"
        for fig in ("per_token_loss", "training_curves", "needle_fox_pro", "needle_transformer_llama", "decay_times",
                    "forget_and_attention"):
            assert (figs / f"{fig}.png").stat().st_size > 5_000
        assert set(json.loads((figs / "results.json").read_text())) == {"fox_pro", "transformer_llama"}

    # another budget's page beside the default one: its own page, folder and links
    r = reproduce("report", "--scale", "paper-125m", "--docs", str(docs), "--report-name", "longer", out=out)
    assert r.returncode == 0, r.stderr[-3000:]
    page = (docs / "results-longer.md").read_text()
    assert "--report-name longer" in page and "](results/longer/per_token_loss.png)" in page
    assert "results/paper-125m" not in page
    assert (docs / "results" / "longer" / "per_token_loss.png").stat().st_size > 5_000
    assert "--report-name longer" not in (docs / "results-paper-125m.md").read_text()


def test_paper_arguments(tmp_path):
    r = reproduce("train", "--scale", "paper-125m", "--models", "fox_pro,mamba9", out=tmp_path)
    assert r.returncode != 0 and "--models: unknown ['mamba9']" in r.stderr and "delta_net" in r.stderr
    r = reproduce("report", "--scale", "paper-125m", out=tmp_path)
    assert r.returncode != 0 and "no per-model results" in r.stderr
    r = reproduce("report", "--scale", "paper-125m", "--report-name", "../x", out=tmp_path)
    assert r.returncode != 0 and "--report-name must be letters" in r.stderr.strip().splitlines()[-1]


def test_context_gain_separates_a_plateau_from_a_falling_curve():
    """The recurrent-baseline target compares how much L(i) still falls between L/16 and L: a curve that
    keeps falling with log position gains, one that is flat past L/16 gains nothing, on noisy random curves."""
    from repro_report import context_gain

    rng = np.random.default_rng(3)
    L = 4096
    pos = np.arange(1, 2 * L + 1)
    noise = rng.normal(0, 0.01, pos.size)
    falling = 5.0 - 0.1 * np.log(pos) + noise
    plateau = np.where(pos < L // 16, 5.0 - 0.1 * np.log(pos), 5.0 - 0.1 * np.log(L // 16)) + noise
    a, b = context_gain(falling, L), context_gain(plateau, L)
    expected = 0.1 * (np.log(pos[L // 2 : L]).mean() - np.log(pos[L // 16 : L // 8]).mean())  # about 0.1 ln 6
    assert abs(a - expected) < 0.005 and a > 0.15
    assert abs(b) < 0.005 and b < a


def test_limits_name_a_rise_that_every_model_shares():
    from repro_report import limits_of_the_run

    def run(end_over_L):
        records = [{"step": 2, "tokens": 1024, "loss": 5.0, "tokens_per_s": 10.0}]
        return {"training": {"records": records, "wall_clock_s": 1.0}, "config": {},
                "evaluation": {"end_over_L": end_over_L, "needle": {"found_all": 0.25}}}

    labels = {"fox_pro": "FoX (Pro)", "transformer_llama": "Transformer (LLaMA)"}
    shared = "\n".join(limits_of_the_run({"fox_pro": run(1.009), "transformer_llama": run(1.026)}, labels, 64))
    assert "FoX (Pro) 1.009; Transformer (LLaMA) 1.026" in shared and "not all of its ratio" in shared
    alone = "\n".join(limits_of_the_run({"fox_pro": run(0.998), "transformer_llama": run(1.026)}, labels, 64))
    flat = "\n".join(limits_of_the_run({"fox_pro": run(1.009), "transformer_llama": run(1.004)}, labels, 64))
    assert "rises too" not in alone and "rises too" not in flat and "does not rise past L" in flat
