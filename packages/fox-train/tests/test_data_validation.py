"""Token files are checked whole, once, before training: integer ids in [0, vocab_size), one clear line.

Without the check a float .npy would train on zeros, and an id out of range anywhere in the file would
crash a later step with an IndexError.
"""

import numpy as np
import pytest

from fox_train import data
from fox_train.data import StreamSequences, check_token_ids, load_token_file

VOCAB = 1000


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4096 tokens, so small files span many chunks and a bad id can sit in any of them."""
    monkeypatch.setattr(data, "_CHECK_CHUNK", 4096)


def _ids(n, dtype, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(dtype)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int32, np.int64])
@pytest.mark.parametrize("n, bad_at", [(40_001, 40_000), (12_345, 4096), (12_345, 4095), (9_999, 0),
                                       ((1 << 20) + 77, (1 << 20) + 5)])
def test_an_id_past_the_vocabulary_anywhere_is_named_with_its_position(tmp_path, small_chunks, dtype, n, bad_at):
    ids = _ids(n, dtype)
    ids[bad_at] = VOCAB + 7
    if bad_at + 3 < n:
        ids[bad_at + 3] = VOCAB + 99  # a later offender: the first one is reported
    path = tmp_path / "tokens.npy"
    np.save(path, ids)
    tokens = load_token_file(str(path))
    with pytest.raises(ValueError, match=rf"^token file '{path}': token id {VOCAB + 7} at position {bad_at} >= "
                                         rf"the model's vocab_size {VOCAB}"):
        StreamSequences(tokens, 64, VOCAB)
    StreamSequences(tokens, 64, VOCAB + 100)  # the same file with a larger vocabulary is fine


def test_valid_files_pass_and_read_the_same_tokens(tmp_path, small_chunks):
    ids = _ids(50_000, np.uint16)
    np.save(tmp_path / "a.npy", ids)
    ids.tofile(tmp_path / "a.bin")
    for path in ("a.npy", "a.bin"):
        seqs = StreamSequences(load_token_file(str(tmp_path / path)), 128, VOCAB)
        assert len(seqs) == 50_000 // 128
        assert np.array_equal(seqs.get(3), ids[3 * 128 : 4 * 128].astype(np.int64))
    # uint16 ids cannot reach a vocabulary above 65535: nothing to read
    StreamSequences(load_token_file(str(tmp_path / "a.bin")), 128, 70_000)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.bool_, np.complex64])
def test_non_integer_npy_is_refused(tmp_path, dtype):
    path = tmp_path / "tokens.npy"
    np.save(path, (np.random.default_rng(0).random(5000)).astype(dtype))  # floats in [0, 1): zeros as ids
    with pytest.raises(ValueError, match=rf"^data.path '{path}' holds {np.dtype(dtype)} values: token ids must be "
                                         r"integers$"):
        load_token_file(str(path))
    with pytest.raises(ValueError, match=rf"^data.heldout_path '{path}' holds"):
        load_token_file(str(path), name="data.heldout_path")
    with pytest.raises(ValueError, match=r"^the token stream holds .* values: token ids must be integers$"):
        StreamSequences(np.zeros(100, dtype=dtype), 10, VOCAB)


def test_object_and_unreadable_npy_are_one_line(tmp_path):
    path = tmp_path / "objects.npy"
    np.save(path, np.array([1, "a", None], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=rf"^data.path '{path}' is not a readable .npy array of token ids: "):
        load_token_file(str(path))
    junk = tmp_path / "junk.npy"
    junk.write_bytes(b"not an array at all")
    with pytest.raises(ValueError, match=rf"^data.path '{junk}' is not a readable .npy array"):
        load_token_file(str(junk))
    two_d = tmp_path / "two_d.npy"
    np.save(two_d, np.zeros((4, 50), dtype=np.uint16))
    with pytest.raises(ValueError, match=r"must hold a 1-D token stream, got shape \(4, 50\)"):
        load_token_file(str(two_d))


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
def test_negative_ids_are_refused(tmp_path, small_chunks, dtype):
    ids = _ids(10_000, dtype)
    ids[8_191] = -3
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    tokens = load_token_file(str(path), np.dtype(dtype).name)
    with pytest.raises(ValueError, match=r"token id -3 at position 8191 is negative"):
        StreamSequences(tokens, 64, VOCAB)
    with pytest.raises(ValueError, match=r"token id -3 at position 8191 is negative"):
        StreamSequences(tokens, 64)  # even without a vocabulary to compare with


def test_raw_files_of_a_wrong_dtype_or_size(tmp_path):
    path = tmp_path / "tokens.bin"
    _ids(1001, np.uint16).tofile(path)  # 2002 bytes
    with pytest.raises(ValueError, match=r"holds float32 values \(data.token_dtype\): token ids must be integers"):
        load_token_file(str(path), "float32")
    with pytest.raises(ValueError, match=r"holds 2002 bytes, not a whole, non-zero number of uint32 tokens "
                                         r"\(4 bytes each\): is data.token_dtype right\?"):
        load_token_file(str(path), "uint32")
    with pytest.raises(ValueError, match=r"data.token_dtype must be a numpy integer dtype such as uint16, got 'uint17'"):
        load_token_file(str(path), "uint17")
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds 0 bytes"):
        load_token_file(str(empty))
    with pytest.raises(FileNotFoundError, match=r"^data.heldout_path '/no/such.bin' does not exist$"):
        load_token_file("/no/such.bin", name="data.heldout_path")


def test_the_held_out_slice_of_one_file_reports_file_positions(tmp_path, small_chunks):
    """train.py splits one file into train and held-out slices: a bad id in the held-out part is named by
    its position in the file, and the train part, which holds none, passes."""
    ids = _ids(30_000, np.uint16)
    ids[27_000] = VOCAB
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    tokens = load_token_file(str(path))
    StreamSequences(tokens[:25_000], 100, VOCAB)
    with pytest.raises(ValueError, match=rf"token id {VOCAB} at position 27000 >="):
        StreamSequences(tokens[25_000:], 100, VOCAB, name="data.path")


def test_check_token_ids_on_in_memory_streams():
    check_token_ids(np.arange(VOCAB, dtype=np.uint16), VOCAB, "stream")
    with pytest.raises(ValueError, match=rf"^stream: token id {VOCAB} at position {VOCAB} >="):
        check_token_ids(np.arange(VOCAB + 1, dtype=np.int64), VOCAB, "stream")


def test_fox_train_refuses_bad_token_files_before_the_first_step(tmp_path):
    """Through the command line: one line, before any step (no run folder with metrics)."""
    from fox_train.cli import main

    small = ["model.hidden_size=64", "model.num_hidden_layers=2", "model.num_heads=2", "data.seq_len=64",
             "micro_batch_size=4", "global_batch_tokens=256", "schedule.total_tokens=1024", "eval_sequences=4",
             f"out_dir={tmp_path}", "run_name=bad", "data=tokens", "export=false"]
    floats = tmp_path / "floats.npy"
    np.save(floats, np.random.default_rng(0).random(20_000).astype(np.float32))
    with pytest.raises(SystemExit, match=rf"^fox-train: data.path '{floats}' holds float32 values: token ids must be"):
        main([*small, f"data.path={floats}"])
    ids = tmp_path / "ids.npy"
    bad = _ids((1 << 20) + 4096, np.uint16)
    bad[(1 << 20) + 100] = 60_000  # past the first 2^20 tokens, which were all that was checked
    np.save(ids, bad)
    with pytest.raises(SystemExit, match=rf"^fox-train: data.path '{ids}': token id 60000 at position 1048676 >= "
                                         r"the model's vocab_size"):  # named as the setting, not "token file"
        main([*small, f"data.path={ids}"])
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
