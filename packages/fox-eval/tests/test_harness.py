"""fox-eval harness: lm-eval tasks of each output type from local files, checked against direct computations."""

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import fox_models
from fox_eval import harness
from fox_eval.cli import main

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


def _logprob(model, tok, context: str, target: str) -> float:
    """log p(target | BOS + context) with lm-eval's definition of the target's tokens: those of
    context + target past the context's own token count."""
    ctx = tok(context)["input_ids"]  # BOS + context
    tgt = tok(context + target)["input_ids"][len(ctx) :]
    with torch.no_grad():
        logits = model(torch.tensor([ctx + tgt])).logits[0].double()
    lp = F.log_softmax(logits, -1)
    return sum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(tgt))


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
