"""The Transformer (LLaMA) config in the format of the published checkpoints, and its named configs."""

from __future__ import annotations

from fox_models import preset_fields
from fox_models.compat import CACHE_KWARG
from fox_models.fox.configuration import _DecoderConfig, require_head_dim


class TransformerConfig(_DecoderConfig):
    """Transformer (LLaMA): RoPE attention, SwiGLU MLP, RMSNorm; with ``window_size`` the paper's
    Transformer-SWA (sliding-window attention over the last ``window_size`` tokens)."""

    model_type = "transformer-project_fox"
    keys_to_ignore_at_inference = [CACHE_KWARG]  # the outputs' cache, by the installed release's name

    def __init__(self, **kwargs):  # transformers 5 needs each config class to define its own __init__
        super().__init__(**kwargs)
        require_head_dim(self.hidden_size, self.num_heads, rope=True)

    def attention_kwargs(self) -> dict:
        return dict(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, fgate_type="none", use_rope=True,
            rope_base=self.rope_base, attention_bias=self.attention_bias, window_size=self.window_size,
        )


# preset name -> fields (fox_models.presets adds the GPT-2 vocabulary): the Transformer (LLaMA) and
# Transformer-SWA; the Transformer (Pro) is a FoX config (fox_models.fox)
PRESETS = preset_fields.PRESETS["transformer"]
TINY = preset_fields.TINY["transformer"]
