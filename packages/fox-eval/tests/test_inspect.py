"""fox-eval inspect: decay times, F and attention matrices and pruning fractions match direct computations."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import fox_models
from fox_eval.cli import main
from fox_models import inspect as fi

FAST, SLOW = 2.0, 1000.0  # decay times set by the test


def _model_with_set_gates(tmp_path):
    torch.manual_seed(0)
    cfg = fox_models.ForgettingTransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=2, num_heads=2,
                                                 qk_norm=True, use_output_gate=True, use_output_norm=True)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in fi.attention_layers(model):
            layer.fgate_proj.weight.zero_()
            layer.fgate_proj.bias.copy_(torch.tensor([-math.log(math.expm1(1 / FAST)), -math.log(math.expm1(1 / SLOW))]))
    model.save_pretrained(tmp_path / "m")
    fox_models.JSONGPT2Tokenizer().save_pretrained(tmp_path / "m")
    return model


def test_statistics_match_set_values_and_direct_computation(tmp_path):
    model = _model_with_set_gates(tmp_path)
    ids = torch.randint(0, 50257, (1, 300), generator=torch.Generator().manual_seed(0))
    stats = fi.gate_statistics(model, ids, block=32)
    for layer in stats:
        assert layer[0]["decay_time"] == pytest.approx(FAST, rel=1e-4)
        assert layer[1]["decay_time"] == pytest.approx(SLOW, rel=1e-4)
    caps = fi.capture(model, ids)
    cap = caps[1]
    # F equals exp(c_i - c_j) computed directly
    lf = cap.log_fgate[:, 0].double()
    F = fi.forget_matrix(cap, 0)
    for i, j in ((5, 5), (40, 3), (299, 250), (3, 40)):
        expected = math.exp(lf[j + 1 : i + 1].sum().item()) if j <= i else 0.0
        assert F[i, j].item() == pytest.approx(expected, rel=1e-5, abs=1e-30)
    # attention rows sum to 1 and equal a direct softmax
    A = fi.attention_matrix(cap, 1, block=64)
    torch.testing.assert_close(A.sum(-1), torch.ones(300), rtol=1e-5, atol=1e-5)
    i = 123
    c = torch.cumsum(cap.log_fgate[:, 1].double(), 0)
    s = cap.q[i, 1].double() @ cap.k[: i + 1, 1].double().T / math.sqrt(16) + c[i] - c[: i + 1]
    torch.testing.assert_close(A[i, : i + 1].double(), torch.softmax(s, -1), rtol=1e-5, atol=1e-6)
    # pruning fraction equals a direct count of skippable tiles
    for head, stat in enumerate(stats[1]):
        q, k = cap.q[:, head].double(), cap.k[:, head].double()
        u = q.norm(dim=-1).max() * k.norm(dim=-1).max() / 4
        delta = -(2 * u + math.log(300)) - 10
        ch = torch.cumsum(cap.log_fgate[:, head].double(), 0)
        blocks = [(qb, kb) for qb in range(10) for kb in range(qb + 1)]
        skip = sum(1 for qb, kb in blocks if kb < qb and ch[qb * 32] - ch[min(kb * 32 + 31, 299)] < delta)
        assert stat["pruned_fraction"] == pytest.approx(skip / len(blocks), abs=1e-6)
    assert stats[1][0]["pruned_fraction"] > 0.5 and stats[1][1]["pruned_fraction"] == 0.0


def test_cli_writes_json_and_figures(tmp_path, capsys):
    _model_with_set_gates(tmp_path)
    (tmp_path / "t.txt").write_text("And God said, Let there be light: and there was light. " * 30)
    out = tmp_path / "ins"
    main(["inspect", "--model", str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--layers", "1",
          "--heads", "0", "1", "--out", str(out), "--block", "32"])
    report = json.loads((out / "inspect.json").read_text())
    assert report["layers"][0][0]["decay_time"] == pytest.approx(FAST, rel=1e-4)
    for name in ("decay_times.png", "layer1_head0.png", "layer1_head1.png"):
        assert (out / name).stat().st_size > 2000
    assert "decay times" in capsys.readouterr().out


def test_models_without_forget_gate_say_so(tmp_path, capsys):
    cfg = fox_models.TransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=1, num_heads=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "t")
    (tmp_path / "x.txt").write_text("hello world " * 10)
    main(["inspect", "--model", str(tmp_path / "t"), "--text", str(tmp_path / "x.txt"), "--out", str(tmp_path / "o")])
    assert "has no forget gate" in capsys.readouterr().out
