"""DeltaNet (Schlag et al. 2021; Yang et al. 2024) in the released layout (``delta_net-project_fox``):
FoX-layout blocks ``attn_norm``/``attn``/``mlp_norm``/``mlp`` (SwiGLU, fused ``gate_proj`` [2I, D]) around a
delta-rule mixer with short convolutions, ``model.embeddings``, ``model.norm``, ``lm_head``. As in the
released code, the mixer scales ``q`` by ``head_dim ** -0.5`` (the kernels' default scale).
"""

from fox_models.delta_net.configuration import PRESETS, TINY, DeltaNetConfig
from fox_models.delta_net.modeling import (
           DeltaNetAttention,
           DeltaNetForCausalLM,
           DeltaNetModel,
           DeltaNetPreTrainedModel,
)

__all__ = ["PRESETS", "TINY", "DeltaNetAttention", "DeltaNetConfig", "DeltaNetForCausalLM", "DeltaNetModel",
           "DeltaNetPreTrainedModel"]
