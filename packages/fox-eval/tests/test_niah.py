"""NIAH prompts put the needle at the requested depth and total length; scoring; the command end to end."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import fox_models
from fox_eval import niah
from fox_eval.cli import main


@pytest.fixture(scope="module")
def tok():
    return fox_models.JSONGPT2Tokenizer()


@pytest.fixture(scope="module")
def hay(tok):
    return tok(niah.haystack_text()[:200_000], add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("length", [1000, 4100, 7000])
@pytest.mark.parametrize("depth", [0.0, 30.0, 50.0, 100.0])
@pytest.mark.parametrize("mode", ["standard", "easy"])
def test_needle_at_requested_depth_and_length(tok, hay, length, depth, mode):
    ids, at = niah.build_prompt(tok, hay, length, depth, mode)
    assert len(ids) == length and ids[0] == tok.bos_token_id
    needle = tok(" " + (niah.EASY_NEEDLE if mode == "easy" else niah.NEEDLE) + " ", add_special_tokens=False)["input_ids"]
    assert ids[at : at + len(needle)] == needle
    hay_len = length - len(needle) - len(tok("\n\n" + niah.QUESTION, add_special_tokens=False)["input_ids"]) - 1
    # The needle starts the sentence in which the requested depth falls: no sentence end between it and the
    # requested position, and a sentence end (or the start) just before it.
    target, pos = round(hay_len * depth / 100), at - 1
    period = tok(".", add_special_tokens=False)["input_ids"][0]
    assert pos <= target and period not in hay[pos:target]
    assert pos == 0 or hay[pos - 1] == period or pos == hay_len
    assert tok.decode(ids[-len(tok("\n\n" + niah.QUESTION, add_special_tokens=False)["input_ids"]) :]).endswith(niah.QUESTION)


def test_offline_score():
    assert niah.score_offline(" eat a sandwich and sit in Dolores Park on a sunny day. Then") == 10.0
    assert niah.score_offline(" eat a sandwich and go home") == pytest.approx(10 * 4 / 12)
    assert niah.score_offline(" visit the Golden Gate bridge") == 0.0


def test_command_writes_results_and_heatmap(tmp_path):
    torch.manual_seed(0)
    cfg = fox_models.ForgettingTransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=1, num_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    fox_models.JSONGPT2Tokenizer().save_pretrained(tmp_path / "m")
    main(["niah", "--model", str(tmp_path / "m"), "--lengths", "300", "600", "--depths", "0", "50", "--max-new-tokens",
          "4", "--out", str(tmp_path / "n"), "--mode", "easy"])
    report = json.loads((tmp_path / "n" / "niah_easy.json").read_text())
    assert len(report["results"]) == 4 and all(0 <= r["score"] <= 10 for r in report["results"])
    assert (tmp_path / "n" / "niah_easy.png").stat().st_size > 2000
