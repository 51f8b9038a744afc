"""scripts/code_needle.py, the paper-scale needle analog: the prompt holds the definition at the asked depth
as a line of its own and ends with the use and the answer less its last token, and ``score`` counts a needle
as found exactly when the model's argmax at the answer's positions reproduces every answer token. Checked
with models that know the true continuation, know it one position off, or miss one token of it, so a
found rate of 0 from a trained model is the model's, not the scorer's indexing."""

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import code_needle  # noqa: E402

VOCAB = 50257


@pytest.fixture(scope="module")
def tokenizer():
    from fox_models import JSONGPT2Tokenizer

    return JSONGPT2Tokenizer()


@pytest.fixture(scope="module")
def haystack(tokenizer):
    rng = random.Random(0)
    lines = [f"\tregs->r{rng.randint(0, 99)} = readl(base + 0x{rng.randint(0, 4095):03x});\n" for _ in range(400)]
    return np.asarray(code_needle._enc(tokenizer, "".join(lines)), dtype=np.int64)


class KnowsTheContinuation(torch.nn.Module):
    """Logits that put all the mass, at each position t, on token ``full[t + 1 + shift]`` of its row: a model
    that has the answer (``shift`` 0), or has it one position off. ``wrong`` positions (from the end) get
    another token instead."""

    def __init__(self, full_rows, shift=0, wrong=()):
        super().__init__()
        self.full, self.shift, self.wrong = full_rows, shift, set(wrong)

    def forward(self, input_ids, logits_to_keep=0, use_cache=False):
        B, T = input_ids.shape
        keep = logits_to_keep or T
        logits = torch.zeros(B, keep, VOCAB)
        for b in range(B):
            assert input_ids[b].tolist() == self.full[b][:T]  # the prompt is the continuation's start
            for j, t in enumerate(range(T - keep, T)):
                target = self.full[b][min(max(t + 1 + self.shift, 0), len(self.full[b]) - 1)]
                if T - t in self.wrong:
                    target = (target + 1) % VOCAB
                logits[b, j, target] = 1.0
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize("depth", [0.0, 10.0, 50.0, 90.0, 100.0])
@pytest.mark.parametrize("length", [257, 600])
def test_the_prompt_has_the_definition_at_its_depth_and_ends_with_the_use(tokenizer, haystack, length, depth):
    needle = code_needle.make_needle(random.Random(int(depth) + length))
    definition, use, answer = needle
    ids, ans, at = code_needle.build(tokenizer, haystack, length, depth, needle)
    assert len(ids) == length and ids[0] == code_needle.EOT
    need = code_needle._enc(tokenizer, definition)
    assert ids[at : at + len(need)] == need
    nl = code_needle._enc(tokenizer, "\n")  # two tokens: this tokenizer writes a newline as JSON's \n
    assert at == 1 or ids[at - len(nl) : at] == nl  # a line of its own
    hay = length - 1 - len(need) - len(code_needle._enc(tokenizer, use + answer)) + 1
    assert abs((at - 1) - hay * depth / 100) <= 40  # moved back at most to the line start before
    text = tokenizer.decode(ids[1:] + ans[-1:])
    assert text.count(definition) == 1
    assert text.endswith(use + answer)
    assert tokenizer.decode(ans) == answer


def test_score_finds_exactly_what_the_argmax_reproduces(tokenizer, haystack):
    rng = random.Random(7)
    cases = [code_needle.build(tokenizer, haystack, 300, d, code_needle.make_needle(rng)) for d in (20.0, 80.0)]
    rows, answers = [c[0] for c in cases], [c[1] for c in cases]
    full = [r + a[-1:] for r, a in zip(rows, answers)]
    found = code_needle.score(KnowsTheContinuation(full), rows, answers, "cpu")
    assert [r["found"] for r in found] == [True, True]
    assert [r["token_accuracy"] for r in found] == [1.0, 1.0]
    for shift in (-1, 1):
        off = code_needle.score(KnowsTheContinuation(full, shift=shift), rows, answers, "cpu")
        assert not any(r["found"] for r in off)
    n = len(answers[0])
    last_wrong = code_needle.score(KnowsTheContinuation(full, wrong=(1,)), rows, answers, "cpu")
    assert not any(r["found"] for r in last_wrong)
    assert last_wrong[0]["token_accuracy"] == pytest.approx((n - 1) / n)


def test_a_haystack_too_short_or_a_bad_depth_is_refused(tokenizer, haystack):
    needle = code_needle.make_needle(random.Random(1))
    with pytest.raises(ValueError, match="haystack holds"):
        code_needle.build(tokenizer, haystack[:100], 600, 50.0, needle)
    with pytest.raises(ValueError, match="depth"):
        code_needle.build(tokenizer, haystack, 600, 101.0, needle)


def test_run_counts_found_and_partial_recall_per_cell(tokenizer, haystack, monkeypatch):
    """``run``'s grids from the scorer's rows: a cell's found rate and token accuracy are the means over its
    needles (the scorer itself is checked above; here it answers by the needle's place in the run)."""
    calls = []

    def fake_score(model, rows, answers, device):
        calls.append(len(rows))
        k = len(calls) - 1  # needle k of the run: found when k % 3 == 0, else a third of the tokens right
        return [{"found": k % 3 == 0, "token_accuracy": 1.0 if k % 3 == 0 else 1 / 3}]

    monkeypatch.setattr(code_needle, "score", fake_score)
    haystacks = np.stack([haystack[:700], haystack[100:800]])
    result = code_needle.run(None, tokenizer, haystacks, lengths=[300, 600], depths=[0.0, 50.0, 100.0],
                             samples=2, batch=1, device="cpu")
    assert sum(calls) == 2 * 3 * 2
    found = [k % 3 == 0 for k in range(12)]
    tokens = [1.0 if f else 1 / 3 for f in found]
    # needles run length by length, depth by depth, then document by document
    for j, L in enumerate([300, 600]):
        cells = range(j * 6, j * 6 + 6)
        assert result["found_by_length"][str(L)] == pytest.approx(np.mean([found[k] for k in cells]))
        assert result["token_accuracy_by_length"][str(L)] == pytest.approx(np.mean([tokens[k] for k in cells]))
    assert result["found_all"] == pytest.approx(np.mean(found))
    assert result["token_accuracy_all"] == pytest.approx(np.mean(tokens))
    assert result["grid_found"][0][0] == pytest.approx((found[0] + found[1]) / 2)
