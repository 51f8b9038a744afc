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
    the command line's checks or in train()'s (a missing data file); a folder that was there stays. A sweep
    whose every job is refused leaves no sweep folder."""
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
    assert list(tmp_path.iterdir()) == []  # nor Hydra's multirun.yaml, which the sweep folder used to keep
    # folders given to Hydra directly, inside out_dir or not
    with pytest.raises(SystemExit, match=r"^fox-train: log_every must be at least 1, got 0$"):
        main([f"hydra.run.dir={tmp_path}/e2/plain", "log_every=0", *SMALL[:-2]])
    with pytest.raises(SystemExit, match=r"^fox-train: log_every must be at least 1, got 0$"):
        main([f"out_dir={tmp_path}/o4", f"hydra.run.dir={tmp_path}/o4/x", "log_every=0", *SMALL[:-2]])
    with pytest.raises(SystemExit, match=r"^fox-train: log_every must be at least 1, got -?\d$"):
        main(["-m", f"hydra.sweep.dir={tmp_path}/sw3", "log_every=0,-1", *SMALL[:-2]])
    assert list(tmp_path.iterdir()) == []


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


def test_a_run_refused_after_tokenizing_leaves_no_token_cache(tmp_path):
    """The token cache (out_dir/.token-cache) is written once the run is accepted: a global batch larger than
    the text, or a missing init_from, found after the text was tokenized, used to leave it behind."""
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("In the beginning God created the heaven and the earth. " * 300)
    out = tmp_path / "out"
    data = ["data=text", f"data.path={tmp_path / 'text'}"]
    with deadline(120), pytest.raises(SystemExit) as e:
        main([f"out_dir={out}", "run_name=r", *SMALL, *data, "global_batch_tokens=1048576",
              "schedule.total_tokens=1048576"])
    assert _one_line(e).startswith("fox-train: global_batch_tokens must be in [data.seq_len, the training data's "
                                   "tokens] = [64, ")
    assert not out.exists(), list(out.rglob("*"))
    with deadline(120), pytest.raises(SystemExit, match=r"^fox-train: init_from"):
        main([f"out_dir={out}", "run_name=r", *SMALL, *data, f"init_from={tmp_path / 'no-such-run'}"])
    assert not out.exists(), list(out.rglob("*"))


@pytest.mark.parametrize(("override", "message"), [
    ("optimizer.betas=[0.9]", "optimizer.betas must be two numbers in [0, 1), got [0.9]"),  # an IndexError traceback
    ("optimizer.betas=[1.5,0.9]", "optimizer.betas must be two numbers in [0, 1), got [1.5, 0.9]"),
    ("optimizer.eps=0", "optimizer.eps must be a finite number > 0, got 0.0"),  # non-finite gradients at step 1
    ("optimizer.eps=-1", "optimizer.eps must be a finite number > 0, got -1.0"),
    ("seed=-1", "seed must be an int in [0, 4294967295] (numpy's seeds), got -1"),
    ("seed=4294967296", "seed must be an int in [0, 4294967295] (numpy's seeds), got 4294967296"),
    ("data.order=bogus", "data.order must be one of ('paper', 'shuffled'), got 'bogus'"),  # ran in stored order
    ("model.hidden_size=-1", "model.hidden_size must be an int >= 1, got -1"),  # named as hidden_size
    ("model.num_hidden_layers=-1", "model.num_hidden_layers must be an int >= 1, got -1"),
    ("+model.overrides.norm_eps=-1", "model.overrides.norm_eps must be a finite number > 0, got -1"),
    # a misspelt field: transformers' configs keep it as an attribute no model reads, so the run trained the
    # preset unchanged
    ("+model.overrides.norm_epsilon=1e-5",
     "model.overrides.norm_epsilon is not a field of fox-pro-tiny (ForgettingTransformerConfig)"),
])
def test_settings_torch_or_the_model_would_refuse_are_named_as_set(tmp_path, override, message):
    """Values that AdamW, numpy's seeding or the model's config refused in words naming no setting (or a
    traceback), or that were accepted without effect, are refused before the run in one line naming the
    setting as the command line sets it."""
    with pytest.raises(SystemExit) as e:
        main([f"out_dir={tmp_path}", "run_name=r", *SMALL, override])
    assert _one_line(e) == f"fox-train: {message}"
    assert list(tmp_path.iterdir()) == []


def test_an_empty_token_file_is_named(tmp_path):
    """An empty .npy loads as an array without its file name: the stream was called "the token stream"."""
    empty = tmp_path / "empty.npy"
    np.save(empty, np.zeros(0, np.uint16))
    with pytest.raises(SystemExit) as e:
        main([f"out_dir={tmp_path / 'out'}", "run_name=r", *SMALL, "data=tokens", f"data.path={empty}"])
    assert _one_line(e) == f"fox-train: data.path '{empty}' holds no tokens"


def test_gradients_that_are_not_finite_stop_the_run_before_that_step_is_saved(tmp_path):
    """A learning rate of 1e30 blows the weights up in step 1, so step 2's gradients are not finite: the run
    stops at step 2's end in one line naming the step, and only step 1's checkpoint is on disk (the
    weights the optimizer step of step 2 wrote NaN into are never saved)."""
    with pytest.raises(SystemExit) as e:
        main([f"out_dir={tmp_path}", "run_name=r", "model=fox-pro-tiny", *SMALL, "optimizer.lr=1e30",
              "schedule.warmup_tokens=0", "schedule.total_tokens=1280", "checkpoint_every=1", "keep_last=5"])
    message = _one_line(e)
    assert message.startswith("fox-train: step 2: the gradient norm is ") and "stopped before saving" in message
    norm = message.removeprefix("fox-train: step 2: the gradient norm is ").split(";")[0]
    assert not np.isfinite(float(norm))
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step-00000001"]
