"""SAMBA (Ren et al. 2024) as the paper's baseline (``samba-project_fox``): Mamba (v1) layers and
sliding-window attention layers in turn, each followed by a SwiGLU MLP, in the reference implementation's
layout (``backbone.layers.{i}.mixer``, ``norm_f``). The Mamba layers' selective scan runs Triton kernels on
CUDA and a chunked PyTorch scan on the CPU (``fox_models.samba.selective_scan``); the attention layers are
``fox_layers.ForgettingAttentionLayer`` with RoPE, a window and no forget gate.
"""

from fox_models.samba.configuration import PRESETS, TINY, SambaConfig
from fox_models.samba.modeling import (
    MambaMixer,
    SambaBlock,
    SambaCache,
    SambaForCausalLM,
    SambaModel,
    SambaPreTrainedModel,
)

__all__ = ["PRESETS", "TINY", "MambaMixer", "SambaBlock", "SambaCache", "SambaConfig", "SambaForCausalLM",
           "SambaModel", "SambaPreTrainedModel"]
