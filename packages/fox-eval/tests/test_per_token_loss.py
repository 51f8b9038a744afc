"""fox-eval per-token-loss equals a direct computation; figures are written; runs resume; errors are clear."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import fox_models
from fox_eval.cli import main


@pytest.fixture
def tiny_model(tmp_path):
    torch.manual_seed(0)
    cfg = fox_models.ForgettingTransformerConfig(vocab_size=50257, hidden_size=32, num_hidden_layers=2, num_heads=2,
                                                 qk_norm=True, use_k_shift=True, use_output_gate=True)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path / "m")
    fox_models.JSONGPT2Tokenizer().save_pretrained(tmp_path / "m")
    return tmp_path / "m", model


def test_per_token_loss_equals_direct_computation(tmp_path, tiny_model):
    path, model = tiny_model
    tokens = np.random.default_rng(0).integers(0, 50257, size=5 * 40 + 7).astype(np.uint16)
    np.save(tmp_path / "held.npy", tokens)
    out = tmp_path / "res"
    main(["per-token-loss", "--model", str(path), "--data", f"tokens:{tmp_path / 'held.npy'}", "--seq-len", "40",
          "--batch-size", "2", "--out", str(out), "--train-len", "20"])
    seqs = torch.from_numpy(tokens[: 5 * 40].astype(np.int64).reshape(5, 40))
    inputs = torch.roll(seqs, 1, 1)
    inputs[:, 0] = 50256
    with torch.no_grad():
        logits = model(inputs).logits
    direct = F.cross_entropy(logits.transpose(1, 2), seqs, reduction="none").mean(0).double().numpy()
    got = np.load(out / "per_token_loss.npz")["m"]
    np.testing.assert_allclose(got, direct, rtol=1e-5)
    summary = json.loads((out / "per_token_loss.json").read_text())
    assert summary["num_sequences"] == 5 and abs(summary["models"]["m"]["mean"] - direct.mean()) < 1e-5
    for ext in ("png", "pdf"):
        assert (out / f"per_token_loss.{ext}").stat().st_size > 1000
    # A finished run resumes without recomputing (the partial sums say all sequences are done).
    main(["per-token-loss", "--model", str(path), "--data", f"tokens:{tmp_path / 'held.npy'}", "--seq-len", "40",
          "--out", str(out), "--device", "cpu"])
    np.testing.assert_allclose(np.load(out / "per_token_loss.npz")["m"], direct, rtol=1e-5)


def test_text_data_and_generate(tmp_path, tiny_model, capsys):
    path, _ = tiny_model
    (tmp_path / "t.txt").write_text("In the beginning was the word, and the word was with God. " * 20)
    main(["per-token-loss", "--model", str(path), "--data", f"text:{tmp_path / 't.txt'}", "--seq-len", "32",
          "--limit", "3", "--out", str(tmp_path / "r")])
    assert len(np.load(tmp_path / "r" / "per_token_loss.npz")["m"]) == 32
    main(["generate", "--model", str(path), "In the beginning", "--max-new-tokens", "5"])
    assert capsys.readouterr().out.strip() != ""


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(SystemExit, match="--model '/nope/model' does not exist"):
        main(["per-token-loss", "--model", "/nope/model", "--data", f"tokens:{tmp_path}", "--seq-len", "8"])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="--data path '/nope/data.npy' does not exist"):
        main(["per-token-loss", "--model", str(tmp_path), "--data", "tokens:/nope/data.npy", "--seq-len", "8"])
    with pytest.raises(SystemExit, match="must be a .npy or .bin file, not a directory"):
        main(["per-token-loss", "--model", str(tmp_path), "--data", f"tokens:{tmp_path}", "--seq-len", "8"])


def test_zarr_data(tmp_path):
    from fox_eval.data import load_sequences

    zarr = pytest.importorskip("zarr")
    arr = zarr.open(str(tmp_path / "h.zarr"), mode="w", shape=(4, 100), chunks=(1, 50), dtype="uint16")
    arr[:] = np.arange(400, dtype=np.uint16).reshape(4, 100)
    seqs = load_sequences(f"zarr:{tmp_path / 'h.zarr'}", 60, 3)
    assert seqs.shape == (3, 60) and seqs[2, 0] == 200 and seqs[2, -1] == 259
