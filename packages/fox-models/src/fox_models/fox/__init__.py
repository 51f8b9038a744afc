"""FoX, the Forgetting Transformer (Pro and LLaMA variants), in the published layout
(``forgetting_transformer-project_fox``); its config also describes the Transformer (Pro): FoX (Pro) without
forget gate, with RoPE."""

from fox_models.fox.configuration import PRESETS, TINY, ForgettingTransformerConfig
from fox_models.fox.modeling import (
    ForgettingTransformerForCausalLM,
    ForgettingTransformerModel,
    ForgettingTransformerPreTrainedModel,
    FoxBlock,
)
from fox_models.preset_fields import SIZES

__all__ = ["PRESETS", "SIZES", "TINY", "FoxBlock", "ForgettingTransformerConfig",
           "ForgettingTransformerForCausalLM", "ForgettingTransformerModel", "ForgettingTransformerPreTrainedModel"]
