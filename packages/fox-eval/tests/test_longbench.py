"""LongBench metrics against hand-computed values on fixed strings; truncation; the command end to end."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import fox_models
from fox_eval import longbench as lb
from fox_eval.cli import main


def test_qa_f1_by_hand():
    # normalised: "eiffel tower paris" vs "eiffel tower": common 2, p = 2/3, r = 1 -> f1 = 0.8
    assert lb.qa_f1("The Eiffel Tower, Paris!", "eiffel tower") == pytest.approx(0.8)
    assert lb.qa_f1("nothing", "eiffel tower") == 0.0
    assert lb.normalize_answer("An  Apple, the Pie.") == "apple pie"


def test_rouge_l_by_hand():
    # LCS of "the cat sat on the mat" / "the cat is on the mat" = "the cat on the mat" (5): p = r = 5/6
    assert lb.rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # LCS 2 ("a c"): p = 2/3, r = 2/2 -> 0.8
    assert lb.rouge_l("a b c", "a c") == pytest.approx(0.8)


def test_classification_by_hand():
    classes = ["Location", "Person", "Date", "Other location"]
    assert lb.classification("Type: Location", "Location", classes) == 1.0
    assert lb.classification("Person or Date", "Date", classes) == 0.5
    # "Location" inside the truth "Other location"? no: case differs; "Other location" named once
    assert lb.classification("Other location", "Other location", classes) == 1.0
    assert lb.classification("Date", "Person", classes) == 0.0


def test_code_sim_and_first_line_rules():
    assert lb.code_sim("# comment\nx = foo(1)\ny", "x = foo(1)") == 1.0
    assert lb.code_sim("x = foo(2)", "x = foo(1)") == pytest.approx(0.9)  # difflib: 2*9/20
    assert lb.code_sim("x = 1  # one\ny = 2", "y = 2") == 1.0  # a line with # anywhere is skipped
    # every task is scored on the answer's first line, as the paper's scorer does
    assert lb.score("triviaqa", "Paris\nand more text", ["Paris"]) == 1.0
    assert lb.score("gov_report", "\nthe cat sat\non the mat", ["the cat sat on the mat"]) == pytest.approx(2 * 0.5 / 1.5)
    assert lb.score("lcc", "# comment\nx = foo(1)", ["x = foo(1)"]) == 0.0
    assert lb.score("narrativeqa", "a dog", ["the cat", "a dog"]) == 1.0


def test_longbench_prompts_by_default():
    assert list(lb.PROMPTS) == lb.TASKS and all("{context}" in p for p in lb.PROMPTS.values())
    assert lb.PROMPTS["lcc"].format(context="x = 1\n", input="") == "Please complete the code given below. \nx = 1\nNext line of code:\n"
    assert lb.PROMPTS["trec"].format(context="Q: a\nType: b", input="Q: c") == (
        "Please determine the type of the question below. Here are some examples of questions.\n\nQ: a\nType: b\nQ: c")


def test_truncate_middle():
    ids = list(range(100))
    assert lb.truncate_middle(ids, 100) == ids
    assert lb.truncate_middle(ids, 10) == [0, 1, 2, 3, 4, 95, 96, 97, 98, 99]
    assert lb.truncate_middle(ids, 9) == [0, 1, 2, 3, 95, 96, 97, 98, 99]


def _model(path, seed, layers=1):
    torch.manual_seed(seed)
    cfg = fox_models.ForgettingTransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=layers, num_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    fox_models.JSONGPT2Tokenizer().save_pretrained(path)


def _data(tmp_path):
    data = tmp_path / "lb"
    data.mkdir()
    (data / "hotpotqa.jsonl").write_text(json.dumps({"input": "Who?", "context": "Moses led the people. " * 50,
                                                     "answers": ["Moses"], "all_classes": None}))
    (data / "trec.jsonl").write_text(json.dumps({"input": "What city?", "context": "Question: Where? Type: Location",
                                                 "answers": ["Location"], "all_classes": ["Location", "Person"]}))
    return data


def test_command_end_to_end(tmp_path, capsys):
    _model(tmp_path / "m", 0)
    data = _data(tmp_path)
    main(["longbench", "--model", str(tmp_path / "m"), "--data", str(data), "--tasks", "hotpotqa", "trec",
          "--budget", "64", "--out", str(tmp_path / "o")])
    res = json.loads((tmp_path / "o" / "longbench.json").read_text())
    assert set(res["table"]["m"]) == {"hotpotqa", "trec", "average"} and 0 <= res["table"]["m"]["average"] <= 100
    assert res["settings"]["budget"] == 64 and res["settings"]["precision"] == "float32"
    assert "| model | hotpotqa | trec | average |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="has no qasper.jsonl"):
        main(["longbench", "--model", str(tmp_path / "m"), "--data", str(data), "--tasks", "qasper"])
    with pytest.raises(SystemExit, match="unknown LongBench tasks"):
        main(["longbench", "--model", str(tmp_path / "m"), "--data", str(data), "--tasks", "nope"])
    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(SystemExit, match="--prompts .* is not valid JSON"):
        main(["longbench", "--model", str(tmp_path / "m"), "--data", str(data), "--tasks", "trec",
              "--prompts", str(tmp_path / "p.json")])
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit, match=f"--limit must be >= 1, got {bad}"):
            main(["longbench", "--model", str(tmp_path / "m"), "--data", str(data), "--limit", bad])
    # before a model loads, one line each (a KeyError, an AttributeError or a message naming no file before)
    for text, message in (({"hotpotqa": "{context} {input} {foo}"}, r"a template may hold \{context\} and "
                           r"\{input\} only, got \['foo'\]$"),
                          (["{context}"], r"--prompts must hold a JSON object of task -> prompt template, got list$")):
        (tmp_path / "p.json").write_text(json.dumps(text))
        with pytest.raises(SystemExit, match=message):
            main(["longbench", "--model", str(tmp_path / "m"), "--data", str(data), "--tasks", "hotpotqa",
                  "--prompts", str(tmp_path / "p.json")])
    broken = tmp_path / "broken"
    broken.mkdir()
    for lines, message in ((['{"input": "x", "context": "y", "answers": ["z"]}', '{not json'], r"line 2 is not JSON"),
                           (['{"input": "x", "context": "y"}'], r"line 1: a LongBench sample needs \"answers\"")):
        (broken / "hotpotqa.jsonl").write_text("\n".join(lines))
        with pytest.raises(SystemExit, match=rf"^fox-eval: --data '{broken}/hotpotqa.jsonl' {message}"):
            main(["longbench", "--model", str(tmp_path / "m"), "--data", str(broken), "--tasks", "hotpotqa"])


def test_several_models_make_one_table_with_each_models_own_scores(tmp_path, monkeypatch):
    """Two run folders exported as RUN/hf: one row each, labelled by run, equal to each model's own run."""
    for run, seed in (("run-a", 0), ("run-b", 1)):
        _model(tmp_path / run / "hf", seed, layers=2)
    data = _data(tmp_path)
    # the trec class is named in the prompt, so the score depends on what each model generates
    entered = []
    real = lb.autocast
    monkeypatch.setattr(lb, "autocast", lambda device: entered.append(str(device)) or real(device))
    main(["longbench", "--model", str(tmp_path / "run-a" / "hf"), str(tmp_path / "run-b" / "hf"), "--data", str(data),
          "--tasks", "trec", "hotpotqa", "--budget", "40", "--out", str(tmp_path / "both")])
    assert entered and set(entered) == {"cpu"}  # every generation runs under the eval's autocast
    both = json.loads((tmp_path / "both" / "longbench.json").read_text())["table"]
    assert list(both) == ["run-a", "run-b"]
    md = (tmp_path / "both" / "longbench.md").read_text().splitlines()
    assert md[0] == "| model | trec | hotpotqa | average |" and md[2].startswith("| run-a |") and md[3].startswith("| run-b |")
    assert (tmp_path / "both" / "longbench.tex").read_text().startswith("\\begin{tabular}{lrrr}")
    for run in ("run-a", "run-b"):
        main(["longbench", "--model", str(tmp_path / run / "hf"), "--data", str(data), "--tasks", "trec", "hotpotqa",
              "--budget", "40", "--out", str(tmp_path / run / "alone"), "--labels", run])
        alone = json.loads((tmp_path / run / "alone" / "longbench.json").read_text())["table"][run]
        assert alone == both[run]
        preds = [json.loads(x)["pred"] for x in (tmp_path / "both" / run / "hotpotqa.jsonl").read_text().splitlines()]
        assert preds == [json.loads(x)["pred"] for x in
                         (tmp_path / run / "alone" / run / "hotpotqa.jsonl").read_text().splitlines()]
    a = (tmp_path / "both" / "run-a" / "hotpotqa.jsonl").read_text()
    assert a != (tmp_path / "both" / "run-b" / "hotpotqa.jsonl").read_text()  # two models, two answers
