"""A run folder owns its config and checkpoints; nothing in a checkpoint file runs; SIGTERM and Ctrl-C save a
checkpoint and stop in one line; bad values and unwritable folders are one-line errors."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import fox_models  # noqa: F401  (registers the model types)
from fox_train import checkpoint as ckpt
from fox_train.cli import compose, main
from fox_train.config import model_config

SMALL = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_heads=2", "data.seq_len=64", "micro_batch_size=4",
         "global_batch_tokens=256", "schedule.warmup_tokens=512", "eval_sequences=4", "eval_every=1000", "log_every=1"]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir):
    steps = [(r["step"], r["loss"]) for r in _records(run_dir) if "loss" in r]
    assert len({s for s, _ in steps}) == len(steps), f"a step logged twice: {[s for s, _ in steps]}"
    return dict(steps)


def _csv_steps_are_unique(run_dir):
    rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()[1:]]
    pairs = [(step, key) for step, key, _ in rows if key != "tokens"]  # a step's loss and held-out records both have it
    assert len(set(pairs)) == len(pairs)


def _fake_run(tmp_path, state_of_model):
    """A run directory with a config.yaml and one checkpoint whose state.pt is ``{"model": state_of_model(model),
    "step": 1}``, without training."""
    run = tmp_path / "run"
    step = ckpt.step_dir(run / "checkpoints", 1)
    step.mkdir(parents=True)
    cfg = compose(SMALL)
    OmegaConf.save(OmegaConf.structured(cfg), run / "config.yaml")
    model = AutoModelForCausalLM.from_config(model_config(cfg.model))
    torch.save({"model": state_of_model(model), "step": 1}, step / "state.pt")
    (step / ckpt.MARKER).write_text("1")
    return run, step


class _RunsCode:
    """Unpickling this runs ``exec``: it writes the file named ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_crafted_checkpoint_runs_nothing(tmp_path):
    """export, resume and init_from refuse a state.pt that would run code when unpickled, in one line;
    Fabric's FSDP loader (an unrestricted unpickler) never sees it."""
    from lightning.fabric.utilities.load import _lazy_load

    marker = tmp_path / "ran"
    run, step = _fake_run(tmp_path, lambda model: _RunsCode(marker))
    _lazy_load(step / "state.pt")  # what Fabric's FSDP strategy does with a full checkpoint
    assert marker.exists(), "the crafted file does not run code: the test proves nothing"
    marker.unlink()

    with pytest.raises(SystemExit) as e:
        main(["export", str(step), str(tmp_path / "hf")])
    message = str(e.value.code)
    assert message.startswith("fox-train export: ") and "\n" not in message
    assert "refused" in message and "(exec)" in message
    assert not marker.exists() and not (tmp_path / "hf").exists()

    class FSDPFabric:  # loads like Fabric's FSDP strategy
        def load(self, path, state, weights_only=None):
            return _lazy_load(path)

    with pytest.warns(UserWarning, match="skipping checkpoint"), pytest.raises(ValueError, match="no checkpoint under"):
        ckpt.load_newest(FSDPFabric(), run / "checkpoints", {})
    with pytest.warns(UserWarning), pytest.raises(SystemExit, match=r"^fox-train: resume=true: no checkpoint under .* "
                                                                     r"loads \(step-00000001: .*refused"):
        main([f"out_dir={tmp_path}", "run_name=run", "resume=true"])
    with pytest.raises(SystemExit, match=r"^fox-train: .*refused"):
        main([f"out_dir={tmp_path}", "run_name=warm", f"init_from={step}", "schedule.total_tokens=256", *SMALL])
    assert not marker.exists()


def test_export_of_a_truncated_checkpoint_or_to_an_unwritable_folder_is_one_line(tmp_path, monkeypatch):
    run, step = _fake_run(tmp_path, lambda model: model.state_dict())
    main(["export", str(step), str(tmp_path / "hf")])
    assert load_file(tmp_path / "hf" / "model.safetensors")

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "ro"))

    def full(*args, **kwargs):
        from safetensors import SafetensorError

        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    with monkeypatch.context() as m:
        m.setattr("transformers.PreTrainedModel.save_pretrained", read_only)
        with pytest.raises(SystemExit, match=r"^fox-train export: cannot write .*ro: \[Errno 13\] Permission denied"):
            main(["export", str(step), str(tmp_path / "ro")])
        m.setattr("transformers.PreTrainedModel.save_pretrained", full)
        with pytest.raises(SystemExit, match=r"^fox-train export: cannot write .*full: .*StorageFull"):
            main(["export", str(step), str(tmp_path / "full")])

    data = (step / "state.pt").read_bytes()
    (step / "state.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(SystemExit) as e:
        main(["export", str(step), str(tmp_path / "hf2")])
    assert str(e.value.code).startswith("fox-train export: ") and "truncated or not a PyTorch checkpoint" in str(e.value.code)
    assert "\n" not in str(e.value.code)
    with pytest.raises(SystemExit, match=r"^fox-train export: .* is not a checkpoint directory \(no state.pt\)$"):
        main(["export", str(tmp_path), str(tmp_path / "hf3")])
    (run / "config.yaml").unlink()
    (step / "state.pt").write_bytes(data)
    with pytest.raises(SystemExit, match=r"^fox-train export: .* has no config.yaml"):
        main(["export", str(step), str(tmp_path / "hf4")])


@pytest.mark.parametrize(("override", "key"), [
    ("keep_last=0", "keep_last"), ("data.seq_len=0", "data.seq_len"), ("micro_batch_size=0", "micro_batch_size"),
    ("checkpoint_every=0", "checkpoint_every"), ("log_every=0", "log_every"), ("eval_every=0", "eval_every"),
    ("eval_sequences=0", "eval_sequences"), ("schedule.total_tokens=-256", "schedule.total_tokens"),
    ("schedule.warmup_tokens=-1", "schedule.warmup_tokens"), ("global_batch_tokens=0", "global_batch_tokens"),
    ("keep_every=-1", "keep_every"), ("optimizer.lr=-0.001", "optimizer.lr"),
])
def test_bad_counts_are_one_line_errors(tmp_path, override, key):
    with pytest.raises(SystemExit, match=rf"^fox-train: {key} must be at least [01], got -?[\d.]+$"):
        main([f"out_dir={tmp_path}", "run_name=bad", *SMALL, override])
    assert not (tmp_path / "bad" / "checkpoints").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_accelerator_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^fox-train: strategy.accelerator=cuda strategy.devices=1: `CUDAAccelerator` "
                                         r"can not run on your system"):
        main([f"out_dir={tmp_path}", "strategy.accelerator=cuda", *SMALL])


def test_a_failed_save_leaves_no_temporary_files(tmp_path, monkeypatch):
    """Checkpoints are written beside their final place (not in the system temp directory); a save that
    fails (a full disk) removes its temporary directory and ends the run in one line; a resumed run removes
    the temporary directories of a killed one."""
    written = []

    def full_disk(self, checkpoint, path, storage_options=None):
        path = Path(path)
        written.append(path)
        path.write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 15104 vs 14998")  # torch.save's

    monkeypatch.setattr(ckpt.DirectTorchIO, "save_checkpoint", full_disk)
    with pytest.raises(SystemExit, match=r"^fox-train: cannot save checkpoint .*step-00000001: \[enforce fail .*unexpected "
                                         r"pos 15104 vs 14998 \(\d+\.\d MiB free on its disk\)$"):
        main([f"out_dir={tmp_path}", "run_name=full", "schedule.total_tokens=256", "export=false", *SMALL])
    root = tmp_path / "full" / "checkpoints"
    assert written and written[0].parent == root / ".tmp-step-00000001"
    assert sorted(p.name for p in root.iterdir()) == []
    (root / ".tmp-step-00000004").mkdir()
    ckpt.remove_partial(root)
    assert not any(root.iterdir())


def _file_hashes(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_keeps_the_run_config_and_refuses_conflicting_overrides(tmp_path):
    """A refused call changes no file of the run folder, Hydra's record (.hydra/) included."""
    args = [f"out_dir={tmp_path}", "run_name=r", "schedule.total_tokens=1024", "checkpoint_every=2", "export=false",
            *SMALL]
    main(args)
    run = tmp_path / "r"
    before = _file_hashes(run)
    assert {".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "config.yaml"} <= before.keys()
    assert sorted(p.name for p in ckpt.complete_checkpoints(run / "checkpoints")) == ["step-00000002", "step-00000004"]

    def unchanged():
        assert _file_hashes(run) == before

    with pytest.raises(SystemExit) as e:
        main([*args, "resume=true", "model.hidden_size=128", "optimizer.lr=1e-3"])
    message = str(e.value.code)
    assert "\n" not in message and message.startswith("fox-train: resume=true: the command line conflicts with")
    assert "model.hidden_size (saved 64, given 128)" in message and "optimizer.lr (saved 0.005, given 0.001)" in message
    unchanged()
    with pytest.raises(SystemExit, match=r"^fox-train: .*model.preset \(saved 'fox-pro-tiny', given 'fox-llama-tiny'\)"):
        main([*args, "resume=true", "model=fox-llama-tiny"])
    unchanged()
    with pytest.raises(SystemExit, match=r"^fox-train: .*r already holds checkpoints \(newest step-00000004\): "
                                         r"resume=true continues"):
        main([*args, "optimizer.lr=1e-3"])
    unchanged()
    with pytest.raises(SystemExit, match=r"^fox-train: log_every must be at least 1"):
        main([f"out_dir={tmp_path}", "run_name=r", "resume=true", "log_every=0"])
    unchanged()
    # refused inside train(), after the command line was accepted: no checkpoint loads. config.yaml and
    # .hydra/ still hold the last accepted call's values.
    states = {p: p.read_bytes() for p in sorted(run.glob("checkpoints/step-*/state.pt"))}
    for p, data in states.items():
        p.write_bytes(data[: len(data) // 3])
    before = _file_hashes(run)
    with pytest.raises(SystemExit, match=r"^fox-train: resume=true: no checkpoint under .* loads"):
        main([f"out_dir={tmp_path}", "run_name=r", "resume=true", "schedule.total_tokens=2048"])
    unchanged()
    for p, data in states.items():
        p.write_bytes(data)
    before = _file_hashes(run)
    # the run's own config, whatever the defaults: a finished run stays finished
    main([f"out_dir={tmp_path}", "run_name=r", "resume=true"])
    assert _losses(run).keys() == {1, 2, 3, 4}
    assert OmegaConf.load(run / "config.yaml").model.hidden_size == 64
    # the documented way to go on: a RESUMABLE key
    main([f"out_dir={tmp_path}", "run_name=r", "resume=true", "schedule.total_tokens=1536"])
    assert _losses(run).keys() == {1, 2, 3, 4, 5, 6}
    assert "schedule.total_tokens=1536" in OmegaConf.load(run / ".hydra" / "overrides.yaml")  # an accepted call's record
    _csv_steps_are_unique(run)
    assert OmegaConf.load(run / "config.yaml").schedule.total_tokens == 1536
    assert [p.name for p in ckpt.complete_checkpoints(run / "checkpoints")] == ["step-00000006", "step-00000004"]


def test_sigterm_or_ctrl_c_then_resume_equals_an_uninterrupted_run(tmp_path):
    """SIGTERM (a cluster's notice) and SIGINT (Ctrl-C) mid-run: the run saves a checkpoint of the step it
    finished, exits with 128 + the signal in one line; resuming gives the losses and final weights of an
    uninterrupted run, each step logged once."""
    args = [f"out_dir={tmp_path}", "schedule.total_tokens=3072", "checkpoint_every=100", *SMALL]
    main([*args, "run_name=straight"])
    straight = _losses(tmp_path / "straight")
    assert sorted(straight) == list(range(1, 13))
    for sig in (signal.SIGTERM, signal.SIGINT):
        name = sig.name.lower()
        log = tmp_path / f"{name}.err"
        with open(log, "w") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "fox_train.cli", *args, f"run_name={name}"],
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.DEVNULL, stderr=stderr)
        metrics = tmp_path / name / "metrics.jsonl"
        deadline = time.time() + 240
        while proc.poll() is None and time.time() < deadline and not (
                metrics.exists() and '"step": 3,' in metrics.read_text()):
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before the signal"
        proc.send_signal(sig)
        proc.wait(timeout=120)
        err = log.read_text()
        assert proc.returncode == 128 + sig, err[-2000:]
        assert "Traceback" not in err
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"fox-train: stopped by {sig.name} after step "), last
        stopped = int(last.split("after step ")[1].split()[0])
        assert 3 <= stopped < 12
        assert [p.name for p in ckpt.complete_checkpoints(tmp_path / name / "checkpoints")] == [f"step-{stopped:08d}"]
        main([*args, f"run_name={name}", "resume=true"])
        assert _losses(tmp_path / name) == pytest.approx(straight, abs=1e-6)
        _csv_steps_are_unique(tmp_path / name)
        a, b = load_file(tmp_path / "straight" / "hf" / "model.safetensors"), load_file(tmp_path / name / "hf" / "model.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_metrics_keep_the_steps_up_to_the_checkpoint(tmp_path):
    """A run resuming at step 3 drops the later records (and a line cut by a kill) from metrics.jsonl and
    metrics.csv; a run starting at step 0 starts them afresh."""
    from fox_train.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, {}, False, False, "fox")
    for step in range(6):
        writer.log({"step": step, "loss": 10.0 - step})
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')
    writer = MetricsWriter(tmp_path, {}, False, False, "fox", start_step=3)
    writer.log({"step": 4, "loss": 0.5})
    writer.close()
    assert [(r["step"], r["loss"]) for r in _records(tmp_path)] == [(0, 10.0), (1, 9.0), (2, 8.0), (3, 7.0), (4, 0.5)]
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        "step,key,value", "0,loss,10.0", "1,loss,9.0", "2,loss,8.0", "3,loss,7.0", "4,loss,0.5"]
    MetricsWriter(tmp_path, {}, False, False, "fox").close()
    assert (tmp_path / "metrics.jsonl").read_text() == "" and not (tmp_path / "metrics.csv").exists()


def test_a_full_disk_while_writing_tokens_is_one_line_and_leaves_no_part(tmp_path, monkeypatch):
    """numpy reports a full disk as a short write without an errno: the line names the file and the free
    space; the partly written file is removed (tokenize's output and the run's token cache)."""
    def short_write(path, array):
        Path(path).write_bytes(b"\x93NUMPY partial")
        raise OSError(f"{array.nbytes} requested and 14 written")

    monkeypatch.setattr("fox_train.disk.np.save", short_write)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("In the beginning God created the heaven and the earth.")
    out = tmp_path / "tokens" / "tok.npy"
    out.parent.mkdir()
    with pytest.raises(SystemExit, match=r"^fox-train tokenize: cannot write .*tok\.npy: \d+ requested and 14 written "
                                         r"\(\d+\.\d MiB free on its disk\)$"):
        main(["tokenize", str(tmp_path / "text"), str(out)])
    assert list(out.parent.iterdir()) == []
    with pytest.raises(SystemExit, match=r"^fox-train: cannot write .*/\.token-cache/tokens-\w+\.npy: \d+ requested "
                                         r"and 14 written \(\d+\.\d MiB free on its disk\)$"):
        main([f"out_dir={tmp_path / 'runs'}", "run_name=full", *SMALL])
    assert list((tmp_path / "runs" / ".token-cache").iterdir()) == []


def test_token_and_text_files_that_would_train_on_garbage_are_refused(tmp_path):
    """tokenize wrote .npy whatever the output's name, and a '.bin' was then read as raw ids, its 128-byte
    header as tokens; a binary file passed as text trained on its bytes as replacement characters; an empty
    corpus tokenized to one token."""
    import numpy as np

    from fox_train.data import load_token_file, text_documents

    (tmp_path / "a.txt").write_text("In the beginning God created the heaven and the earth.")
    with pytest.raises(SystemExit, match=r"^fox-train tokenize: output must end in \.npy .*got '.*big\.bin'$"):
        main(["tokenize", str(tmp_path / "a.txt"), str(tmp_path / "big.bin")])
    assert not (tmp_path / "big.bin").exists()
    ids = np.arange(300, dtype=np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    (tmp_path / "ids.npy").rename(tmp_path / "ids.bin")  # a .npy under a raw file's name reads as the .npy
    assert np.array_equal(load_token_file(str(tmp_path / "ids.bin")), ids)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00\x00\x00" * 50)
    with pytest.raises(ValueError, match=r"^data.path '.*x\.txt' is not a text file \(it holds NUL bytes\)$"):
        text_documents(str(tmp_path / "bin"))
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(SystemExit, match=r"^fox-train tokenize: input '.*empty\.txt' holds no text$"):
        main(["tokenize", str(tmp_path / "empty.txt"), str(tmp_path / "e.npy")])
