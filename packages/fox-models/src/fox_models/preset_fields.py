"""The named configs of every model family as plain data: ``PRESETS[family]`` (the paper's models) and
``TINY[family]`` (two layers of width 128, for tests and CPU smoke runs), each preset name -> config fields.

The one source of the presets' values. Each family's configuration module takes its part
(``fox_models.fox.configuration.PRESETS`` is ``PRESETS["fox"]``...), ``fox_models.presets`` adds the GPT-2
vocabulary. This module imports nothing, so that fox-train reads it by its file path without importing the
``fox_models`` package (which loads torch and transformers) to fill its ``model`` config group: ``fox-train
--help`` and a command-line error answer in about a second. fox-train shows a preset's fields of its
``ModelConfig``; so each preset spells out those it has (the FoX gates, ``rope_base``...) even where they
equal the config class's defaults (fox-train's tests compare its view with the configs).

The sizes are those of the official LongCrawl64 experiment configs (``configs/experiment/longcrawl64/**`` of
the reference repository). The families are in the order of ``fox_models.registry.MODELS``.
"""

# FoX and the Transformers: size -> (hidden, layers, FoX heads); FoX uses head dim 64 at every size.
SIZES = {"125m": (768, 12, 12), "360m": (1024, 24, 16), "760m": (1536, 24, 24)}
# The Transformers use head dim 64 at 125M/360M (as FoX) and 128 at 760M (12 heads); so do SAMBA's attention
# layers.
TRANSFORMER_HEADS = {"125m": 12, "360m": 16, "760m": 12}
# HGRN2 and DeltaNet: size -> (hidden, layers, heads); heads of width 128.
RECURRENT_SIZES = {"125m": (768, 12, 6), "360m": (1024, 24, 8), "760m": (1536, 24, 12)}
# Mamba-2: size -> (hidden, layers, heads); heads of width 64, state 128, expand 2, one group, chunk 256.
MAMBA2_SIZES = {"125m": (768, 24, 24), "360m": (1024, 48, 32), "760m": (1536, 48, 48)}

# FoX's attention: a forget gate, no RoPE (the Transformer (Pro) swaps them); the Pro block's parts, all off
# in the LLaMA block.
FOX_ATTENTION = dict(use_rope=False, rope_base=500000.0, fgate_type="full", fgate_bias_init=False)
PRO = dict(qk_norm=True, use_output_gate=True, use_output_norm=True, use_k_shift=True, use_v_shift=True,
           hidden_ratio=3.5)
LLAMA = dict(qk_norm=False, use_output_gate=False, use_output_norm=False, use_k_shift=False,
             use_v_shift=False, hidden_ratio=4)


def _decoder(size: str, num_heads: int) -> dict:
    hidden, layers, _ = SIZES[size]
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_heads=num_heads,
                max_position_embeddings=16384)


def _recurrent(size: str) -> dict:
    hidden, layers, heads = RECURRENT_SIZES[size]
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_heads=heads, hidden_ratio=4,
                max_position_embeddings=16384)


# FoX configs; the Transformer (Pro) is FoX (Pro) without forget gate and with RoPE, a FoX config too.
_FOX = {
    **{f"fox-pro-{s}": {**_decoder(s, h), **FOX_ATTENTION, **PRO} for s, (_, _, h) in SIZES.items()},
    **{f"fox-llama-{s}": {**_decoder(s, h), **FOX_ATTENTION, **LLAMA} for s, (_, _, h) in SIZES.items()},
    **{f"transformer-pro-{s}": {**_decoder(s, TRANSFORMER_HEADS[s]), **FOX_ATTENTION, **PRO,
                                "fgate_type": "none", "use_rope": True} for s in SIZES},
}
# The Transformer (LLaMA), and Transformer-SWA: the official configs' window of 2048
# (configs/experiment/longcrawl64/transformer_swa).
_TRANSFORMER = {f"transformer-llama-{s}": dict(_decoder(s, TRANSFORMER_HEADS[s]), hidden_ratio=4,
                                               rope_base=500000.0) for s in SIZES}
_TRANSFORMER.update({f"transformer-swa-{s}": dict(_TRANSFORMER[f"transformer-llama-{s}"], window_size=2048)
                     for s in SIZES})
_MAMBA2 = {f"mamba2-{s}": dict(hidden_size=hidden, num_hidden_layers=layers, num_heads=heads, head_dim=64,
                               state_size=128, expand=2, n_groups=1, chunk_size=256, initializer_range=0.02)
           for s, (hidden, layers, heads) in MAMBA2_SIZES.items()}
# HGRN2: expand ratio 128; conv_size is the released configs' field (unused: HGRN2 has no short convolution)
_HGRN2 = {f"hgrn2-{s}": dict(_recurrent(s), expand_ratio=128, conv_size=4) for s in RECURRENT_SIZES}
# DeltaNet: short convolutions of 4, the output norm
_DELTA_NET = {f"delta_net-{s}": dict(_recurrent(s), conv_size=4, use_output_norm=True)
              for s in RECURRENT_SIZES}
# SAMBA: FoX's hidden size and depth (half the layers Mamba, half attention), the attention layers shaped as
# the Transformer's, window 2048; samba-760m is the official
# configs/experiment/longcrawl64/samba/760m_16b.yaml with the defaults of configs/model/samba.py. The
# attention layers' fields (num_heads, num_kv_heads, window_size) are flat here, as SambaConfig's keyword
# arguments and fox-train name them; fox_models.samba nests them under ``attn`` as the reference's configs do.
_SAMBA = {f"samba-{s}": dict(hidden_size=hidden, num_hidden_layers=layers, num_heads=TRANSFORMER_HEADS[s],
                             num_kv_heads=None, window_size=2048, state_size=16, expand=2, conv_kernel=4,
                             norm_eps=1e-5, attn_hidden_ratio=4, mamba_hidden_ratio=3, rope_base=500000.0,
                             time_step_rank="auto", rescale_prenorm_residual=True, pad_token_id=None,
                             max_position_embeddings=16384)
          for s, (hidden, layers, _) in SIZES.items()}

PRESETS = {"fox": _FOX, "transformer": _TRANSFORMER, "mamba2": _MAMBA2, "hgrn2": _HGRN2,
           "delta_net": _DELTA_NET, "samba": _SAMBA}

_TINY = dict(hidden_size=128, num_hidden_layers=2)
TINY = {
    "fox": {"fox-pro-tiny": dict(_FOX["fox-pro-125m"], **_TINY, num_heads=4),
            "fox-llama-tiny": dict(_FOX["fox-llama-125m"], **_TINY, num_heads=4)},
    "transformer": {
        "transformer-llama-tiny": dict(_TRANSFORMER["transformer-llama-125m"], **_TINY, num_heads=2),
        "transformer-swa-tiny": dict(_TRANSFORMER["transformer-llama-125m"], **_TINY, num_heads=2,
                                     window_size=8),
    },
    "mamba2": {"mamba2-tiny": dict(_MAMBA2["mamba2-760m"], **_TINY, num_heads=4, head_dim=64, state_size=16)},
    "hgrn2": {"hgrn2-tiny": dict(_HGRN2["hgrn2-760m"], **_TINY, num_heads=2, expand_ratio=64)},
    "delta_net": {"delta_net-tiny": dict(_DELTA_NET["delta_net-760m"], **_TINY, num_heads=2)},
    "samba": {"samba-tiny": dict(_SAMBA["samba-125m"], **_TINY, num_heads=2, window_size=8)},
}
