"""Bad input to fox-train ends in one line naming the setting, what it accepts and what it got, before a step
runs: an absurd global batch, a run name that leaves out_dir or that Hydra's parser cannot read, a missing
held-out path; a refused run leaves no folder behind."""

import signal
from contextlib import contextmanager

import numpy as np
import pytest

from fox_train.cli import compose, main
from fox_train.train import train

SMALL = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_heads=2", "data.seq_len=64", "micro_batch_size=4",
         "global_batch_tokens=256", "schedule.warmup_tokens=512", "eval_sequences=4", "eval_every=1000", "log_every=1",
         "export=false"]
RUN_NAME = r"^fox-train: run_name must be a plain folder name inside out_dir \(ASCII letters, digits and ._-\+@, " \
           r"sub-folders joined by /, no '..' or leading /\), got "


@contextmanager
def deadline(seconds: int):
    """TimeoutError in the main thread after ``seconds``: a call that hangs fails instead."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _tokens(path, n=20_000):
    np.save(path, np.random.default_rng(0).integers(0, 50_000, n, dtype=np.uint16))
    return path


def _one_line(e) -> str:
    message = str(e.value.code)
    assert "\n" not in message, message
    return message


def test_an_absurd_global_batch_is_refused_before_step_0(tmp_path):
    """2^62 tokens per step: past schedule.total_tokens, and (with a total as large) past the training data;
    the run used to start and never end step 0."""
    huge = 4611686018427387904
    with deadline(120), pytest.raises(SystemExit) as e:
        main([f"out_dir={tmp_path}", "run_name=big", *SMALL, f"global_batch_tokens={huge}"])
    assert _one_line(e) == (f"fox-train: global_batch_tokens must be in [data.seq_len, schedule.total_tokens] = "
                            f"[64, 245760], got {huge}")
    tokens = _tokens(tmp_path / "ids.npy")  # 18,181 training tokens: 284 sequences of 64
    with deadline(120), pytest.raises(SystemExit) as e:
        main([f"out_dir={tmp_path}", "run_name=big", *SMALL, "data=tokens", f"data.path={tokens}",
              f"global_batch_tokens={huge}", f"schedule.total_tokens={huge}"])
    assert _one_line(e) == (f"fox-train: global_batch_tokens must be in [data.seq_len, the training data's tokens] = "
                            f"[64, 18176] (284 sequences of data.seq_len=64), got {huge}")
    assert not (tmp_path / "big").exists()


@pytest.mark.parametrize("name", ["../../x", "ABS", "a/../../x", ".", "a\nb", "é", "run one", "a//b"])
def test_a_run_name_outside_out_dir_or_unreadable_by_hydra_is_one_line(tmp_path, name):
    """On the command line (before Hydra's lexer reads it: a newline or a non-ASCII letter stopped it with a
    LexerNoViableAltException) and in a config given to train(); no folder is made anywhere."""
    name = str(tmp_path / "abs") if name == "ABS" else name
    out = tmp_path / "a" / "out"
    # log_every=0 is refused too: a run name that got through would be reported with that error instead
    with pytest.raises(SystemExit) as e:
        main([f"out_dir={out}", f"run_name={name}", "log_every=0", *SMALL[:-2]])
    assert _one_line(e) == f"fox-train: run_name must be a plain folder name inside out_dir (ASCII letters, digits " \
                           f"and ._-+@, sub-folders joined by /, no '..' or leading /), got {name!r}"
    assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))
    cfg = compose(SMALL)
    cfg.out_dir, cfg.run_name, cfg.log_every = str(out), name, 0
    with pytest.raises(ValueError, match=RUN_NAME[len("^fox-train: "):]):
        train(cfg)
    assert list(tmp_path.iterdir()) == []


def test_quoted_and_nested_run_names_inside_out_dir_still_work(tmp_path):
    cfg = compose([f"out_dir={tmp_path}", "run_name='v1.2-lr+3@x'", *SMALL])
    assert cfg.run_name == "v1.2-lr+3@x"
    with pytest.raises(SystemExit, match=r"^fox-train: log_every must be at least 1, got 0$"):
        main([f"out_dir={tmp_path}", "run_name=group/run-1", "log_every=0", *SMALL[:-2]])


def test_a_refused_run_leaves_no_folder(tmp_path):
    """The folder Hydra makes for the run (and the out_dir it made) goes again when the call is refused, in
    the command line's checks or in train()'s (a missing data file); a folder that was there stays, as do
    the other jobs' folders of a sweep."""
    out = tmp_path / "new" / "out"
    with pytest.raises(SystemExit, match=r"^fox-train: log_every must be at least 1, got 0$"):
        main([f"out_dir={out}", "run_name=r", "log_every=0", *SMALL[:-2]])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit, match=r"^fox-train: data.path '/no/such/file.npy' does not exist$"):
        main([f"out_dir={tmp_path}", "run_name=r", "data=tokens", "data.path=/no/such/file.npy", *SMALL])
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    with pytest.raises(SystemExit, match=r"^fox-train: log_every must be at least 1, got 0$"):
        main([f"out_dir={tmp_path}", "run_name=mine", "log_every=0", *SMALL[:-2]])
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]
    (tmp_path / "mine").rmdir()
    with pytest.raises(SystemExit, match=r"^fox-train: log_every must be at least 1, got -?\d$"):
        main(["-m", f"out_dir={tmp_path}", "run_name=sweep", "log_every=0,-1", *SMALL[:-2]])
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["multirun.yaml"]  # Hydra's sweep record


@pytest.mark.parametrize("source", ["text", "tokens"])
def test_a_missing_held_out_path_is_named_as_such(tmp_path, source):
    if source == "text":
        (tmp_path / "corpus").mkdir()
        (tmp_path / "corpus" / "a.txt").write_text("In the beginning God created the heaven and the earth. " * 200)
        path = tmp_path / "corpus"
    else:
        path = _tokens(tmp_path / "ids.npy")
    missing = tmp_path / "no-such-heldout"
    with pytest.raises(SystemExit) as e:
        main([f"out_dir={tmp_path}", "run_name=r", *SMALL, f"data={source}", f"data.path={path}",
              f"data.heldout_path={missing}"])
    assert _one_line(e) == f"fox-train: data.heldout_path '{missing}' does not exist"
    assert not (tmp_path / "r").exists()
    if source == "tokens":
        floats = tmp_path / "floats.npy"
        np.save(floats, np.zeros(1000, np.float32))
        with pytest.raises(SystemExit, match=rf"^fox-train: data.heldout_path '{floats}' holds float32 values"):
            main([f"out_dir={tmp_path}", "run_name=r", *SMALL, "data=tokens", f"data.path={path}",
                  f"data.heldout_path={floats}"])
