"""fox-layers: the parts of a Forgetting Transformer block as plain nn.Modules with explicit arguments."""

from fox_layers.attention import (
    AttentionState,
    ForgettingAttentionLayer,
    bare_linear,
    bare_module,
    decay_time_bias,
    set_attention_kernel,
)
from fox_layers.checks import require_head_dim, require_int, require_positive
from fox_layers.kernels import use_triton
from fox_layers.kernels.norm_gate import norm_gate
from fox_layers.mlp import SwiGLUMLP, intermediate_size_for
from fox_layers.norms import GroupRMSNorm, RMSNorm, rms_norm
from fox_layers.rope import apply_rope
from fox_layers.shift import ShiftLinear, previous_tokens

__version__ = "0.1.0"
__all__ = [
    "AttentionState",
    "ForgettingAttentionLayer",
    "GroupRMSNorm",
    "RMSNorm",
    "ShiftLinear",
    "SwiGLUMLP",
    "apply_rope",
    "bare_linear",
    "bare_module",
    "decay_time_bias",
    "intermediate_size_for",
    "norm_gate",
    "previous_tokens",
    "require_head_dim",
    "require_int",
    "require_positive",
    "rms_norm",
    "set_attention_kernel",
    "use_triton",
    "__version__",
]
