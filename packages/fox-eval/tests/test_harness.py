"""fox-eval harness: lm-eval tasks of each output type from local files, checked against direct computations."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import fox_models
from fox_eval import harness
from fox_eval.cli import build_parser, main

MC = [{"q": "The sky is", "choices": ["blue", "green", "loud"], "label": 0},
      {"q": "Fire is", "choices": ["cold", "hot", "wet"], "label": 1},
      {"q": "Snow is", "choices": ["white", "black", "red"], "label": 0},
      {"q": "Grass is", "choices": ["purple", "green"], "label": 1}]
# lm-eval strips the rendered target and joins it to the context as is: targets carry no space here.
LL = [{"context": "In the beginning God created the", "target": "heaven"},
      {"context": "And God said, Let there be", "target": "light"}]
RL = [{"text": "In the beginning God created the heaven and the earth. And the earth was without form."},
      {"text": "And God saw the light, that it was good."}]


def _write_tasks(d):
    for name, rows in (("mc", MC), ("ll", LL), ("rl", RL)):
        (d / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    # force_redownload: never reuse a datasets cache entry of an earlier run with the same file name
    common = lambda name, f: (f"task: local_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / f}\n"
                              "  download_mode: force_redownload\ntest_split: test\n")
    (d / "mc.yaml").write_text(common("mc", "mc.jsonl") + 'output_type: multiple_choice\ndoc_to_text: "{{q}}"\n'
                               'doc_to_choice: "{{choices}}"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n')
    (d / "ll.yaml").write_text(common("ll", "ll.jsonl") + 'output_type: loglikelihood\ndoc_to_text: "{{context}}"\n'
                               'doc_to_target: "{{target}}"\nmetric_list:\n  - metric: perplexity\n'
                               '    aggregation: perplexity\n    higher_is_better: false\n')
    (d / "rl.yaml").write_text(common("rl", "rl.jsonl") + 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
                               'doc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n')


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("harness")
    _write_tasks(d)
    torch.manual_seed(0)
    cfg = fox_models.ForgettingTransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=2, num_heads=2,
                                                 qk_norm=True, use_k_shift=True)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(d / "m")
    fox_models.JSONGPT2Tokenizer().save_pretrained(d / "m")
    return d, model, fox_models.JSONGPT2Tokenizer()


def _logprob(model, tok, context: str, target: str, max_length: int | None = None) -> float:
    """log p(target | BOS + context) with lm-eval's definition of the target's tokens: those of
    context + target past the context's own token count; with ``max_length``, the model sees only the last
    max_length tokens before each target token."""
    ctx = tok(context)["input_ids"]  # BOS + context
    tgt = tok(context + target)["input_ids"][len(ctx) :]
    inp = (ctx + tgt)[:-1] if max_length is None else (ctx + tgt)[-(max_length + 1) :][:-1]
    with torch.no_grad():
        logits = model(torch.tensor([inp])).logits[0].double()
    lp = F.log_softmax(logits, -1)
    return sum(lp[len(inp) - len(tgt) + i, t].item() for i, t in enumerate(tgt))


def test_three_output_types_match_direct_computation(setup):
    d, model, tok = setup
    res = harness.evaluate(model, tok, ["local_mc", "local_ll", "local_rl"], str(d), None, 1, "cpu")
    # multiple choice: argmax of log p(" " + choice | question)
    acc = sum(max(range(len(r["choices"])), key=lambda i: _logprob(model, tok, r["q"], " " + r["choices"][i])) == r["label"]
              for r in MC) / len(MC)
    assert res["local_mc"]["acc,none"] == pytest.approx(acc)
    # loglikelihood: perplexity = exp(-mean log p(target | context)); lm-eval joins them with no delimiter
    ppl = math.exp(-sum(_logprob(model, tok, r["context"], r["target"]) for r in LL) / len(LL))
    assert res["local_ll"]["perplexity,none"] == pytest.approx(ppl, rel=1e-4)
    # rolling loglikelihood: word perplexity = exp(-sum log p(text | BOS) / words)
    total = sum(_logprob(model, tok, "", r["text"]) for r in RL)
    words = sum(len(re.split(r"\s+", r["text"])) for r in RL)
    assert res["local_rl"]["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-4)


def test_max_length_cuts_contexts(setup):
    d, model, tok = setup
    res = harness.evaluate(model, tok, ["local_ll"], str(d), None, 1, "cpu", max_length=5)
    ppl = math.exp(-sum(_logprob(model, tok, r["context"], r["target"], 5) for r in LL) / len(LL))
    full = math.exp(-sum(_logprob(model, tok, r["context"], r["target"]) for r in LL) / len(LL))
    assert res["local_ll"]["perplexity,none"] == pytest.approx(ppl, rel=1e-4)
    assert abs(ppl - full) > 1e-3 * full  # the cut changed what the model saw
    assert build_parser().parse_args(["harness", "--model", "m"]).max_length == harness.MAX_LENGTH == 16384


def test_paper_columns_and_average():
    results = {t: {m: 0.5 for _, m in harness.PAPER_COLUMNS} for t in harness.PAPER_TASKS}
    results["wikitext"]["word_perplexity,none"] = 23.04
    results["lambada_openai"]["perplexity,none"] = 12.5
    results["boolq"]["acc,none"] = 0.6
    picked = harness.pick_metrics(results, harness.PAPER_TASKS)
    assert list(picked) == ["wikitext (word_perplexity)", "lambada_openai (perplexity)", "lambada_openai (acc)",
                            "piqa (acc)", "hellaswag (acc_norm)", "winogrande (acc)", "arc_easy (acc)",
                            "arc_challenge (acc_norm)", "copa (acc)", "openbookqa (acc_norm)", "sciq (acc)",
                            "boolq (acc)", harness.AVERAGE]
    assert picked["wikitext (word_perplexity)"] == 23.04 and picked["lambada_openai (perplexity)"] == 12.5
    assert picked["boolq (acc)"] == pytest.approx(60.0) and picked[harness.AVERAGE] == pytest.approx(51.0)
    del results["boolq"]
    assert harness.AVERAGE not in harness.pick_metrics(results, harness.PAPER_TASKS)


def test_tables_bold_the_best():
    picked = {name: harness.pick_metrics({"piqa": {"acc,none": acc}, "wikitext": {"word_perplexity,none": ppl}},
                                         ["piqa", "wikitext"]) for name, acc, ppl in (("a", 0.6, 20.0), ("b", 0.7, 25.0))}
    md, tex = harness.tables(picked, lower_is_better={"wikitext (word_perplexity)"})
    assert md.startswith("| model | piqa (acc) | wikitext (word_perplexity) |")
    assert "| a | 60.00 | **20.00** |" in md and "| b | **70.00** | 25.00 |" in md
    assert "\\textbf{70.00}" in tex and "\\textbf{20.00}" in tex and "\\underline{60.00}" in tex


def test_cli_writes_tables(setup, capsys):
    d, _, _ = setup
    main(["harness", "--model", str(d / "m"), "--tasks", "local_mc", "--include-path", str(d), "--out", str(d / "out"),
          "--device", "cpu"])
    assert (d / "out" / "results.md").read_text().startswith("| model | local_mc (acc) |")
    assert (d / "out" / "results.tex").exists() and json.loads((d / "out" / "results.json").read_text())["table"]
    with pytest.raises(SystemExit, match="--include-path '/no/tasks' does not exist"):
        main(["harness", "--model", str(d / "m"), "--tasks", "x", "--include-path", "/no/tasks"])
    with pytest.raises(SystemExit, match=r"^fox-eval: --limit must be > 0 \(examples per task, or a fraction below 1\), got 0$"):
        main(["harness", "--model", str(d / "m"), "--tasks", "x", "--limit", "0"])
    with pytest.raises(SystemExit, match="^fox-eval: --max-length must be >= 1, got 0$"):
        main(["harness", "--model", str(d / "m"), "--tasks", "x", "--max-length", "0"])


def test_a_task_yaml_file_or_a_tag_fills_the_table(setup):
    """lm-eval reports a YAML file's task, or a tag's tasks, under their own names: those are the columns."""
    d, _, _ = setup
    main(["harness", "--model", str(d / "m"), "--tasks", str(d / "mc.yaml"), "--out", str(d / "yaml"),
          "--device", "cpu"])
    assert (d / "yaml" / "results.md").read_text().startswith("| model | local_mc (acc) |")
    picked = harness.pick_metrics({"arc_easy": {"acc,none": 0.5}, "arc_challenge": {"acc_norm,none": 0.25}},
                                  ["ai2_arc"])
    assert picked == {"arc_easy (acc)": 50.0, "arc_challenge (acc_norm)": 25.0}


def test_several_models_make_one_table(setup, monkeypatch):
    """RUN/hf folders: one row per run, each with the values the model gets alone."""
    d, _, tok = setup
    for run, seed in (("run-a", 1), ("run-b", 2)):
        torch.manual_seed(seed)
        cfg = fox_models.ForgettingTransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=1, num_heads=2)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d / run / "hf")
        tok.save_pretrained(d / run / "hf")
    entered = []
    real = harness.autocast
    monkeypatch.setattr(harness, "autocast", lambda device: entered.append(str(device)) or real(device))
    main(["harness", "--model", str(d / "run-a" / "hf"), str(d / "run-b" / "hf"), "--tasks", "local_mc", "local_ll",
          "--include-path", str(d), "--out", str(d / "two"), "--device", "cpu", "--max-length", "64"])
    assert entered == ["cpu", "cpu"]
    md = (d / "two" / "results.md").read_text().splitlines()
    assert md[0] == "| model | local_mc (acc) | local_ll (perplexity) |"
    assert md[2].startswith("| run-a |") and md[3].startswith("| run-b |") and len(md) == 4
    saved = json.loads((d / "two" / "results.json").read_text())
    assert saved["settings"]["max_length"] == 64 and saved["settings"]["num_fewshot"] == 0
    for run in ("run-a", "run-b"):
        model = AutoModelForCausalLM.from_pretrained(d / run / "hf").eval()
        alone = harness.pick_metrics(harness.evaluate(model, tok, ["local_mc", "local_ll"], str(d), None, 1, "cpu", 64),
                                     ["local_mc", "local_ll"])
        assert saved["table"][run] == pytest.approx(alone)
    assert saved["table"]["run-a"]["local_ll (perplexity)"] != saved["table"]["run-b"]["local_ll (perplexity)"]


def test_offline_by_default(tmp_path, setup):
    """A task whose data is not cached fails at once with one line, without trying the network."""
    d, _, _ = setup
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_DATASETS_CACHE=str(tmp_path / "ds-cache"))
    # a proxy that cannot be reached: were the network tried, the failure would name it, not offline mode
    env.update(HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    r = subprocess.run([sys.executable, "-m", "fox_eval.cli", "harness", "--model", str(d / "m"), "--tasks", "piqa",
                        "--limit", "1", "--device", "cpu", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("fox-eval: ") and "Offline" in last and last.endswith("--online lets it download)")
