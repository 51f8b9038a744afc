"""Bad input to fox-train ends in one line naming the setting, what it accepts and what it got, before a step
runs: an absurd global batch, a missing held-out path."""

import signal
from contextlib import contextmanager

import numpy as np
import pytest

from fox_train.cli import main

SMALL = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_heads=2", "data.seq_len=64", "micro_batch_size=4",
         "global_batch_tokens=256", "schedule.warmup_tokens=512", "eval_sequences=4", "eval_every=1000", "log_every=1",
         "export=false"]


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
    if source == "tokens":
        floats = tmp_path / "floats.npy"
        np.save(floats, np.zeros(1000, np.float32))
        with pytest.raises(SystemExit, match=rf"^fox-train: data.heldout_path '{floats}' holds float32 values"):
            main([f"out_dir={tmp_path}", "run_name=r", *SMALL, "data=tokens", f"data.path={path}",
                  f"data.heldout_path={floats}"])
