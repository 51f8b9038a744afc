"""HGRN2 (Qin et al. 2024) in the released layout (``hgrn2-project_fox``): FoX-layout blocks
``attn_norm``/``attn``/``mlp_norm``/``mlp`` (SwiGLU, fused ``gate_proj`` [2I, D]) around a gated linear
attention mixer, ``model.embeddings``, ``model.lower_bounds``, ``model.norm``, ``lm_head``.

Two behaviours of the released code are kept on purpose, because the checkpoints were trained with them:
- HGRN2 stores ``model.lower_bounds`` but its blocks never pass the lower bound to the layer, so every
  layer's forget gate is ``sigmoid(f)`` (``apply_lower_bound=True`` switches the HGRN2 paper's bound on);
- the mixer scales ``q`` by ``head_dim ** -0.5`` (the kernels' default scale).
"""

from fox_models.hgrn2.configuration import PRESETS, TINY, HGRN2Config
from fox_models.hgrn2.modeling import HGRN2Attention, HGRN2ForCausalLM, HGRN2Model, HGRN2PreTrainedModel

__all__ = ["PRESETS", "TINY", "HGRN2Attention", "HGRN2Config", "HGRN2ForCausalLM", "HGRN2Model",
           "HGRN2PreTrainedModel"]
