"""benchmarks/ptx_trees_ab.py: the PTX of every kernel of two source trees, compiled for sm90 without a GPU.

Its text handling is checked on PTX written here; a run compares this tree with a copy whose norms kernel
stores twice its maxima, which must change exactly the kernels that inline that function.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from fox_kernel.ops import gluon
from fox_kernel.ops.triton import launch

SRC = Path(__file__).resolve().parents[1] / "src"

PTX = """//
.version 8.7
.target sm_90a
.file 1 "/work/src/fox_kernel/ops/triton/norms.py"
.visible .entry k(
)
{
\t.reg .b32 \t%r<12>;
$L__tmp3:
\t.loc 1 42 5
\tmov.b32 \t%r7, %r3;
$L__BB0_2:
\tadd.s32 \t%r9, %r7, 1;
\tbra.uni \t$L__BB0_2;
}
\t.section\t.debug_abbrev
\t{
.b8 1
\t}
"""


def test_code_lines_keep_the_code_and_drop_what_names_source_lines(benchmark_script):
    ab = benchmark_script("ptx_trees_ab")
    assert ab.code_lines(PTX) == [
        "//", ".version 8.7", ".target sm_90a", ".visible .entry k(", ")", "{", "\t.reg .b32 \t%r<12>;",
        "\tmov.b32 \t%r7, %r3;", "$L__BB0_2:", "\tadd.s32 \t%r9, %r7, 1;", "\tbra.uni \t$L__BB0_2;", "}",
    ]


def test_renamed_changes_count_instructions_not_names(benchmark_script):
    ab = benchmark_script("ptx_trees_ab")
    renamed = PTX.replace("%r7", "%r70").replace("%r<12>", "%r<80>").replace("$L__BB0_2", "$L__BB3_9")
    assert renamed != PTX and ab.renamed_changes(PTX, renamed) == 0
    one_more = PTX.replace("\tbra.uni", "\tadd.s32 \t%r10, %r9, 2;\n\tbra.uni")
    assert ab.renamed_changes(PTX, one_more) == 1
    other_op = PTX.replace("add.s32 \t%r9, %r7, 1", "sub.s32 \t%r9, %r7, 1")
    assert ab.renamed_changes(PTX, other_op) == 1


def test_pairs_match_keys_then_a_kernels_lone_compilations_in_order(benchmark_script):
    ab = benchmark_script("ptx_trees_ab")
    before = {"a(X=1)": 0, "t(S=1)": 0, "t(S=2)": 0, "z(Q=1)": 0}
    after = {"a(X=1)": 0, "t(P=9, S=1)": 0, "t(P=9, S=2)": 0, "t(P=9, S=3)": 0, "n(R=1)": 0}
    assert ab.pairs(before, after) == [
        ("a(X=1)", "a(X=1)"),  # same key
        ("t(S=1)", "t(P=9, S=1)"), ("t(S=2)", "t(P=9, S=2)"), (None, "t(P=9, S=3)"),  # a constexpr added
        ("z(Q=1)", None), (None, "n(R=1)"),  # a kernel dropped, another added
    ]


def test_a_missing_before_tree_is_one_clear_error(monkeypatch, tmp_path, benchmark_script):
    ab = benchmark_script("ptx_trees_ab")
    monkeypatch.setattr(sys, "argv", ["ptx_trees_ab.py", "--before", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"^ptx_trees_ab\.py: --before must be a folder holding fox_kernel/"):
        ab.main()


@pytest.mark.skipif(launch.INTERPRET or not gluon.available(), reason="needs Triton's Gluon, not the interpreter")
def test_a_changed_function_changes_exactly_the_kernels_that_inline_it(monkeypatch, tmp_path, benchmark_script):
    before = tmp_path / "before"
    shutil.copytree(SRC, before, ignore=shutil.ignore_patterns("__pycache__"))
    norms = before / "fox_kernel" / "ops" / "triton" / "norms.py"
    text = norms.read_text()
    assert text.count("tl.store(dst, tl.max(best, 0))") == 1  # max_sq_norm_part's store
    norms.write_text(text.replace("tl.store(dst, tl.max(best, 0))", "tl.store(dst, tl.max(best, 0) * 2.0)"))

    ab = benchmark_script("ptx_trees_ab")
    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", ["ptx_trees_ab.py", "--before", str(before), "--out", str(out), "--dump",
                                      str(tmp_path / "ptx")])
    with pytest.raises(SystemExit) as done:
        ab.main()
    assert done.value.code == 0
    result = json.loads(out.read_text())
    assert Path(result["trees"]["before"]).resolve() == (before / "fox_kernel").resolve()  # its own folder
    differs = {row["kernel"] for row in result["kernels"] if row["state"] != "same"}
    # max_sq_norm_part runs in the prefix-sum launch with the norms, at both head dims, and nowhere else
    assert len(differs) == 2 and all(k.startswith("_forward_sums_kernel(") and "HAS_NORMS=True" in k for k in differs)
    assert result["counts"]["same"] > 40  # the Gluon and Triton forward and backward, the prologues, the norms
    for row in result["kernels"]:
        if row["state"] == "differs":
            assert 1 <= row["changed_lines_renamed"] < row["after"][1] // 10  # a multiply more, not other code
