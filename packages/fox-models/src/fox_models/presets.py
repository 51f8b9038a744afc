"""Named configs of every registered model (``fox_models.registry``).

``get_preset("fox-pro-760m")`` returns a config; keyword overrides replace fields. ``PRESETS`` lists the
paper's models: FoX (Pro/LLaMA), Transformer (Pro/LLaMA/SWA), the recurrent baselines
Mamba-2, HGRN2 and DeltaNet, and SAMBA, each at 125M, 360M and 760M, with the sizes of the official LongCrawl64
experiment configs (``configs/experiment/longcrawl64/**`` of the reference repository) and the GPT-2
vocabulary. ``TINY_PRESETS`` lists tiny models of each kind (two layers of width 128) for tests and CPU
smoke runs.
"""

from __future__ import annotations

from fox_models.registry import MODELS
from fox_models.tokenizer import GPT2_VOCAB_SIZE

GPT2_EOT = 50256  # <|endoftext|>: BOS and EOS of the paper's models

_FIELDS = {name: (e.config_class, fields) for e in MODELS for name, fields in {**e.presets, **e.tiny}.items()}
PRESETS = [name for e in MODELS for name in e.presets]
TINY_PRESETS = [name for e in MODELS for name in e.tiny]


def get_preset(name: str, **overrides):
    """A config for a named preset, e.g. ``fox-pro-760m`` or ``mamba2-tiny``; keyword overrides replace fields."""
    if name not in _FIELDS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS + TINY_PRESETS)}")
    config_class, fields = _FIELDS[name]
    return config_class(**{"vocab_size": GPT2_VOCAB_SIZE, "bos_token_id": GPT2_EOT, "eos_token_id": GPT2_EOT,
                           **fields, **overrides})
