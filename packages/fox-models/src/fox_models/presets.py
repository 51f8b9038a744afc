"""Named configs for every model and size of the paper (FOX.md section 5).

``get_preset("fox-pro-760m")`` returns a config; ``PRESETS`` lists the names: FoX (Pro/LLaMA), Transformer
(Pro/LLaMA) and the recurrent baselines Mamba-2, HGRN2 and DeltaNet, each at 125M, 360M and 760M, with the
sizes of the official LongCrawl64 experiment configs (``configs/experiment/longcrawl64/**`` of the reference
repository).
"""

from __future__ import annotations

from fox_models.configuration import ForgettingTransformerConfig, TransformerConfig

GPT2_VOCAB = 50257
GPT2_EOT = 50256

# size -> (hidden, layers, FoX heads); FoX uses head dim 64 at every size.
SIZES = {"125m": (768, 12, 12), "360m": (1024, 24, 16), "760m": (1536, 24, 24)}
# The Transformers use head dim 64 at 125M/360M (as FoX) and 128 at 760M (12 heads).
TRANSFORMER_HEADS = {"125m": 12, "360m": 16, "760m": 12}

PRO = dict(qk_norm=True, use_output_gate=True, use_output_norm=True, use_k_shift=True, use_v_shift=True, hidden_ratio=3.5)

FAMILIES = {
    "fox-pro": (ForgettingTransformerConfig, dict(PRO)),
    "fox-llama": (ForgettingTransformerConfig, dict(hidden_ratio=4)),
    "transformer-pro": (ForgettingTransformerConfig, dict(PRO, fgate_type="none", use_rope=True)),
    "transformer-llama": (TransformerConfig, dict(hidden_ratio=4)),
}

TOKENS = dict(bos_token_id=GPT2_EOT, eos_token_id=GPT2_EOT)

# The recurrent baselines: size -> fields. Mamba-2: head dim 64, state 128 (expand 2, one group, chunk 256);
# HGRN2: expand ratio 128 (heads = hidden / 128); DeltaNet: head dim 128, short convolutions of 4.
BASELINE_SIZES = {
    "mamba2": {"125m": dict(hidden_size=768, num_hidden_layers=24, num_heads=24),
               "360m": dict(hidden_size=1024, num_hidden_layers=48, num_heads=32),
               "760m": dict(hidden_size=1536, num_hidden_layers=48, num_heads=48)},
    "hgrn2": {"125m": dict(hidden_size=768, num_hidden_layers=12, num_heads=6),
              "360m": dict(hidden_size=1024, num_hidden_layers=24, num_heads=8),
              "760m": dict(hidden_size=1536, num_hidden_layers=24, num_heads=12)},
    "delta_net": {"125m": dict(hidden_size=768, num_hidden_layers=12, num_heads=6),
                  "360m": dict(hidden_size=1024, num_hidden_layers=24, num_heads=8),
                  "760m": dict(hidden_size=1536, num_hidden_layers=24, num_heads=12)},
}


def _build(family: str, size: str, **overrides):
    cls, extra = FAMILIES[family]
    hidden, layers, heads = SIZES[size]
    if family.startswith("transformer"):
        heads = TRANSFORMER_HEADS[size]
    kw = dict(vocab_size=GPT2_VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_heads=heads,
              max_position_embeddings=16384, **TOKENS, **extra)
    kw.update(overrides)
    return cls(**kw)


def _build_baseline(family: str, size: str, **overrides):
    from fox_models.baselines import DeltaNetConfig, HGRN2Config
    from fox_models.mamba2 import Mamba2Config

    kw = dict(vocab_size=GPT2_VOCAB, **TOKENS, **BASELINE_SIZES[family][size])
    if family == "mamba2":
        cls = Mamba2Config
        kw.update(head_dim=64, state_size=128, expand=2, n_groups=1, chunk_size=256, initializer_range=0.02)
    else:
        cls = HGRN2Config if family == "hgrn2" else DeltaNetConfig
        kw.update(hidden_ratio=4, max_position_embeddings=16384)
        kw.update(dict(expand_ratio=128) if family == "hgrn2" else dict(conv_size=4))
    return cls(**{**kw, **overrides})


BASELINE_PRESETS = [f"{family}-{size}" for family in BASELINE_SIZES for size in SIZES]
PRESETS = [f"{family}-{size}" for family in FAMILIES for size in SIZES] + BASELINE_PRESETS


def get_preset(name: str, **overrides):
    """A config for a named preset, e.g. ``fox-pro-760m``; keyword overrides replace fields."""
    family, _, size = name.rpartition("-")
    if family in FAMILIES and size in SIZES:
        return _build(family, size, **overrides)
    if family in BASELINE_SIZES and size in SIZES:
        return _build_baseline(family, size, **overrides)
    raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
