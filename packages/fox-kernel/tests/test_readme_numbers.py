"""The kernel README's latest speed tables hold the numbers of the one benchmark run they cite.

The README says every cell of its "latest run" tables (attention against every contender, pruning against the
official kernel, decoding, each timed eager and from a CUDA graph) comes from one ``bench_attention.py`` run,
whose JSON is kept in ``benchmarks/``. This reads those tables back and compares each cell with its JSON, so that a table edited by hand, or a
JSON replaced by another run's, fails here. The two tables of "Recorded launches" are checked the same way
against the ``plans_ab.py`` and ``host_overhead.py --plans-ab`` runs they cite.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
START = "The latest run: every number of this table"


def _run_json():
    """The JSON of the section's run."""
    name = re.search(r"`benchmarks/(bench-attention-final-[^`]+\.json)`", README[README.index(START):]).group(1)
    return json.loads((ROOT / "benchmarks" / name).read_text())


def _table_texts():
    """The markdown tables of the latest-run section, as written."""
    section = README[README.index(START):README.index("Older runs")]
    tables, lines = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            tables.append("\n".join(lines))
            lines = []
    return tables


def _tables():
    """The same tables, each a list of rows of cell strings (header and |---| rule dropped)."""
    return [[[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()[2:]]
            for text in _table_texts()]


def _number(cell: str) -> float:
    """A cell's first number (bold marks and units dropped); NaN for a dash or words."""
    found = re.search(r"-?\d+(?:\.\d+)?", cell.replace("**", ""))
    return float(found.group()) if found and not cell.startswith("(") else math.nan


def _same(cell: str, value: float, digits: int) -> bool:
    shown = _number(cell)
    if value is None or math.isnan(value):
        return math.isnan(shown)
    return shown == round(value, digits)


def test_the_section_has_its_three_tables():
    assert [len(t) for t in _tables()] == [12, 12, 3]


def test_attention_cells_are_the_runs():
    data = _run_json()["attention"]
    names = ["sdpa_cudnn", "sdpa_flash", "flex_fox", "fla", "official", "fox one-pass", "fox (ours)"]
    table = _tables()[0]
    assert len(table) == len(data)
    for row, run in zip(table, data):
        T, heads, D, mode = row[:4]
        assert (int(T.split("k")[0]) * 1024, heads, int(D), mode) == \
            (run["T"], f"{run['H']}/{run['Hkv']}", run["D"], run["mode"])
        for cell, name in zip(row[4:11], names):  # a contender left out of the run (--no-flex) shows a dash
            assert _same(cell, run.get(name, math.nan), 1), (row, name, run.get(name))
        assert _same(row[11], run["fox (ours)"] / run["sdpa_cudnn"], 2)
        assert _same(row[12], run["fox (ours) graph"] / run["sdpa_cudnn graph"], 2)


def test_pruning_cells_are_the_runs():
    data = _run_json()["acp"]
    names = ["exact", "auto", "auto zero_gates=False", "per-head", "official exact", "official per-head"]
    table = _tables()[1]
    assert len(table) == len(data)
    for row, run in zip(table, data):
        assert (int(row[0]), row[2]) == (run["D"], run["mode"])
        assert _same(row[1].split("(")[1], run["mean_log_f"], 3 if abs(run["mean_log_f"]) < 0.1 else 2)
        for cell, name in zip(row[3:9], names):
            assert _same(cell, run[f"tflops_effective {name}"], 1), (row, name)
        assert _same(row[9], run["ms official per-head"] / run["ms auto"], 2)
        assert _same(row[10], run["ms official per-head graph"] / run["ms auto graph"], 2)


@pytest.mark.parametrize("i", [0, 1, 2])
def test_decoding_cells_are_the_runs(i):
    run = _run_json()["decode"][i]
    row = _tables()[2][i]
    assert row[0] == f"{run['B']} × {run['T'] // 1024}k"
    for cell, key in zip(row[1:6], ("ours", "paged16", "paged256", "pruned", "sdpa_no_gate")):
        assert _same(cell, run[f"{key}_TBps"], 2), (row, key)
    assert _same(row[1].split("(")[1], run["ours_ms"] * 1e3, 0)
    assert _same(row[6], run["ours_TBps"] / run["sdpa_no_gate_TBps"], 2)
    assert len(row) == 8  # the GPU-time column
    assert _same(row[7], run["ours_graph_TBps"] / run["sdpa_no_gate_graph_TBps"], 2)


def test_the_tables_are_what_bench_attention_prints_from_the_run(benchmark_script):
    """``bench_attention.py --markdown-from JSON`` prints exactly the README's tables from their run, bold marks
    and dashes included."""
    bench = benchmark_script("bench_attention")
    assert bench.markdown_tables(_run_json()) == _table_texts()


def _table_after(marker: str) -> list[list[str]]:
    """The rows (cells as written) of the first markdown table after ``marker`` in the README."""
    lines = README[README.index(marker):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[start + 2:end]]


def test_the_recorded_launches_eager_table_is_plans_abs_runs():
    """Each cell of "Recorded launches"' eager table against the ``plans_ab.py`` run its row names."""
    runs = {plans: json.loads((ROOT / "benchmarks" / f"plans-ab-{commit}-h200-2026-11-29.json").read_text())
            for plans, commit in (("forward plans", "1506774"), ("both plans", "7deda7a"))}
    rows = _table_after("Eager time at T=16k (`plans_ab.py")
    assert len(rows) == 8
    for d, gates, what, replayed, launched, official, ratio in rows:
        mode, plans = what.split(", ")[0], next(p for p in runs if p in what)
        (run,) = [r for r in runs[plans]["rows"] if r["table"] == "pruning" and r["D"] == int(d)
                  and r["gates"].startswith(gates) and r["mode"] == mode]
        assert _same(replayed, run["ms auto, replayed"], 3) and _same(launched, run["ms auto, launched"], 3)
        assert _same(official, run["ms official per-head"], 3)
        assert _same(ratio, run["ms official per-head"] / run["ms auto, replayed"], 2)


def test_the_recorded_launches_host_table_is_host_overheads_runs():
    runs = {d: {r["case"]: r for r in json.loads((ROOT / "benchmarks" / f"host-overhead-plans-ab-d{d}-1506774-h200-"
                                                  "2026-11-29.json").read_text())["rows"]} for d in (128, 64)}
    cases = {"forward op": "forward op", "forward op, \"auto\" pruning": "forward op, auto pruning",
             "forward op, `zero_gates=False`": "forward op, zero_gates=False",
             "`forgetting_attention` forward, \"auto\", no grad": "forgetting_attention forward, auto pruning (no grad)",
             "`forgetting_attention` fwd+bwd, \"auto\", `zero_gates=False` (autograd)":
                 "forgetting_attention fwd+bwd, auto pruning, zero_gates=False (autograd)",
             "one Triton launch, no plan (for scale)": "one Triton launch (prefix sums)",
             "cuDNN SDPA fwd+bwd, no plan (for scale)": "SDPA cuDNN fwd+bwd (autograd)"}
    rows = _table_after("| host µs per call, T=256 | D=128 replayed")
    assert [row[0] for row in rows] == list(cases)
    for name, *cells in rows:
        values = [runs[d][cases[name]][key] for d in (128, 64) for key in ("host_us", "host_us_launched")]
        for cell, value in zip(cells, values):
            assert _number(cell.replace(",", "")) == round(value), (name, cell, value)


def test_the_gluon_window_table_is_bench_windows_run():
    """Each cell of "Windows on the Gluon kernels"' table against the ``bench_window.py`` run it cites, and the
    kernel times of the sentence after it against the ``profile_window.py`` run."""
    marker = "**Windows on the Gluon kernels**"
    paragraph = README[README.index(marker):README.index("### Adaptive computation pruning")]
    name = re.search(r"`benchmarks/(window-gluon-all-[^`]+)\.\{json,log\}`", paragraph).group(1)
    runs = json.loads((ROOT / "benchmarks" / f"{name}.json").read_text())["window"]
    rows = _table_after(marker)
    assert len(rows) == len(runs) == 8
    keys = ("ours window fwd ms", "ours window, Triton fwd ms", "ours window fwd+bwd ms",
            "ours window, Triton fwd+bwd ms", "triton/ours fwd+bwd", "ours full fwd+bwd ms", "fla window fwd+bwd ms")
    for row, run in zip(rows, runs):
        assert row[0] == f"{run['T'] // 1024}k, {run['D']}, {run['W']}"
        for cell, key in zip(row[1:], keys):
            assert _same(cell, run[key], 2), (row, key)
    name = re.search(r"`benchmarks/(window-kernels-profile-[^`]+)\.\{json,log\}`", paragraph).group(1)
    profile = json.loads((ROOT / "benchmarks" / f"{name}.json").read_text())["rows"]
    text = " ".join(paragraph.split())
    for D in (64, 128):
        for backend in ("gluon", "triton"):
            ms = [r["total_ms"] for r in profile if (r["D"], r["backend"], r["backward"]) == (D, backend, "two-pass")]
            assert " / ".join(f"{x:.2f}" for x in ms) in text, (D, backend, ms)
