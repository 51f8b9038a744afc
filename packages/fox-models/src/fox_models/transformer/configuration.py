"""The Transformer (LLaMA) config in the format of the published checkpoints, and its named configs."""

from __future__ import annotations

from fox_models.compat import CACHE_KWARG
from fox_models.fox.configuration import SIZES, TRANSFORMER_HEADS, _DecoderConfig, size_fields


class TransformerConfig(_DecoderConfig):
    """Transformer (LLaMA): RoPE attention, SwiGLU MLP, RMSNorm; with ``window_size`` the paper's
    Transformer-SWA (sliding-window attention over the last ``window_size`` tokens)."""

    model_type = "transformer-project_fox"
    keys_to_ignore_at_inference = [CACHE_KWARG]  # the outputs' cache, by the installed release's name

    def __init__(self, **kwargs):  # transformers 5 needs each config class to define its own __init__
        super().__init__(**kwargs)

    def attention_kwargs(self) -> dict:
        return dict(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, fgate_type="none", use_rope=True,
            rope_base=self.rope_base, attention_bias=self.attention_bias, window_size=self.window_size,
        )


# preset name -> fields (fox_models.presets adds the GPT-2 vocabulary); Transformer (Pro) is a FoX config
PRESETS = {f"transformer-llama-{size}": dict(size_fields(size, TRANSFORMER_HEADS[size]), hidden_ratio=4)
           for size in SIZES}
# Transformer-SWA: the official configs' window of 2048 (configs/experiment/longcrawl64/transformer_swa)
PRESETS.update({f"transformer-swa-{size}": dict(PRESETS[f"transformer-llama-{size}"], window_size=2048)
                for size in SIZES})
TINY = {"transformer-llama-tiny": dict(PRESETS["transformer-llama-125m"], hidden_size=128, num_hidden_layers=2,
                                       num_heads=2),
        "transformer-swa-tiny": dict(PRESETS["transformer-llama-125m"], hidden_size=128, num_hidden_layers=2,
                                     num_heads=2, window_size=8)}
