"""Named configs for every model and size of the paper (FOX.md section 5).

``get_preset("fox-pro-760m")`` returns a config; ``PRESETS`` lists the names (FoX Pro/LLaMA and
Transformer Pro/LLaMA at 125M, 360M and 760M; the recurrent baselines Mamba-2, HGRN2 and DeltaNet at 760M).
"""

from __future__ import annotations

from fox_models.configuration import ForgettingTransformerConfig, TransformerConfig

GPT2_VOCAB = 50257
GPT2_EOT = 50256

# size -> (hidden, layers, FoX heads); Transformers use head dim 128.
SIZES = {"125m": (768, 12, 12), "360m": (1024, 24, 16), "760m": (1536, 24, 24)}

PRO = dict(qk_norm=True, use_output_gate=True, use_output_norm=True, use_k_shift=True, use_v_shift=True, hidden_ratio=3.5)

FAMILIES = {
    "fox-pro": (ForgettingTransformerConfig, dict(PRO)),
    "fox-llama": (ForgettingTransformerConfig, dict(hidden_ratio=4)),
    "transformer-pro": (ForgettingTransformerConfig, dict(PRO, fgate_type="none", use_rope=True)),
    "transformer-llama": (TransformerConfig, dict(hidden_ratio=4)),
}

def _build(family: str, size: str, **overrides):
    cls, extra = FAMILIES[family]
    hidden, layers, heads = SIZES[size]
    if family.startswith("transformer"):
        heads = hidden // 128
    kw = dict(vocab_size=GPT2_VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_heads=heads,
              bos_token_id=GPT2_EOT, eos_token_id=GPT2_EOT, max_position_embeddings=16384, **extra)
    kw.update(overrides)
    return cls(**kw)


def _baselines():
    from fox_models.baselines import DeltaNetConfig, HGRN2Config
    from fox_models.mamba2 import Mamba2Config

    common = dict(vocab_size=GPT2_VOCAB, hidden_size=1536, num_hidden_layers=24, hidden_ratio=4,
                  bos_token_id=GPT2_EOT, eos_token_id=GPT2_EOT, max_position_embeddings=16384)
    return {
        # 12 heads with expand ratio 128, the lower-bound parameters stored (see fox_models.baselines)
        "hgrn2-760m": (HGRN2Config, dict(common, num_heads=12, expand_ratio=128)),
        # 12 heads of 128, short convolutions of 4, L2 q/k norm, SiLU, beta, output norm
        "delta_net-760m": (DeltaNetConfig, dict(common, num_heads=12, conv_size=4)),
        # 48 layers, 48 heads of 64, state 128, expand 2, one group, chunk 256
        "mamba2-760m": (Mamba2Config, dict(vocab_size=GPT2_VOCAB, hidden_size=1536, num_hidden_layers=48,
                                           num_heads=48, head_dim=64, state_size=128, expand=2, n_groups=1,
                                           chunk_size=256, bos_token_id=GPT2_EOT, eos_token_id=GPT2_EOT)),
    }


BASELINE_PRESETS = ["mamba2-760m", "hgrn2-760m", "delta_net-760m"]
PRESETS = [f"{family}-{size}" for family in FAMILIES for size in SIZES] + BASELINE_PRESETS


def get_preset(name: str, **overrides):
    """A config for a named preset, e.g. ``fox-pro-760m``; keyword overrides replace fields."""
    for family in FAMILIES:
        for size in SIZES:
            if name == f"{family}-{size}":
                return _build(family, size, **overrides)
    if name in BASELINE_PRESETS:
        cls, kw = _baselines()[name]
        return cls(**{**kw, **overrides})
    raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
