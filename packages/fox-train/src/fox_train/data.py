"""Training data: token sources, fixed-length sequences starting with BOS, and a resumable sampler.

Every source becomes a ``SequenceSource``: ``len()`` sequences of ``seq_len`` tokens, ``get(i)`` returns
one as int64. The model input is ``[BOS] + tokens[:-1]`` and the labels are the tokens (the paper's
convention; fox-models' ``per_token_loss=True``).
"""

from __future__ import annotations

import hashlib
import json
import lzma
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from fox_train.disk import save_npy

if TYPE_CHECKING:
    from fox_train.config import TrainConfig

EOT = 50256


def bundled_documents() -> list[str]:
    """The King James Bible shipped with fox-train: 66 documents (books), public domain."""
    path = resources.files("fox_train") / "corpus" / "kjv.jsonl.xz"
    with lzma.open(path.open("rb"), "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def split_documents(docs: list[str], every: int = 11) -> tuple[list[str], list[str]]:
    """(train, held-out): every ``every``-th document is held out."""
    return [d for i, d in enumerate(docs) if i % every != every - 1], [d for i, d in enumerate(docs) if i % every == every - 1]


def text_documents(path: str, name: str = "data.path") -> list[str]:
    """The .txt file ``path`` or every .txt file under the folder ``path``, one document each; errors name
    the setting (``name``: "data.path" or "data.heldout_path")."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{name} {path!r} does not exist")
    files = sorted(p.rglob("*.txt")) if p.is_dir() else [p]
    if not files:
        raise FileNotFoundError(f"{name} {path!r} holds no .txt files")
    docs = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    for f, doc in zip(files, docs):
        if "\x00" in doc:  # a binary file (text holds no NUL): it would train on its bytes as replacement text
            raise ValueError(f"{name} {str(f)!r} is not a text file (it holds NUL bytes)")
    if not any(doc.strip() for doc in docs):
        raise ValueError(f"{name} {path!r} holds no text")
    return docs


def hf_documents(path: str, text_field: str, name: str = "data.path") -> list[str]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError("data.source=hf needs the datasets package: pip install 'fox-train[hf]'") from e
    if not Path(path).exists():
        raise FileNotFoundError(f"{name} {path!r} does not exist (a dataset saved with save_to_disk)")
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"]
    if text_field not in ds.column_names:
        raise ValueError(f"data.text_field {text_field!r} is not a column of {path}: {ds.column_names}")
    return list(ds[text_field])


def tokenize_documents(docs: list[str], tokenizer, cache_dir: str | None = None,
                       unsaved: list | None = None) -> np.ndarray:
    """One token stream: each document's tokens followed by EOT. Cached on disk by content hash; with
    ``unsaved`` (a list), a stream not yet cached is appended to it as (cache path, stream) instead of being
    written (``save_token_caches`` writes them once the run is accepted)."""
    digest = hashlib.sha1("\x00".join(docs).encode()).hexdigest()[:16]
    cache = Path(cache_dir) / f"tokens-{digest}.npy" if cache_dir else None
    if cache is not None and cache.exists():
        return np.load(cache, mmap_mode="r")
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    stream = np.fromiter((t for doc in ids for t in (*doc, EOT)), dtype=np.uint16 if len(tokenizer) <= 65535 else np.uint32)
    if cache is not None and unsaved is not None:
        unsaved.append((cache, stream))
    elif cache is not None:
        save_token_caches([(cache, stream)])
    return stream


def save_token_caches(unsaved: list) -> None:
    """Write the (cache path, stream) pairs that ``tokenize_documents`` held back."""
    for cache, stream in unsaved:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_npy(cache, stream)


def load_token_file(path: str, dtype: str = "uint16", name: str = "data.path") -> np.ndarray:
    """The tokens of a ``.npy`` file or of a raw binary file of ``dtype`` integers, memory-mapped.

    Refuses, in one line naming the setting (``name``: "data.path" or "data.heldout_path") and the file:
    a missing, empty or unreadable file, a size that is no whole number of tokens, and non-integer data
    (a float ``.npy`` would be cast to wrong ids, values in [0, 1) to zeros). Reads no tokens:
    ``StreamSequences`` checks their values.
    """
    what = _file_label(path, name)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} does not exist")
    with p.open("rb") as f:  # a .npy file under another name: its header would be read as tokens
        is_npy = f.read(6) == b"\x93NUMPY"
    if p.suffix == ".npy" or is_npy:
        try:
            tokens = np.load(p, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise ValueError(f"{what} is not a readable .npy array of token ids: {e}") from None
    else:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            raise ValueError(f"data.token_dtype must be a numpy integer dtype such as uint16, got {dtype!r}") from None
        _require_integer_ids(np_dtype, what, " (data.token_dtype)")
        size = p.stat().st_size
        if size == 0 or size % np_dtype.itemsize:
            raise ValueError(f"{what} holds {size} bytes, not a whole, non-zero number of {np_dtype} tokens "
                             f"({np_dtype.itemsize} bytes each): is data.token_dtype right?")
        tokens = np.memmap(p, dtype=np_dtype, mode="r")
    _require_integer_ids(tokens.dtype, what)
    if tokens.ndim != 1:
        raise ValueError(f"{what} must hold a 1-D token stream, got shape {tokens.shape}")
    if tokens.size == 0:  # (numpy loads an empty .npy as an array without its file name)
        raise ValueError(f"{what} holds no tokens")
    return tokens


def _file_label(path, name: str | None) -> str:
    return f"{name} {str(path)!r}" if name else f"token file {str(path)!r}"


def _require_integer_ids(dtype: np.dtype, what: str, via: str = "") -> None:
    if dtype.kind not in "ui":
        raise ValueError(f"{what} holds {dtype} values{via}: token ids must be integers")


# Tokens read at once when checking a stream: 32 MiB of uint16, a small share of the memory of a run.
_CHECK_CHUNK = 1 << 24


def check_token_ids(tokens: np.ndarray, vocab_size: int | None, what: str) -> None:
    """Every token of ``tokens`` (1-D, e.g. a memmap) is an integer in [0, vocab_size): one vectorised
    pass, chunk by chunk (min and max per chunk; the first offender's position only in a failing chunk).
    Unsigned ids that cannot reach vocab_size need no pass at all."""
    _require_integer_ids(tokens.dtype, what)
    signed = tokens.dtype.kind == "i"
    if not signed and (vocab_size is None or np.iinfo(tokens.dtype).max < vocab_size):
        return
    for start in range(0, len(tokens), _CHECK_CHUNK):
        chunk = np.asarray(tokens[start : start + _CHECK_CHUNK])
        if signed and chunk.min() < 0:
            i = int(np.argmax(chunk < 0))
            raise ValueError(f"{what}: token id {int(chunk[i])} at position {_position(tokens, start + i)} is "
                             "negative: token ids must lie in [0, vocab_size)")
        if vocab_size is not None and chunk.max() >= vocab_size:
            i = int(np.argmax(chunk >= vocab_size))
            raise ValueError(f"{what}: token id {int(chunk[i])} at position {_position(tokens, start + i)} >= the "
                             f"model's vocab_size {vocab_size}: the data was tokenized with another vocabulary")


def _position(tokens: np.ndarray, i: int) -> int:
    """Position ``i`` of ``tokens`` counted in the whole file when ``tokens`` is a slice of a memmap (the
    held-out split of one file), else ``i``."""
    root = tokens
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root, np.memmap) or tokens.strides[0] != tokens.itemsize:
        return i
    return i + (tokens.ctypes.data - root.ctypes.data) // tokens.itemsize


class StreamSequences:
    """Consecutive windows of ``seq_len`` tokens of one stream (documents separated by EOT).

    Every token is checked once, here, against ``vocab_size`` (``check_token_ids``), so bad data fails
    before the first step, naming the file (``name``, e.g. "data.path", or the memmap's file).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int | None = None, name: str | None = None):
        filename = getattr(tokens, "filename", None)
        what = _file_label(filename, name) if filename else (name or "the token stream")
        if tokens.ndim != 1:
            raise ValueError(f"{what} must be a 1-D token stream, got shape {tokens.shape}")
        if len(tokens) < seq_len:
            raise ValueError(f"{what} holds {len(tokens)} tokens, fewer than one sequence of seq_len={seq_len}")
        check_token_ids(tokens, vocab_size, what)
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def get(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[i * self.seq_len : (i + 1) * self.seq_len], dtype=np.int64)


class LongCrawl64Sequences:
    """LongCrawl64 zarr (documents x 65536 tokens) cut into ``seq_len`` chunks.

    ``paper`` order: sequence i is chunk ``i // D`` of document ``i % D`` (every document's first chunk
    comes before any second chunk, as in the reference trainer).
    """

    def __init__(self, path: str, seq_len: int, name: str = "data.path"):
        try:
            import zarr
        except ImportError as e:
            raise ImportError("data.source=longcrawl64 needs zarr: pip install 'fox-train[longcrawl64]'") from e
        if not Path(path).exists():
            raise FileNotFoundError(f"{name} {path!r} does not exist (the LongCrawl64 train or heldout zarr)")
        self.array = zarr.open(path, mode="r")
        self.docs, self.doc_len = self.array.shape
        if self.doc_len % seq_len:
            raise ValueError(f"data.seq_len {seq_len} must divide the document length {self.doc_len}")
        self.seq_len, self.chunks = seq_len, self.doc_len // seq_len

    def __len__(self) -> int:
        return self.docs * self.chunks

    def get(self, i: int) -> np.ndarray:
        chunk, doc = divmod(i, self.docs)
        return np.asarray(self.array[doc, chunk * self.seq_len : (chunk + 1) * self.seq_len], dtype=np.int64)


class Sampler:
    """Which sequences make up micro-batch ``accum`` of step ``step`` on ``rank``: a pure function, so a
    run resumes at any step on any number of ranks with the same global batches."""

    def __init__(self, num_sequences: int, global_batch: int, micro_batch: int, world_size: int, shuffle: bool, seed: int):
        if global_batch % (micro_batch * world_size):
            raise ValueError(
                f"the global batch of {global_batch} sequences must be a multiple of micro_batch_size x devices "
                f"= {micro_batch} x {world_size}"
            )
        self.n, self.global_batch, self.micro, self.world = num_sequences, global_batch, micro_batch, world_size
        self.accum_steps = global_batch // (micro_batch * world_size)
        self.shuffle, self.seed = shuffle, seed
        self._epoch_perm: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_perm:
            self._epoch_perm = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n) if self.shuffle
                                else np.arange(self.n)}
        return self._epoch_perm[epoch]

    def indices(self, step: int, accum: int, rank: int) -> list[int]:
        start = step * self.global_batch + accum * self.micro * self.world + rank * self.micro
        out = []
        for pos in range(start, start + self.micro):
            epoch, offset = divmod(pos, self.n)
            out.append(int(self._order(epoch)[offset]))
        return out


def micro_batch_for(global_batch_tokens: int, seq_len: int, micro_batch: int, data_ranks: int) -> int:
    """Sequences per forward pass on each data-parallel rank: ``micro_batch``, or when it does not divide the
    rank's share of a step's sequences the largest size below it that does (a smaller forward only holds
    less memory: the step's sequences and its mean loss stay the same). ValueError naming the fields and
    values that work when the step's sequences cannot be shared equally among the ranks."""
    sequences = global_batch_tokens // seq_len
    if sequences % data_ranks:
        unit = seq_len * data_ranks
        below = sequences // data_ranks * unit
        choices = f"{below} or {below + unit}" if below else f"{unit}"
        raise ValueError(f"global_batch_tokens={global_batch_tokens} is {sequences} sequences of data.seq_len={seq_len}, "
                         f"which {data_ranks} data-parallel ranks (strategy.devices x strategy.num_nodes / "
                         f"strategy.context_parallel) cannot share equally: global_batch_tokens must be a multiple "
                         f"of data.seq_len x {data_ranks} = {unit}, e.g. {choices}")
    share = sequences // data_ranks
    return max(m for m in range(1, min(micro_batch, share) + 1) if share % m == 0)


def make_batch(source, indices: list[int], bos: int = EOT) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (B, T): labels are the sequences, inputs start with BOS."""
    labels = torch.from_numpy(np.stack([source.get(i) for i in indices]))
    inputs = torch.roll(labels, 1, dims=1)
    inputs[:, 0] = bos
    return inputs, labels


def build_sources(cfg: TrainConfig, tokenizer, cache_dir: str, vocab_size: int, unsaved: list | None = None):
    """The training and held-out sequences that ``cfg.data`` names; without a held-out path, the held-out part
    is split off the training data (every 11th document, or the last 1/11 of a token file). ``unsaved``: see
    ``tokenize_documents`` (a run refused later leaves no token cache behind)."""
    d = cfg.data
    if d.source in ("bundled", "text", "hf"):
        if d.source == "bundled":
            train_docs, held_docs = split_documents(bundled_documents())
        else:
            if d.path is None:
                raise ValueError(f"data.source={d.source} needs data.path")
            read = text_documents if d.source == "text" else (lambda p, name: hf_documents(p, d.text_field, name))
            docs = read(d.path, "data.path")
            train_docs, held_docs = ((docs, read(d.heldout_path, "data.heldout_path")) if d.heldout_path
                                     else split_documents(docs))
            if not held_docs:
                held_docs = train_docs[-1:]
        stream = lambda docs: StreamSequences(tokenize_documents(docs, tokenizer, cache_dir, unsaved), d.seq_len,
                                              vocab_size)
        return _with_global_batch(cfg, stream(train_docs), stream(held_docs))
    if d.source == "tokens":
        if d.path is None:
            raise ValueError("data.source=tokens needs data.path (a .npy or .bin token file)")
        tokens = load_token_file(d.path, d.token_dtype)
        if d.heldout_path:
            held = load_token_file(d.heldout_path, d.token_dtype, name="data.heldout_path")
            return _with_global_batch(cfg, StreamSequences(tokens, d.seq_len, vocab_size, name="data.path"),
                                      StreamSequences(held, d.seq_len, vocab_size, name="data.heldout_path"))
        cut = len(tokens) * 10 // 11
        return _with_global_batch(cfg, StreamSequences(tokens[:cut], d.seq_len, vocab_size, name="data.path"),
                                  StreamSequences(tokens[cut:], d.seq_len, vocab_size, name="data.path"))
    if d.source == "longcrawl64":
        if d.path is None:
            raise ValueError("data.source=longcrawl64 needs data.path (the train zarr) and data.heldout_path")
        train = LongCrawl64Sequences(d.path, d.seq_len)
        held = LongCrawl64Sequences(d.heldout_path, d.seq_len, name="data.heldout_path") if d.heldout_path else train
        return _with_global_batch(cfg, train, held)
    raise ValueError(f"data.source must be bundled, tokens, text, longcrawl64 or hf, got {d.source!r}")


def _with_global_batch(cfg: TrainConfig, train, held):
    """(train, held): ValueError naming global_batch_tokens when one step would take more sequences than the
    training data holds (each step would read the data more than once; a huge value would never end step 0)."""
    seq_len, sequences = cfg.data.seq_len, len(train)
    if cfg.global_batch_tokens > sequences * seq_len:
        raise ValueError(f"global_batch_tokens must be in [data.seq_len, the training data's tokens] = [{seq_len}, "
                         f"{sequences * seq_len}] ({sequences} sequences of data.seq_len={seq_len}), "
                         f"got {cfg.global_batch_tokens}")
    return train, held
