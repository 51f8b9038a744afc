"""fox-eval per-token-loss equals a direct computation; figures are written; runs resume only onto the same
model and data; several models never mix; errors are one clear line."""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import fox_models
from fox_eval import loading
from fox_eval import per_token_loss as ptl
from fox_eval.cli import main

SEQ = 37  # not a multiple of the batch


def _save(path, seed, **kw):
    torch.manual_seed(seed)
    kw = {"num_hidden_layers": 2, **kw}
    cfg = fox_models.ForgettingTransformerConfig(vocab_size=50257, hidden_size=32, num_heads=2, qk_norm=True,
                                                 use_k_shift=True, use_output_gate=True, **kw)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path)
    fox_models.JSONGPT2Tokenizer().save_pretrained(path)
    return model


@pytest.fixture
def tiny_model(tmp_path):
    return tmp_path / "m", _save(tmp_path / "m", 0)


@pytest.fixture
def held(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, size=5 * SEQ + 7).astype(np.uint16)
    np.save(tmp_path / "held.npy", tokens)
    return f"tokens:{tmp_path / 'held.npy'}", torch.from_numpy(tokens[: 5 * SEQ].astype(np.int64).reshape(5, SEQ))


def _direct(model, seqs):
    inputs = torch.roll(seqs, 1, 1)
    inputs[:, 0] = 50256
    with torch.no_grad():
        logits = model(inputs).logits
    return F.cross_entropy(logits.transpose(1, 2), seqs, reduction="none").mean(0).double().numpy()


def _ptl(model_paths, data, out, *extra):
    main(["per-token-loss", "--model", *map(str, model_paths), "--data", data, "--seq-len", str(SEQ),
          "--out", str(out), "--device", "cpu", *extra])
    return dict(np.load(out / "per_token_loss.npz"))


def test_per_token_loss_equals_direct_computation(tmp_path, tiny_model, held, monkeypatch):
    path, model = tiny_model
    data, seqs = held
    entered = []
    real = ptl.autocast
    monkeypatch.setattr(ptl, "autocast", lambda device: entered.append(str(device)) or real(device))
    out = tmp_path / "res"
    main(["per-token-loss", "--model", str(path), "--data", data, "--seq-len", str(SEQ), "--batch-size", "3",
          "--out", str(out), "--train-len", "20"])
    assert entered == ["cpu", "cpu"]  # two batches (3 + 2), each under the eval's autocast
    direct = _direct(model, seqs)
    np.testing.assert_allclose(np.load(out / "per_token_loss.npz")["m"], direct, rtol=1e-5)
    summary = json.loads((out / "per_token_loss.json").read_text())
    assert summary["num_sequences"] == 5 and abs(summary["models"]["m"]["mean"] - direct.mean()) < 1e-5
    assert summary["precision"] == "float32" and summary["models"]["m"]["model"] == str(path.resolve())
    assert summary["models"]["m"]["prefix_mean"] == {str(SEQ): pytest.approx(direct.mean(), rel=1e-6)}
    curve = np.arange(2048.0)
    assert ptl.prefix_means(curve) == {"2048": 1023.5, "1024": 511.5, "512": 255.5}
    for ext in ("png", "pdf"):
        assert (out / f"per_token_loss.{ext}").stat().st_size > 1000
    # A finished run resumes without recomputing (the partial sums say all sequences are done).
    entered.clear()
    np.testing.assert_allclose(_ptl([path], data, out)["m"], direct, rtol=1e-5)
    assert entered == []


def test_two_models_in_one_call_give_what_each_gives_alone(tmp_path, held):
    """The README's pattern --model run-a/hf run-b/hf: two curves, named by run, each its own model's."""
    data, seqs = held
    a = _save(tmp_path / "run-a" / "hf", 0)
    b = _save(tmp_path / "run-b" / "hf", 1, num_hidden_layers=1)
    both = _ptl([tmp_path / "run-a" / "hf", tmp_path / "run-b" / "hf"], data, tmp_path / "both")
    assert list(both) == ["run-a", "run-b"]
    np.testing.assert_allclose(both["run-a"], _direct(a, seqs), rtol=1e-5)
    np.testing.assert_allclose(both["run-b"], _direct(b, seqs), rtol=1e-5)
    assert np.abs(both["run-a"] - both["run-b"]).max() > 1e-2  # random models: equal means, different curves
    for run in ("run-a", "run-b"):
        alone = _ptl([tmp_path / run / "hf"], data, tmp_path / f"{run}-alone")
        np.testing.assert_allclose(alone[run], both[run], rtol=1e-12)


def test_reused_out_never_returns_another_models_numbers(tmp_path, held):
    data, seqs = held
    path = tmp_path / "exp" / "hf"
    _save(path, 0)
    first = _ptl([path], data, tmp_path / "out")["exp"]
    # Another model in the same folder (same path, same basename): retrained in place.
    other = _save(path, 7)
    again = _ptl([path], data, tmp_path / "out")["exp"]
    np.testing.assert_allclose(again, _direct(other, seqs), rtol=1e-5)
    assert np.abs(again - first).max() > 1e-2
    # A third model in another folder with the same basename, same --out.
    third = _save(tmp_path / "other" / "exp" / "hf", 3)
    got = _ptl([tmp_path / "other" / "exp" / "hf"], data, tmp_path / "out")["exp"]
    np.testing.assert_allclose(got, _direct(third, seqs), rtol=1e-5)


def test_resume_only_onto_the_same_sequences(tmp_path, tiny_model, held, monkeypatch):
    path, model = tiny_model
    data, seqs = held
    seen = []
    real = ptl.sequence_losses
    monkeypatch.setattr(ptl, "sequence_losses", lambda m, s, *a, **k: seen.append(len(s)) or real(m, s, *a, **k))
    out = tmp_path / "out"
    _ptl([path], data, out, "--limit", "2")
    # a larger --limit continues from the two sequences done
    np.testing.assert_allclose(_ptl([path], data, out, "--limit", "4")["m"], _direct(model, seqs[:4]), rtol=1e-5)
    # a smaller one cannot reuse sums over four sequences: it starts again
    np.testing.assert_allclose(_ptl([path], data, out, "--limit", "3")["m"], _direct(model, seqs[:3]), rtol=1e-5)
    assert seen == [2, 2, 3]
    # other data of the same length starts again too
    np.save(tmp_path / "held2.npy", np.random.default_rng(1).integers(0, 50257, size=3 * SEQ).astype(np.uint16))
    other = torch.from_numpy(np.load(tmp_path / "held2.npy").astype(np.int64).reshape(3, SEQ))
    got = _ptl([path], f"tokens:{tmp_path / 'held2.npy'}", out)["m"]
    np.testing.assert_allclose(got, _direct(model, other), rtol=1e-5)
    assert seen[-1] == 3


def test_run_takes_labels(tmp_path, tiny_model, held):
    path, model = tiny_model
    _, seqs = held
    curves = ptl.run([str(path), str(path)], seqs.numpy(), tmp_path / "o", 2, torch.device("cpu"), None,
                     labels=["FoX (Pro)", "again"])
    assert list(curves) == ["FoX (Pro)", "again"]
    np.testing.assert_allclose(curves["again"], curves["FoX (Pro)"], rtol=1e-12)
    with pytest.raises(ValueError, match="--labels: 2 models need 2 labels, got 1"):
        ptl.run([str(path), str(path)], seqs.numpy(), tmp_path / "o", 2, torch.device("cpu"), None, labels=["x"])
    with pytest.raises(ValueError, match="at least one sequence"):
        ptl.run([str(path)], seqs.numpy()[:0], tmp_path / "o", 2, torch.device("cpu"), None)


def test_labels_are_unique_and_readable(tmp_path):
    L = loading.model_labels
    assert L(["x/run-a/hf", "y/run-b/hf", "z/final"]) == ["run-a", "run-b", "final"]
    assert L(["x/run-a/hf", "y/run-a/hf"]) == ["x/run-a", "y/run-a"]
    assert L(["a/b/m", "c/b/m", "d/m"]) == ["a/b/m", "c/b/m", "d/m"]
    assert L(["m", "./m"]) == ["m", "m#2"]
    assert L(["hf"])[0] == tmp_path.cwd().name
    with pytest.raises(ValueError, match="--labels must be unique"):
        L(["a", "b"], ["x", "x"])


def test_fingerprint_follows_config_and_weights(tmp_path, tiny_model):
    path, _ = tiny_model
    shutil.copytree(path, tmp_path / "copy")
    assert loading.model_fingerprint(path) == loading.model_fingerprint(tmp_path / "copy")
    cfg = json.loads((tmp_path / "copy" / "config.json").read_text())
    (tmp_path / "copy" / "config.json").write_text(json.dumps({**cfg, "norm_eps": 1e-5}))
    assert loading.model_fingerprint(path) != loading.model_fingerprint(tmp_path / "copy")
    _save(tmp_path / "copy", 5)
    assert loading.model_fingerprint(path) != loading.model_fingerprint(tmp_path / "copy")


def test_text_data_and_generate(tmp_path, tiny_model, capsys):
    path, _ = tiny_model
    (tmp_path / "t.txt").write_text("In the beginning was the word, and the word was with God. " * 20)
    main(["per-token-loss", "--model", str(path), "--data", f"text:{tmp_path / 't.txt'}", "--seq-len", "32",
          "--limit", "3", "--out", str(tmp_path / "r")])
    assert len(np.load(tmp_path / "r" / "per_token_loss.npz")["m"]) == 32
    main(["generate", "--model", str(path), "In the beginning", "--max-new-tokens", "5"])
    assert capsys.readouterr().out.strip() != ""


@pytest.mark.parametrize("option, value", [("--limit", "0"), ("--limit", "-1"), ("--seq-len", "0"),
                                           ("--batch-size", "0"), ("--train-len", "0")])
def test_values_below_one_are_named(tmp_path, tiny_model, held, option, value):
    path, _ = tiny_model
    data, _ = held
    args = {"--seq-len": str(SEQ), option: value}
    with pytest.raises(SystemExit, match=f"^fox-eval: {option} must be >= 1, got {value}$"):
        main(["per-token-loss", "--model", str(path), "--data", data, "--out", str(tmp_path / "o"),
              *(x for kv in args.items() for x in kv)])
    assert not (tmp_path / "o").exists()
    from fox_eval.data import load_sequences

    with pytest.raises(ValueError, match="--limit must be >= 1, got 0"):
        load_sequences(data, SEQ, 0)


def test_token_files_load_as_writable_arrays(tmp_path):
    """A memory map of int64 ids came back read-only, and torch warned ("The given NumPy array is not
    writable") on every tensor made from it."""
    import warnings

    from fox_eval.data import load_sequences

    ids = np.arange(100, dtype=np.int64)
    np.save(tmp_path / "t.npy", ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seqs = load_sequences(f"tokens:{tmp_path / 't.npy'}", 16, None)
        torch.from_numpy(seqs)
    assert seqs.flags.writeable and np.array_equal(seqs.reshape(-1), ids[:96])


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(SystemExit, match="--model '/nope/model' does not exist"):
        main(["per-token-loss", "--model", "/nope/model", "--data", f"tokens:{tmp_path}", "--seq-len", "8"])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="--data path '/nope/data.npy' does not exist"):
        main(["per-token-loss", "--model", str(tmp_path), "--data", "tokens:/nope/data.npy", "--seq-len", "8"])
    with pytest.raises(SystemExit, match="must be a .npy or .bin file, not a directory"):
        main(["per-token-loss", "--model", str(tmp_path), "--data", f"tokens:{tmp_path}", "--seq-len", "8"])


def _broken(tmp_path, name, how):
    path = tmp_path / name
    _save(path, 0)
    weights = path / "model.safetensors"
    if how == "config":
        (path / "config.json").write_text("{not json")
    elif how == "no-weights":
        weights.unlink()
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "garbage":
        weights.write_bytes(b"\0" * 64)
    return path


@pytest.mark.parametrize("how", ["config", "no-weights", "truncated", "garbage"])
def test_broken_model_folders_are_one_line(tmp_path, held, how):
    data, _ = held
    path = _broken(tmp_path, how, how)
    with pytest.raises(SystemExit) as e:
        main(["per-token-loss", "--model", str(path), "--data", data, "--seq-len", str(SEQ), "--out", str(tmp_path / "o"),
              "--device", "cpu"])
    msg = str(e.value)
    assert msg.startswith(f"fox-eval: --model '{path}'") and "\n" not in msg


def test_unusable_device_and_output_are_one_line(tmp_path, tiny_model, held, monkeypatch):
    path, _ = tiny_model
    data, _ = held
    args = ["per-token-loss", "--model", str(path), "--data", data, "--seq-len", str(SEQ)]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="^fox-eval: --device cuda: no CUDA GPU is available here"):
            main([*args, "--device", "cuda"])
    with pytest.raises(SystemExit, match="^fox-eval: --device must be auto, cpu, cuda or cuda:N, got 'gpu'$"):
        main([*args, "--device", "gpu"])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        main([*args, "--device", "cpu", "--out", str(tmp_path / "file" / "out")])
    assert str(e.value).startswith("fox-eval: ") and str(tmp_path / "file") in str(e.value) and "\n" not in str(e.value)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("fox_eval.per_token_loss.np.savez", full_disk)
    with pytest.raises(SystemExit, match=rf"^fox-eval: cannot write --out {tmp_path / 'full'}: \[Errno 28\] No space "
                                         r"left on device$"):
        main([*args, "--device", "cpu", "--out", str(tmp_path / "full")])


def test_zarr_data(tmp_path):
    from fox_eval.data import load_sequences

    zarr = pytest.importorskip("zarr")
    arr = zarr.open(str(tmp_path / "h.zarr"), mode="w", shape=(4, 100), chunks=(1, 50), dtype="uint16")
    arr[:] = np.arange(400, dtype=np.uint16).reshape(4, 100)
    seqs = load_sequences(f"zarr:{tmp_path / 'h.zarr'}", 60, 3)
    assert seqs.shape == (3, 60) and seqs[2, 0] == 200 and seqs[2, -1] == 259


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_crafted_pickle_weights_run_nothing(tmp_path, held):
    """A pytorch_model.bin that would create a file when unpickled: refused in one line, nothing created."""
    import pickle

    data, _ = held
    path = _broken(tmp_path, "evil", "no-weights")
    marker = tmp_path / "ran"
    (path / "pytorch_model.bin").write_bytes(pickle.dumps({"model.norm.weight": _RunsCode(marker)}, protocol=2))
    with pytest.raises(SystemExit) as e:
        main(["per-token-loss", "--model", str(path), "--data", data, "--seq-len", str(SEQ), "--out", str(tmp_path / "o"),
              "--device", "cpu"])
    assert str(e.value).startswith(f"fox-eval: --model '{path}' cannot be loaded") and "\n" not in str(e.value)
    assert not marker.exists()


def test_token_files_that_cannot_be_token_ids_are_refused(tmp_path, tiny_model):
    path, _ = tiny_model
    args = ["per-token-loss", "--model", str(path), "--seq-len", "8", "--out", str(tmp_path / "o"), "--device", "cpu"]
    np.save(tmp_path / "f.npy", np.zeros(64, dtype=np.float32))
    with pytest.raises(SystemExit, match=r"must hold a 1-D array of integer token ids, got float32 of shape \(64,\)"):
        main([*args, "--data", f"tokens:{tmp_path / 'f.npy'}"])
    np.save(tmp_path / "o.npy", np.array([{"a": 1}] * 8, dtype=object), allow_pickle=True)
    with pytest.raises(SystemExit, match="is not a readable token file"):
        main([*args, "--data", f"tokens:{tmp_path / 'o.npy'}"])
    np.save(tmp_path / "big.npy", np.full(64, 60000, dtype=np.uint16))
    with pytest.raises(SystemExit, match=r"--data holds token id 60000, outside the vocabulary of --model .* \(ids 0..50256\)"):
        main([*args, "--data", f"tokens:{tmp_path / 'big.npy'}"])


def test_interrupted_run_resumes_and_leaves_no_temporary_files(tmp_path, tiny_model, held, monkeypatch):
    path, model = tiny_model
    data, seqs = held
    real = ptl.sequence_losses

    def stop_after_one_batch(*a, **k):
        for i, item in enumerate(real(*a, **k)):
            if i == 1:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(ptl, "sequence_losses", stop_after_one_batch)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        _ptl([path], data, out, "--batch-size", "2")
    assert e.value.code == 130
    (part,) = (out / "partial").glob("*.npz")
    assert int(np.load(part)["done"]) == 2
    monkeypatch.setattr(ptl, "sequence_losses", real)
    np.testing.assert_allclose(_ptl([path], data, out, "--batch-size", "2")["m"], _direct(model, seqs), rtol=1e-5)
    assert [f.name for f in (out / "partial").iterdir()] == [part.name]
    # a partial file cut short by a crash is not trusted: the run starts again; a stale temporary is removed
    part.write_bytes(part.read_bytes()[:40])
    part.with_name(part.name + ".tmp.npz").write_bytes(b"cut")
    np.testing.assert_allclose(_ptl([path], data, out)["m"], _direct(model, seqs), rtol=1e-5)
    assert [f.name for f in (out / "partial").iterdir()] == [part.name]


def test_context_parallel_per_token_loss_equals_one_process(tmp_path, tiny_model, held):
    """Two gloo processes under torchrun, each scoring its zigzag shard of every sequence, write the curve one
    process writes (float32: equal to rounding); a length that does not split is refused in one line."""
    import os
    import subprocess
    import sys

    path, _ = tiny_model
    data, _ = held
    args = ["per-token-loss", "--model", str(path), "--data", data, "--seq-len", "36", "--device", "cpu",
            "--batch-size", "2"]
    main([*args, "--out", str(tmp_path / "one")])
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "fox_eval.cli", *args, "--out", str(tmp_path / "two"), "--context-parallel"],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("mean loss") == 1  # rank 0 reports
    one, two = (np.load(tmp_path / d / "per_token_loss.npz")["m"] for d in ("one", "two"))
    assert one.shape == two.shape == (36,)
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-6)
    with pytest.raises(SystemExit, match="--context-parallel runs under torchrun"):
        main([*args, "--out", str(tmp_path / "three"), "--context-parallel"])
