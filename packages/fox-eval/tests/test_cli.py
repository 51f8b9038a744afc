"""The ``fox-eval`` command line: help and argument errors answer without importing torch, transformers or
fox_models (they take seconds to import); results go under ``outputs/eval/`` by default."""

import functools

import pytest

from fox_eval.cli import build_parser

HEAVY = ("torch", "transformers", "fox_models", "fox_kernel", "fox_layers", "lm_eval", "matplotlib")

@pytest.fixture
def _run(run_cli):
    """``python -m fox_eval.cli ARGS`` in a fresh interpreter: (exit code and the HEAVY modules it imported, output)."""
    return functools.partial(run_cli, "fox_eval.cli", "fox-eval", HEAVY)


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_help_imports_no_torch(tmp_path, _run):
    got, out = _run(["--help"], tmp_path)
    assert got == {"exit": 0, "heavy": []} and "per-token-loss" in out


@pytest.mark.parametrize("command", ["per-token-loss", "generate", "inspect", "niah", "harness", "longbench"])
def test_command_help_imports_no_torch_and_documents_out(tmp_path, command, _run):
    got, out = _run([command, "--help"], tmp_path)
    assert got == {"exit": 0, "heavy": []}
    if command != "generate":
        assert "--out" in out and "outputs/eval/" in out


@pytest.mark.parametrize("args,message", [
    (["inspect"], "required: --model"),
    (["niah", "--model", "M", "--mode", "hard"], "invalid choice"),
    (["per-token-loss", "--model", "M", "--data", "tokens:x.npy", "--seq-len", "0"], "--seq-len must be >= 1"),
    (["niah", "--model", "/nope/model"], "--model '/nope/model' does not exist"),
    (["niah", "--model", "M", "--depths", "200"], "--depths must lie in [0, 100]"),
    (["niah", "--model", "M", "--lengths", "100"], "--lengths must exceed"),
    (["longbench", "--model", "M", "--data", ".", "--tasks", "nope"], "unknown LongBench tasks"),
    (["harness", "--model", "M", "--include-path", "/no/tasks"], "--include-path '/no/tasks' does not exist"),
    (["per-token-loss", "--model", "M", "--data", "bytes:.", "--seq-len", "8"], "--data kind must be"),
    (["inspect", "--model", "M"], "exactly one of --text FILE and --data SPEC"),
    (["inspect", "--model", "M", "--text", "/nope.txt"], "--text '/nope.txt' does not exist"),
    (["generate", "--model", "/nope/model", "hi"], "--model '/nope/model' does not exist"),
])
def test_argument_errors_import_no_torch(tmp_path, model_dir, args, message, _run):
    args = [str(model_dir) if a == "M" else a for a in args]
    got, out = _run(args, tmp_path)
    assert got["heavy"] == [] and got["exit"] not in (0, None), out
    assert message in out


def test_default_output_is_under_outputs_eval():
    ap = build_parser()
    for command, extra in (("per-token-loss", ["--data", "tokens:x", "--seq-len", "8"]), ("inspect", []),
                           ("niah", []), ("harness", []), ("longbench", ["--data", "d"])):
        args = ap.parse_args([command, "--model", "m", *extra])
        assert args.out == f"outputs/eval/{command.replace('-', '_')}"
