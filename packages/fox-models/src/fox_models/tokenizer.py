"""GPT-2 tokenizers that work offline from the BPE files shipped in this package.

``JSONGPT2Tokenizer`` is the published FoX tokenizer class: GPT-2 BPE over the JSON-escaped body of the
text (``json.dumps(text)[1:-1]``, how LongCrawl64 was tokenized), decoded back with ``json.loads``.
"""

from __future__ import annotations

import gzip
import json
from functools import cache
from importlib import resources

from transformers import GPT2Tokenizer

from fox_models import hub

EOT = "<|endoftext|>"
GPT2_VOCAB_SIZE = 50257


@cache
def gpt2_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The GPT-2 byte-level vocab (50257 entries) and its 50000 merges, from the package's assets."""
    assets = resources.files("fox_models") / "assets"
    with gzip.open(assets.joinpath("gpt2_vocab.json.gz").open("rb"), "rt", encoding="utf-8") as f:
        vocab = json.load(f)
    with gzip.open(assets.joinpath("gpt2_merges.txt.gz").open("rb"), "rt", encoding="utf-8") as f:
        merges = [tuple(line.split(" ")) for line in f.read().splitlines()[1:] if line]
    return vocab, merges


def _offline_kwargs(kwargs: dict) -> dict:
    if kwargs.get("vocab") is None and kwargs.get("vocab_file") is None:
        vocab, merges = gpt2_vocab_and_merges()
        kwargs = dict(kwargs, vocab=dict(vocab), merges=list(merges))
    for name in ("bos_token", "eos_token", "unk_token"):
        kwargs.setdefault(name, EOT)
    return kwargs


def gpt2_tokenizer(**kwargs) -> GPT2Tokenizer:
    """A plain GPT-2 tokenizer built from the shipped ranks (no download)."""
    return GPT2Tokenizer(**_offline_kwargs(kwargs))


def json_escape(text: str) -> str:
    return json.dumps(text)[1:-1]


def json_unescape(text: str) -> str:
    try:
        return json.loads(f'"{text}"')
    except json.JSONDecodeError:  # a cut escape sequence (e.g. mid-generation): keep the raw text
        return text


class JSONGPT2Tokenizer(GPT2Tokenizer):
    """GPT-2 BPE applied to JSON-escaped text; the published FoX tokenizer (``add_bos_token=True``)."""

    def __init__(self, *args, add_bos_token: bool = True, **kwargs):
        super().__init__(*args, add_bos_token=add_bos_token, **_offline_kwargs(kwargs))

    def _encode_plus(self, text, text_pair=None, *args, **kwargs):
        return super()._encode_plus(self._escape(text), self._escape(text_pair), *args, **kwargs)

    def tokenize(self, text, pair=None, add_special_tokens: bool = False, **kwargs):
        return super().tokenize(json_escape(text), pair, add_special_tokens=add_special_tokens, **kwargs)

    def _decode(self, token_ids, *args, **kwargs):
        return json_unescape(super()._decode(token_ids, *args, **kwargs))

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, plus the auto_map that lets AutoTokenizer find this class with
        ``trust_remote_code=True`` and no ``import fox_models`` (see ``fox_models.hub``)."""
        files = super().save_pretrained(save_directory, *args, **kwargs)
        hub.add_tokenizer_auto_map(save_directory, type(self).__name__)
        return files

    @staticmethod
    def _escape(text):
        if isinstance(text, str):
            return json_escape(text)
        if isinstance(text, (list, tuple)) and text and isinstance(text[0], str):
            return [json_escape(t) for t in text]
        return text
