"""Mamba-2 baseline in the released layout (``mamba2-project_fox``, Hugging Face Mamba-2 names).

``backbone.embeddings``, ``backbone.layers.{i}.norm`` + ``.mixer`` (``in_proj``, ``conv1d`` with bias,
``dt_bias``, ``A_log``, ``D``, gated ``norm``, ``out_proj``), ``backbone.norm_f``, ``lm_head``. Per head h
with state (head_dim x state_size): ``S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T``,
``y_t = S_t C_t + D_h x_t``, ``dt = softplus(W_dt x + dt_bias)``, ``A = -exp(A_log)``; the output is
``RMSNorm(y * silu(z))`` (normalised after the gate, per group). The scan is gated linear attention with
a per-head scalar decay (fox_models.recurrent_ops: flash-linear-attention on CUDA when installed).
"""

from fox_models.mamba2.configuration import PRESETS, TINY, Mamba2Config
from fox_models.mamba2.modeling import (
    CausalConv1d,
    GatedRMSNorm,
    Mamba2Block,
    Mamba2ForCausalLM,
    Mamba2Mixer,
    Mamba2Model,
    Mamba2PreTrainedModel,
)

__all__ = ["PRESETS", "TINY", "CausalConv1d", "GatedRMSNorm", "Mamba2Block", "Mamba2Config", "Mamba2ForCausalLM",
           "Mamba2Mixer", "Mamba2Model", "Mamba2PreTrainedModel"]
