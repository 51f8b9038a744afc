"""The Transformer (LLaMA) baseline in the published layout (``transformer-project_fox``): FoX's blocks with
plain RoPE attention (SDPA). The Transformer (Pro) is a FoX config (``fox_models.fox``)."""

from fox_models.transformer.configuration import PRESETS, TINY, TransformerConfig
from fox_models.transformer.modeling import TransformerAttention, TransformerForCausalLM, TransformerModel

__all__ = ["PRESETS", "TINY", "TransformerAttention", "TransformerConfig", "TransformerForCausalLM",
           "TransformerModel"]
